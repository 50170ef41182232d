"""The functional API: validate, pick the compiled variant, launch. No autograd, no tiling here.

The hot path is written for the host: (x, w) properties seen before are recognised with one dict lookup
(``operands.known_operands``), outputs come from ``torch.empty_like``, and a 2-D contiguous input
goes to the kernel as it is. Plain calls of a signature this path has launched once are served by the
native path (``native``) before any of this runs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from . import launch_plan, native
from . import validation as v
from .compile_cache import kernel
from .device import device_arch, device_facts, on_device
from .kernels.config import on_override_change
from .operands import known_operands
from .operands import operands as validated_operands
from .views import aligned_vector, finish, kernel_view, output_like, rows_view, vector_output
from .vocab import DTYPE_NAMES, dtype_name


def cake_rmsnorm_train_forward(
    x, w, eps, *, residual=None, out=None, rstd=None, residual_out=None, weight_offset: float = 0.0
):
    """RMSNorm forward, optionally fused with the residual add, in one pass.

    Per row: ``h = round(x + residual)`` (residual mode), ``rstd = 1 / sqrt(mean(h^2) + eps)`` in FP32,
    ``y = round(h * rstd * (w + weight_offset))``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., H]`` activations on a supported CUDA device, bf16 / fp16 / fp32, 1 <= H <= 262144;
        leading dims collapse into rows.
    w : torch.Tensor
        ``[H]`` weight, x's dtype or fp32, on x's device.
    eps : float
        Finite, >= 0.
    residual : torch.Tensor, optional
        Same shape, dtype and device as x: normalize ``h = x + residual`` and return it as h_new.
    out, rstd, residual_out : torch.Tensor, optional
        Caller-owned outputs (y: x's shape and dtype; rstd: FP32 ``[rows]``; h_new: x's shape and
        dtype, residual mode only). Contiguous aligned ones are written directly, others receive a
        copy; the returned tensors are these.
    weight_offset : float, default 0.0
        Added to w in FP32 (1.0 gives Gemma's ``1 + w``); each distinct value is a compiled variant.

    Returns
    -------
    tuple of torch.Tensor
        ``(y, rstd)``, or ``(y, rstd, h_new)`` in residual mode; rstd is FP32 with one value per row.

    Raises
    ------
    TypeError
        An argument of the wrong kind or dtype (x, w, residual, an output, eps, weight_offset).
    ValueError
        A wrong shape or device, x on the CPU or an unsupported GPU, ``residual_out`` without
        ``residual``, a negative or non-finite eps; raised before any launch, with no output written.
    """
    extension = native.extension
    if extension is not None and out is None and rstd is None and residual_out is None:
        outs = extension.forward(x, w, eps, residual, weight_offset)
        if outs is not None:
            return outs
    return train_forward_python(x, w, eps, residual, out, rstd, residual_out, weight_offset)


def train_forward_python(x, w, eps, residual=None, out=None, rstd=None, residual_out=None, weight_offset=0.0):
    """``cake_rmsnorm_train_forward`` on the Python path: validation, then the launch; a signature it
    launched is registered with the native path, which serves its later plain calls."""
    operands = known_operands(x, w)
    if operands is None:
        v.check_activation(x)
        v.check_weight(w, x)
    eps = v.check_eps(eps)
    weight_offset = v.check_weight_offset(weight_offset)
    if residual is not None:
        v.check_like("residual", residual, x)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    if out is not None or rstd is not None or residual_out is not None:
        v.check_forward_outputs(x, rows, residual, out, rstd, residual_out)
    if operands is None:
        operands = validated_operands(x, w)
    vec = launch_plan.vector_elems(hidden, operands.act)

    y, y_copy = output_like(out, x, vec)
    r, r_copy = vector_output(rstd, rows, torch.float32, operands.device)
    h_new = h_copy = None
    if residual is not None:
        h_new, h_copy = output_like(residual_out, x, vec)

    if rows > 0:
        fn = kernel(
            "fwd", operands.arch, operands.act, operands.w_name, hidden, residual is not None, weight_offset
        )
        with on_device(operands.device):
            fn(
                kernel_view(x, vec),
                None if residual is None else kernel_view(residual, vec),
                aligned_vector(w, vec),
                rows_view(y, hidden),
                None if residual is None else rows_view(h_new, hidden),
                r,
                eps,
            )
        native.register(operands, x, w, weight_offset, residual is not None, fn, native_backward_plan)
    if residual is None:
        return finish(y, y_copy), finish(r, r_copy)
    return finish(y, y_copy), finish(r, r_copy), finish(h_new, h_copy)


def cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, *, residual=False) -> int:
    """Bytes of workspace a backward of up to ``rows`` rows of ``hidden`` needs, for any dtype.

    The workspace holds the FP32 partial rows of dW the backward writes before they are reduced.

    Parameters
    ----------
    rows : int
        The most rows (T) a backward using the workspace will have; >= 0.
    hidden : int
        The hidden size H, 1 <= H <= 262144.
    device : torch.device, str or int
        The CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)`` or ``1``): the number of
        partial rows follows its SM count.
    residual : bool, default False
        Size it for residual-mode backwards (``g_residual`` given).

    Returns
    -------
    int
        Bytes; a workspace of at least this size serves every backward of up to ``rows`` rows.

    Raises
    ------
    TypeError
        rows or hidden is not an int.
    ValueError
        rows or hidden out of range; device names no CUDA device, or one that does not exist, or
        torch sees no CUDA device, or the GPU is not supported.
    """
    v.check_count("rows", rows, 0)
    v.check_count("hidden", hidden, 1, v.MAX_HIDDEN)
    device = v.check_cuda_device(device)
    device_arch(device)
    facts = device_facts(device)
    most = max(
        launch_plan.most_partial_rows(rows, hidden, act, w, residual, facts)
        for act in DTYPE_NAMES
        for w in {act, "fp32"}
    )
    return launch_plan.partial_rows_bytes(most, hidden)


def cake_rmsnorm_train_backward_workspace(rows, hidden, device, *, residual=False) -> torch.Tensor:
    """A zero-filled workspace for backwards of up to ``rows`` rows.

    Parameters
    ----------
    rows, hidden, device, residual
        As for ``cake_rmsnorm_train_backward_workspace_bytes``.

    Returns
    -------
    torch.Tensor
        A contiguous 1-D ``uint8`` tensor on ``device`` with a 16-byte aligned base.

    Raises
    ------
    TypeError, ValueError
        The errors of ``cake_rmsnorm_train_backward_workspace_bytes``.
    """
    nbytes = cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, residual=residual)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _partials(workspace, partial_rows: int, hidden: int, device) -> torch.Tensor:
    """The FP32 (partial_rows, H) view (row stride padded to 4) the backward writes dW rows into: carved
    from the caller's workspace, or freshly allocated."""
    stride = launch_plan.partial_row_stride(hidden)
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
    """RMSNorm backward: dx in one pass, dw as a fixed-order sum of FP32 partial rows.

    Per row: ``a = g * (w + weight_offset)``, ``xhat = x * rstd``, ``c = sum(a * xhat) / H``,
    ``dx = round(rstd * (a - xhat * c) [+ g_residual])``; ``dw = sum over rows of g * xhat`` in FP32.

    Parameters
    ----------
    g : torch.Tensor or sequence of torch.Tensor
        dL/dy, x's shape, dtype and device; or 2 to 3 such tensors whose sum is dL/dy (the dgrads of
        the layers that read y): the kernel sums them in FP32, left to right, and rounds the sum once
        to x's dtype -- what torch.compile's fused add of them stores -- instead of a separate add.
    x : torch.Tensor
        What the forward normalized: x, or h_new in residual mode (``[..., H]``, bf16 / fp16 / fp32).
    w : torch.Tensor
        ``[H]`` weight, x's dtype or fp32.
    rstd : torch.Tensor
        FP32 ``[rows]`` from the forward.
    deterministic : bool, default True
        Accepted for API compatibility; both values run the same deterministic kernels (an atomic
        dW measured slower: perf/results/2026-11-30-h200-atomic-dw-experiment/).
    g_residual : torch.Tensor, optional
        dL/dh_new in residual mode (x's shape and dtype), added into dx: dx is then the gradient of
        both x and residual.
    workspace : torch.Tensor, optional
        A contiguous 1-D uint8 tensor, 16-byte aligned, of at least
        ``cake_rmsnorm_train_backward_workspace_bytes(rows, H, device)`` bytes; without one, the
        partial rows are allocated per call.
    dx, dw : torch.Tensor, optional
        Caller-owned outputs (dx: x's shape and dtype; dw: ``[H]`` of ``dw_dtype``).
    weight_offset : float, default 0.0
        The forward's offset.
    dw_dtype : torch.dtype, default torch.float32
        dw's dtype (fp32, bf16 or fp16; autograd asks for w's); the sum is FP32, rounded once.

    Returns
    -------
    tuple of torch.Tensor
        ``(dx, dw)``.

    Raises
    ------
    TypeError
        An argument of the wrong kind or dtype (including ``deterministic`` that is not a bool).
    ValueError
        A wrong shape or device, an unaligned or too small workspace, x on the CPU or an unsupported
        GPU; raised before any launch, with no output written.
    """
    extension = native.extension
    if extension is not None and workspace is None and dx is None and dw is None:
        outs = extension.backward(g, x, w, rstd, g_residual, weight_offset, dw_dtype)
        if outs is not None:
            return outs
    operands = known_operands(x, w)
    if operands is None:
        v.check_activation(x)
    g_parts = v.check_gradient_parts(g, x)
    if operands is None:
        v.check_weight(w, x)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    v.check_rstd(rstd, rows, x.device)
    if g_residual is not None:
        v.check_like("g_residual", g_residual, x)
    v.check_bool("deterministic", deterministic)
    weight_offset = v.check_weight_offset(weight_offset)
    dw_dtype = v.check_dw_dtype(dw_dtype)
    if dx is not None or dw is not None:
        v.check_backward_outputs(x, dx, dw, dw_dtype)
    if workspace is not None:
        v.check_workspace(workspace, x.device)
    if operands is None:
        operands = validated_operands(x, w)
    return _backward(operands, g_parts, x, w, rstd, g_residual, workspace, dx, dw, weight_offset, dw_dtype)


