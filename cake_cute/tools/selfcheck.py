"""``cake-cute check``: the kernels on this GPU against the FP64 reference, over a built-in matrix.

Each case runs the functional forward and backward into caller-owned outputs pre-filled with NaN (an
unwritten element fails), then the autograd path, and compares relative-norm errors: y, h_new and dx
to ``tolerance(dtype)``, rstd and dw to ``FP32_TOLERANCE``, autograd's dw to ``tolerance(w dtype)``.
dx = rstd * (a - xhat * c) cancels in short rows, where FP32 cannot beat
``FP32_TOLERANCE * ||rstd * a||``; that term, relative to ||dx||, is added to the dx limit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

import torch

from ..reference import backward_reference, forward_reference, rel_error, tolerance
from ..vocab import DTYPES as VOCAB_DTYPES
from ..vocab import dtype_name

EPS = 1e-6
FP32_TOLERANCE = 1e-5
MAX_ELEMENTS = 1 << 26  # per tensor: keeps the FP64 reference of the widest rows within a few GB
DTYPES = tuple(d.torch for d in VOCAB_DTYPES)
FULL_HIDDEN = (1, 7, 512, 1024, 4096, 4097, 7168, 8192, 65536, 262144)
QUICK_HIDDEN = (7, 4096, 4097, 65536)
FULL_ROWS = (1, 2, 129, 4096)
QUICK_ROWS = (1, 129)
QUANTITIES = ("y", "rstd", "h", "dx", "dw", "ag_y", "ag_dx", "ag_dres", "ag_dw")


@dataclass(frozen=True)
class Case:
    """One self-check case: dtypes, H, rows T, residual mode and weight offset."""

    dtype: torch.dtype
    w_dtype: torch.dtype
    hidden: int
    rows: int
    residual: bool
    weight_offset: float = 0.0

    def label(self) -> str:
        """The case's columns of a result row (under ``HEADER``)."""
        res = "res" if self.residual else "-"
        dtypes = f"{dtype_name(self.dtype):<5}{dtype_name(self.w_dtype):<5}"
        return f"{dtypes}{self.hidden:>7}{self.rows:>6}  {res:<4}{self.weight_offset:g}"


HEADER = f"{'act':<5}{'w':<5}{'H':>7}{'T':>6}  {'res':<4}off"


@dataclass
class CaseResult:
    """Relative errors of one case against the FP64 reference, their limits, and a crash's message."""

    case: Case
    errors: dict[str, float]
    limits: dict[str, float]
    error: str | None = None

    @property
    def ok(self) -> bool:
        # A NaN error compares False, so an unwritten (NaN-poisoned) output fails.
        return self.error is None and all(e <= self.limits[k] for k, e in self.errors.items())


def gpu_problem() -> str | None:
    """Why this machine cannot run the kernels (no CUDA device, unsupported GPU), or None."""
    from ..vocab import ARCH_BY_CAPABILITY

    if not torch.cuda.is_available():
        return "no CUDA GPU is available (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability()
    if capability not in ARCH_BY_CAPABILITY:
        name = torch.cuda.get_device_name()
        return f"{name} is sm_{capability[0]}{capability[1]}; cake_cute needs sm_90, sm_100 or sm_103"
    return None


def case_matrix(quick: bool = False) -> list[Case]:
    """dtypes x H x T x residual within MAX_ELEMENTS, FP32 weights, Gemma's offset, an empty batch."""
    hiddens, rows = (QUICK_HIDDEN, QUICK_ROWS) if quick else (FULL_HIDDEN, FULL_ROWS)
    cases = [
        Case(dtype, dtype, hidden, t, residual)
        for dtype in DTYPES
        for hidden in hiddens
        for t in rows
        for residual in (False, True)
        if t * hidden <= MAX_ELEMENTS
    ]
    cases += [
        Case(torch.bfloat16, torch.float32, 4096, 129, True),
        Case(torch.float16, torch.float32, 4097, 129, False),
        Case(torch.bfloat16, torch.bfloat16, 4096, 129, False, 1.0),
        Case(torch.bfloat16, torch.bfloat16, 4096, 0, True),
    ]
    return cases


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _dx_limit(case: Case, g, w, rstd, dx_ref) -> float:
    """tolerance(dtype) plus the FP32 cancellation floor of dx (see the module docstring)."""
    scale = (g.double() * (w.double() + case.weight_offset) * rstd.double().reshape(-1, 1)).norm().item()
    norm = dx_ref.norm().item()
    return tolerance(case.dtype) + (FP32_TOLERANCE * scale / norm if norm > 0 else 0.0)


