"""The dispatch layer: carries out ``routing.route`` for the functional entries and is the one module
that talks to the native extension.

The public functional entries ask the extension first (plain calls without caller-owned outputs), then
take the Python launch. A signature the Python path launched is handed to the extension with the
backward's planner, so its later plain calls run in C++. The extension is built only outside a training
step (``prepare()``, ``cake-cute warmup``); a call inside a step only loads a library already on disk.
"""

from __future__ import annotations

import torch

from . import launch, launch_fp8
from . import validation as v
from .calls import Fp8Call, NormCall, backward_call, norm_call
from .runtime import launch_plan, native


def prepare() -> bool:
    """Build (when needed) and load the native host path now, outside any training step.

    Returns
    -------
    bool
        Whether the native path is loaded; False with ``CAKE_CUTE_PYTHON_PATH=1`` or when the build
        failed (warned once), in which case eager calls take the Python path.
    """
    return native.load() is not None


def native_rmsnorm(x, w, eps, residual, weight_offset):
    """The C++ autograd node's ``y`` / ``(y, h_new)``, or None where it does not serve the call: it
    serves the signatures and eps values the Python path checked and handed over, and saves x or h_new
    (never ask it in the memory-efficient mode)."""
    return native.extension.rmsnorm(x, w, eps, residual, weight_offset)