def backward_from_saved(g, h, w, rstd, g_residual, weight_offset: float):
    """The backward for autograd: h, w, rstd are what the forward validated and saved, and the engine
    has already matched g (and g_residual) to the outputs' shape, dtype and device, so only the
    (x, w) facts are looked up again. dw comes back in w's dtype."""
    operands = known_operands(h, w) or validated_operands(h, w)
    return _backward(operands, (g,), h, w, rstd, g_residual, None, None, None, weight_offset, w.dtype)


class _BackwardPlan(NamedTuple):
    programs: int
    partial_rows: int
    workspace_bytes: int  # the least a caller's workspace must hold
    vec: int


@lru_cache(maxsize=4096)
def _backward_plan(operands, rows, residual) -> _BackwardPlan:
    """The launch shape of a backward call (g in summands or not), looked up once per distinct
    (operands, T, residual)."""
    programs, partial_rows = launch_plan.backward_launch(
        max(rows, 1), operands.hidden, operands.act, operands.w_name, residual, operands.facts
    )
    return _BackwardPlan(
        programs,
        partial_rows,
        launch_plan.partial_rows_bytes(partial_rows, operands.hidden),
        launch_plan.vector_elems(operands.hidden, operands.act),
    )


on_override_change(_backward_plan.cache_clear)