def _functional(case: Case, x, w, residual, g, g_res, errors: dict, limits: dict):
    """Forward and backward into NaN-poisoned caller-owned outputs; returns the dx reference."""
    from .. import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward

    shape, device, rows = x.shape, x.device, case.rows
    out, rstd = _poisoned(shape, case.dtype, device), _poisoned((rows,), torch.float32, device)
    h_out = _poisoned(shape, case.dtype, device) if case.residual else None
    cake_rmsnorm_train_forward(
        x, w, EPS, residual=residual, out=out, rstd=rstd, residual_out=h_out, weight_offset=case.weight_offset
    )
    y_ref, rstd_ref, h_ref = forward_reference(x, w, EPS, residual=residual, weight_offset=case.weight_offset)
    errors.update(y=rel_error(out, y_ref), rstd=rel_error(rstd, rstd_ref))
    if case.residual:
        errors["h"] = rel_error(h_out, h_ref)
    h = h_out if case.residual else x

    dx, dw = _poisoned(shape, case.dtype, device), _poisoned((case.hidden,), torch.float32, device)
    cake_rmsnorm_train_backward(
        g, h, w, rstd, g_residual=g_res, dx=dx, dw=dw, weight_offset=case.weight_offset
    )
    dx_ref, dw_ref = backward_reference(g, h, w, rstd, g_residual=g_res, weight_offset=case.weight_offset)
    errors.update(dx=rel_error(dx, dx_ref), dw=rel_error(dw, dw_ref))
    limits["dx"] = _dx_limit(case, g, w, rstd, dx_ref)
    return y_ref, dx_ref, dw_ref


def _autograd(case: Case, x, w, residual, g, g_res, refs, errors: dict) -> None:
    """cake_rmsnorm with autograd: y, and the gradients of x, residual and w."""
    from .. import cake_rmsnorm

    y_ref, dx_ref, dw_ref = refs
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ra = residual.clone().requires_grad_() if case.residual else None
    outs = cake_rmsnorm(xa, wa, EPS, residual=ra, weight_offset=case.weight_offset)
    if case.residual:
        torch.autograd.backward(list(outs), [g, g_res])
        y = outs[0]
        errors["ag_dres"] = rel_error(ra.grad, dx_ref)
    else:
        torch.autograd.backward(outs, g)
        y = outs
    errors.update(
        ag_y=rel_error(y.detach(), y_ref), ag_dx=rel_error(xa.grad, dx_ref), ag_dw=rel_error(wa.grad, dw_ref)
    )


def run_case(case: Case, device: torch.device) -> CaseResult:
    """Errors of every output of one case (an exception is a failure with its message)."""
    # Each output is held to its dtype's tolerance (the module docstring's list).
    limits = {
        **dict.fromkeys(("y", "h", "dx", "ag_y"), tolerance(case.dtype)),
        **dict.fromkeys(("rstd", "dw"), FP32_TOLERANCE),
        "ag_dw": tolerance(case.w_dtype),
    }
    errors: dict[str, float] = {}
    generator = torch.Generator(device=device).manual_seed(case.hidden * 7919 + case.rows)

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    shape = (case.rows, case.hidden)
    x, g = randn(*shape), randn(*shape)
    w = (randn(case.hidden, dtype=torch.float32) * 0.5 + 1).to(case.w_dtype)
    residual, g_res = (randn(*shape), randn(*shape)) if case.residual else (None, None)
    try:
        refs = _functional(case, x, w, residual, g, g_res, errors, limits)
        limits["ag_dx"] = limits["ag_dres"] = limits["dx"]
        _autograd(case, x, w, residual, g, g_res, refs, errors)
    except Exception as exc:  # a crash in one case is reported, the others still run
        return CaseResult(case, errors, limits, f"{type(exc).__name__}: {exc}".splitlines()[0])
    return CaseResult(case, errors, limits)


def format_result(result: CaseResult) -> str:
    """One printed row: PASS/FAIL, the case, each quantity's error (``-`` where it does not apply)."""
    status = "PASS" if result.ok else "FAIL"
    cells = [f"{result.errors[q]:9.1e}" if q in result.errors else f"{'-':>9}" for q in QUANTITIES]
    line = f"{status}  {result.case.label()}  " + "".join(cells)
    return line + (f"  {result.error}" if result.error else "")


def run_check(quick: bool = False, stream: TextIO = sys.stdout) -> int:
    """Run the (``quick``) matrix on this GPU, a row per case to ``stream``; exit status 0 if all pass."""
    device = torch.device("cuda", torch.cuda.current_device())
    cases = case_matrix(quick)
    print(
        f"cake-cute check: {len(cases)} cases on {torch.cuda.get_device_name(device)} "
        f"(relative-norm errors vs FP64)",
        file=stream,
    )
    print(f"{'':6}{HEADER}  " + "".join(f"{q:>9}" for q in QUANTITIES), file=stream)
    failed = 0
    for case in cases:
        result = run_case(case, device)
        failed += not result.ok
        print(format_result(result), file=stream, flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed", file=stream)
    return 1 if failed else 0
