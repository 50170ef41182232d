"""The functional API: validate, pick the compiled variant, launch. No autograd, no tiling here.

The hot path is written for the host: (x, w) properties seen before are recognised with one dict lookup
(``operands.known_operands``), outputs come from ``torch.empty_like``, and a 2-D contiguous input
goes to the kernel as it is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from . import dispatch
from . import validation as v
from .compile_cache import kernel
from .device import device_arch, device_facts, on_device
from .kernels.config import on_override_change
from .operands import known_operands, operands
from .views import aligned_vector, finish, kernel_view, output_like, rows_view, vector_output
from .vocab import DTYPE_NAMES, dtype_name


def _check_output(name, given, shape, dtype, device):
    if given is not None:
        v.check_output(name, given, shape, dtype, device)


def cake_rmsnorm_train_forward(
    x, w, eps, *, residual=None, out=None, rstd=None, residual_out=None, weight_offset: float = 0.0
):
    """RMSNorm forward (optionally ``h = x + residual`` first). Returns ``(y, rstd)`` or
    ``(y, rstd, h_new)``; rstd is FP32 with one value per row."""
    op = known_operands(x, w)
    if op is None:
        v.check_activation(x)
        v.check_weight(w, x)
    eps = v.check_eps(eps)
    weight_offset = v.check_weight_offset(weight_offset)
    if residual is not None:
        v.check_like("residual", residual, x)
    elif residual_out is not None:
        raise ValueError("residual_out is only written in residual mode: pass residual= as well")
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    if out is not None or rstd is not None or residual_out is not None:
        _check_output("out", out, x.shape, x.dtype, x.device)
        _check_output("rstd", rstd, (rows,), torch.float32, x.device)
        _check_output("residual_out", residual_out, x.shape, x.dtype, x.device)
    if op is None:
        op = operands(x, w)
    vec = dispatch.vector_elems(hidden, op.act)

    y, y_copy = output_like(out, x, vec)
    r, r_copy = vector_output(rstd, rows, torch.float32, op.device)
    h_new = h_copy = None
    if residual is not None:
        h_new, h_copy = output_like(residual_out, x, vec)

    if rows > 0:
        fn = kernel("fwd", op.arch, op.act, op.w_name, hidden, residual is not None, weight_offset)
        with on_device(op.device):
            fn(
                kernel_view(x, vec),
                None if residual is None else kernel_view(residual, vec),
                aligned_vector(w, vec),
                rows_view(y, hidden),
                None if residual is None else rows_view(h_new, hidden),
                r,
                eps,
            )
    if residual is None:
        return finish(y, y_copy), finish(r, r_copy)
    return finish(y, y_copy), finish(r, r_copy), finish(h_new, h_copy)


def cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, *, residual=False) -> int:
    """Bytes of the FP32 dW partial rows a backward of up to ``rows`` rows needs (any dtype)."""
    v.check_count("rows", rows, 0)
    v.check_count("hidden", hidden, 1, v.MAX_HIDDEN)
    device = v.check_cuda_device(device)
    device_arch(device)
    facts = device_facts(device)
    most = max(
        dispatch.most_partial_rows(rows, hidden, act, w, residual, facts)
        for act in DTYPE_NAMES
        for w in {act, "fp32"}
    )
    return dispatch.partial_rows_bytes(most, hidden)


def cake_rmsnorm_train_backward_workspace(rows, hidden, device, *, residual=False) -> torch.Tensor:
    nbytes = cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, residual=residual)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _partials(workspace, partial_rows: int, hidden: int, device) -> torch.Tensor:
    """The FP32 (partial_rows, H) view (row stride padded to 4) the backward writes dW rows into: carved
    from the caller's workspace, or freshly allocated."""
    stride = dispatch.partial_row_stride(hidden)
    if workspace is None:
        partials = torch.empty((partial_rows, stride), dtype=torch.float32, device=device)
    else:
        partials = workspace[: partial_rows * stride * 4].view(torch.float32).view(partial_rows, stride)
    return partials if stride == hidden else partials[:, :hidden]