def cake_rmsnorm_train_forward(
    x, w, eps, *, residual=None, out=None, rstd=None, residual_out=None, weight_offset: float = 0.0
):
    """RMSNorm forward, optionally fused with the residual add, in one pass.

    Per row: ``h = round(x + residual)`` (residual mode), ``rstd = 1 / sqrt(mean(h^2) + eps)`` in FP32,
    ``y = round(h * rstd * (w + weight_offset))``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., H]`` bf16 / fp16 / fp32 on a supported CUDA device, 1 <= H <= 262144; leading dims are
        rows.
    w : torch.Tensor
        ``[H]`` weight, x's dtype or fp32, on x's device.
    eps : float
        Finite, >= 0.
    residual : torch.Tensor, optional
        Like x: normalize ``h = x + residual`` and return it as h_new.
    out, rstd, residual_out : torch.Tensor, optional
        Caller-owned y (like x), rstd (FP32 ``[rows]``) and h_new (like x, residual mode only), written
        directly when contiguous and aligned, else by a copy; the returned tensors are these.
    weight_offset : float, default 0.0
        Added to w in FP32 (1.0 gives Gemma's ``1 + w``); each distinct value is a compiled variant.

    Returns
    -------
    tuple of torch.Tensor
        ``(y, rstd)``, or ``(y, rstd, h_new)`` in residual mode; rstd is FP32, one value per row.

    Raises
    ------
    ArgumentError
        A tensor of the wrong dtype, shape or device (both a ``ValueError`` and a ``TypeError``).
    TypeError
        An argument of the wrong kind.
    ValueError
        x on the CPU or an unsupported GPU, ``residual_out`` without ``residual``, a negative or
        non-finite eps. Every error is raised before any launch, with no output written.
    """
    extension = native.extension
    if extension is not None and out is None and rstd is None and residual_out is None:
        outs = extension.forward(x, w, eps, residual, weight_offset)
        if outs is not None:
            return outs
    return python_forward(norm_call(x, w, eps, residual, weight_offset, out, rstd, residual_out))


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
        dL/dy like x, or 2 to 3 such tensors whose sum is dL/dy, summed in FP32 left to right and
        rounded once to x's dtype (as torch.compile's fused add of them stores it).
    x : torch.Tensor
        What the forward normalized: x, or h_new in residual mode.
    w : torch.Tensor
        ``[H]`` weight, x's dtype or fp32.
    rstd : torch.Tensor
        FP32 ``[rows]`` from the forward.
    deterministic : bool, default True
        Accepted for API compatibility; every backward is deterministic.
    g_residual : torch.Tensor, optional
        dL/dh_new in residual mode (like x), added into dx, which is then the gradient of x and residual.
    workspace : torch.Tensor, optional
        Contiguous 1-D uint8, 16-byte aligned, of at least
        ``cake_rmsnorm_train_backward_workspace_bytes(rows, H, device)`` bytes; else allocated per call.
    dx, dw : torch.Tensor, optional
        Caller-owned outputs (dx like x; dw ``[H]`` of ``dw_dtype``).
    weight_offset : float, default 0.0
        The forward's offset.
    dw_dtype : torch.dtype, default torch.float32
        dw's dtype (fp32, bf16 or fp16); the sum is FP32, rounded once.

    Returns
    -------
    tuple of torch.Tensor
        ``(dx, dw)``.

    Raises
    ------
    ArgumentError
        A tensor of the wrong dtype, shape or device (both a ``ValueError`` and a ``TypeError``).
    TypeError
        An argument of the wrong kind (``deterministic`` included).
    ValueError
        An unaligned or too small workspace, x on the CPU or an unsupported GPU. Every error is raised
        before any launch, with no output written.
    """
    v.check_bool("deterministic", deterministic)  # accepted and ignored: every backward is deterministic
    extension = native.extension
    if extension is not None and workspace is None and dx is None and dw is None:
        outs = extension.backward(g, x, w, rstd, g_residual, weight_offset, dw_dtype)
        if outs is not None:
            return outs
    call = backward_call(g, x, w, rstd, g_residual, weight_offset, dw_dtype, workspace, dx, dw)
    return launch.launch_backward(call)


def python_forward(call: NormCall):
    """Launch a validated call in Python, then hand its signature to the native path."""
    outs = launch.launch_forward(call)
    x, operands = call.x, call.operands
    if x.numel() > 0 and native.load_built() is not None:
        native.accept_eps(call.eps)
        offset, mode = call.weight_offset, call.residual is not None
        if not native.handed_over(operands, offset, mode):
            kernel = launch.forward_kernel(operands, mode, offset)
            native.register(operands, x, call.w, offset, mode, kernel, backward_plan)
    return outs


def fp8_forward(call: Fp8Call):
    """``launch_fp8.fp8_forward`` of a validated call, then its signature handed to the native path."""
    outs = launch_fp8.fp8_forward(call)
    norm = call.norm
    x, operands = norm.x, norm.operands
    if operands is not None and x.numel() > 0 and native.load_built() is not None:
        native.accept_eps(norm.eps)
        rows, mode = x.numel() // operands.hidden, norm.residual is not None
        kernel, programs = launch_fp8.forward_kernel(
            operands, rows, mode, call.recipe, call.emit_y, norm.weight_offset
        )
        variant = (mode, call.recipe, call.emit_y, programs)
        native.register_fp8(operands, x, norm.w, norm.weight_offset, *variant, kernel, backward_plan)
    return outs


def backward_plan(operands, weight_offset: float, rows: int, residual: bool, dw_dtype, g_parts: int = 1):
    """The native path's planner for one backward shape: the kernels ``launch`` would launch, as TVM-FFI
    handles (the reduction's 0 when the backward sums dW itself), and their launch plan:
    ``(bwd, dw or 0, programs, partial_rows, row_stride, dw_in_launch)``."""
    plan = launch.backward_launch_plan(operands, rows, residual, g_parts)
    kernels = launch.backward_kernels(
        operands, residual, weight_offset, dw_dtype, g_parts, dw_in_launch=plan.dw_in_launch
    )
    handles = tuple(0 if k is None else native.kernel_handle(k) for k in kernels)
    if handles[0] == 0 or (kernels[1] is not None and handles[1] == 0):
        raise RuntimeError("cake_cute: a backward kernel has no TVM-FFI function handle")
    row_stride = launch_plan.partial_row_stride(operands.hidden)
    return (*handles, plan.programs, plan.partial_rows, row_stride, plan.dw_in_launch)