def _backward_kernels(operands, residual: bool, weight_offset: float, dw_dtype, g_parts: int = 1):
    """The backward's two kernels: dx with the FP32 partial rows of dW (from ``g_parts`` summands of
    g), and their reduction."""
    parts = (g_parts,) if g_parts > 1 else ()  # the one-summand variant keeps its field tuple
    return (
        kernel(
            "bwd",
            operands.arch,
            operands.act,
            operands.w_name,
            operands.hidden,
            residual,
            weight_offset,
            *parts,
        ),
        kernel("dw", operands.arch, dtype_name(dw_dtype), operands.hidden),
    )


def native_backward_plan(
    operands, weight_offset: float, rows: int, residual: bool, dw_dtype, g_parts: int = 1
):
    """The native path's planner: the kernels (TVM-FFI handles) and launch plan of one backward shape
    (of g in ``g_parts`` summands), the very ones ``_backward`` launches with."""
    plan = _backward_plan(operands, rows, residual)
    kernels = _backward_kernels(operands, residual, weight_offset, dw_dtype, g_parts)
    handles = tuple(map(native.kernel_handle, kernels))
    if 0 in handles:
        raise RuntimeError("cake_cute: a backward kernel has no TVM-FFI function handle")
    return (*handles, plan.programs, plan.partial_rows, launch_plan.partial_row_stride(operands.hidden))


def _backward(operands, g_parts, x, w, rstd, g_residual, workspace, dx, dw, weight_offset, dw_dtype):
    """The launch of a validated backward; ``g_parts``: the tuple of g's summands (usually one)."""
    hidden = operands.hidden
    rows = x.numel() // hidden
    residual = g_residual is not None
    plan = _backward_plan(operands, rows, residual)
    vec = plan.vec
    if workspace is not None:
        v.check_workspace_size(workspace, plan.workspace_bytes)
    dx_t, dx_copy = output_like(dx, x, vec)
    dw_t, dw_copy = vector_output(dw, hidden, dw_dtype, operands.device)

    if rows == 0:  # nothing to launch (and nothing to compile)
        dw_t.zero_()
    else:
        bwd, reduce = _backward_kernels(operands, residual, weight_offset, dw_dtype, len(g_parts))
        partials = _partials(workspace, plan.partial_rows, hidden, operands.device)
        with on_device(operands.device):
            bwd(
                kernel_view(g_parts[0], vec),
                kernel_view(x, vec),
                aligned_vector(w, vec),
                rstd if rstd.is_contiguous() else rstd.contiguous(),
                kernel_view(g_residual, vec) if residual else None,
                rows_view(dx_t, hidden),
                partials,
                plan.programs,
                *(kernel_view(part, vec) for part in g_parts[1:]),
            )
            reduce(partials, dw_t)
    return finish(dx_t, dx_copy), finish(dw_t, dw_copy)