def cake_rmsnorm_train_backward(
    g,
    x,
    w,
    rstd,
    *,
    deterministic=True,
    g_residual=None,
    workspace=None,
    dx=None,
    dw=None,
    weight_offset: float = 0.0,
    dw_dtype: torch.dtype = torch.float32,
):
    """RMSNorm backward: ``(dx, dw)``. ``x`` is what the forward normalized (x, or h_new in residual
    mode); in residual mode ``g_residual`` (dL/dh_new) is added into dx. dw is FP32 unless
    ``dw_dtype`` says otherwise (autograd asks for w's dtype). ``deterministic=False`` is accepted and
    runs the same deterministic kernels: an atomic dW was built and measured slower on the H200 at
    every T tried (perf/results/2026-11-30-h200-atomic-dw-experiment)."""
    op = known_operands(x, w)
    if op is None:
        v.check_activation(x)
    v.check_like("g", g, x)
    if op is None:
        v.check_weight(w, x)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    v.check_rstd(rstd, rows, x.device)
    if g_residual is not None:
        v.check_like("g_residual", g_residual, x)
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    weight_offset = v.check_weight_offset(weight_offset)
    dw_dtype = v.check_dw_dtype(dw_dtype)
    if dx is not None or dw is not None:
        _check_output("dx", dx, x.shape, x.dtype, x.device)
        _check_output("dw", dw, (hidden,), dw_dtype, x.device)
    if workspace is not None:
        v.check_workspace(workspace, x.device)
    if op is None:
        op = operands(x, w)
    return _backward(op, g, x, w, rstd, g_residual, workspace, dx, dw, weight_offset, dw_dtype)


def backward_from_saved(g, h, w, rstd, g_residual, weight_offset: float):
    """The backward for autograd: h, w, rstd are what the forward validated and saved, and the engine
    has already matched g (and g_residual) to the outputs' shape, dtype and device, so only the
    (x, w) facts are looked up again. dw comes back in w's dtype."""
    op = known_operands(h, w) or operands(h, w)
    return _backward(op, g, h, w, rstd, g_residual, None, None, None, weight_offset, w.dtype)


class _BackwardPlan(NamedTuple):
    programs: int
    partial_rows: int
    workspace_bytes: int  # the least a caller's workspace must hold
    vec: int


@lru_cache(maxsize=4096)
def _backward_plan(op, rows, residual) -> _BackwardPlan:
    """The launch shape of a backward call, looked up once per distinct (operands, T, residual)."""
    programs, partial_rows = dispatch.backward_launch(
        max(rows, 1), op.hidden, op.act, op.w_name, residual, op.facts
    )
    return _BackwardPlan(
        programs,
        partial_rows,
        dispatch.partial_rows_bytes(partial_rows, op.hidden),
        dispatch.vector_elems(op.hidden, op.act),
    )


on_override_change(_backward_plan.cache_clear)


def _backward(op, g, x, w, rstd, g_residual, workspace, dx, dw, weight_offset, dw_dtype):
    hidden = op.hidden
    rows = x.numel() // hidden
    residual = g_residual is not None
    plan = _backward_plan(op, rows, residual)
    vec = plan.vec
    if workspace is not None and workspace.numel() < plan.workspace_bytes:
        raise ValueError(
            f"workspace holds {workspace.numel()} bytes; this call needs at least {plan.workspace_bytes}"
        )
    dx_t, dx_copy = output_like(dx, x, vec)
    dw_t, dw_copy = vector_output(dw, hidden, dw_dtype, op.device)

    if rows == 0:  # nothing to launch (and nothing to compile)
        dw_t.zero_()
    else:
        bwd = kernel("bwd", op.arch, op.act, op.w_name, hidden, residual, weight_offset)
        reduce = kernel("dw", op.arch, dtype_name(dw_dtype), hidden)
        partials = _partials(workspace, plan.partial_rows, hidden, op.device)
        with on_device(op.device):
            bwd(
                kernel_view(g, vec),
                kernel_view(x, vec),
                aligned_vector(w, vec),
                rstd if rstd.is_contiguous() else rstd.contiguous(),
                kernel_view(g_residual, vec) if residual else None,
                rows_view(dx_t, hidden),
                partials,
                plan.programs,
            )
            reduce(partials, dw_t)
    return finish(dx_t, dx_copy), finish(dw_t, dw_copy)
