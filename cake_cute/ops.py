"""The functional API: validate, pick the compiled variant, launch. No autograd, no tiling here."""

from __future__ import annotations

import torch

from . import dispatch, validation as v
from .compile_cache import kernel


def _check_output(name, given, shape, dtype, device):
    if given is not None:
        v.check_output(name, given, shape, dtype, device)


def _outputs_for(given, shape, dtype, device, vec):
    """(tensor the kernel writes, caller tensor to copy into afterwards or None); ``given`` is checked."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device), None
    if v.is_direct_output(given, vec):
        return given, None
    return torch.empty(shape, dtype=dtype, device=device), given


def _rows_view(t: torch.Tensor, hidden: int) -> torch.Tensor:
    return t.view(-1, hidden)


def cake_rmsnorm_train_forward(
    x, w, eps, *, residual=None, out=None, rstd=None, residual_out=None, weight_offset: float = 0.0
):
    """RMSNorm forward (optionally ``h = x + residual`` first). Returns ``(y, rstd)`` or
    ``(y, rstd, h_new)``; rstd is FP32 with one value per row."""
    device, hidden = v.check_activation(x)
    v.check_weight(w, x)
    eps = v.check_eps(eps)
    weight_offset = v.check_weight_offset(weight_offset)
    if residual is not None:
        v.check_like("residual", residual, x)
    elif residual_out is not None:
        raise ValueError("residual_out is only written in residual mode: pass residual= as well")
    rows = v.rows_of(x)
    _check_output("out", out, x.shape, x.dtype, device)
    _check_output("rstd", rstd, (rows,), torch.float32, device)
    _check_output("residual_out", residual_out, x.shape, x.dtype, device)
    arch = v.device_arch(device)
    act = v.dtype_name(x.dtype)
    vec = dispatch.vector_elems(hidden, act)

    y, y_copy = _outputs_for(out, x.shape, x.dtype, device, vec)
    r, r_copy = _outputs_for(rstd, (rows,), torch.float32, device, 1)
    if residual is not None:
        h_new, h_copy = _outputs_for(residual_out, x.shape, x.dtype, device, vec)

    if rows > 0:
        fn = kernel("fwd", arch, act, v.dtype_name(w.dtype), hidden, residual is not None, weight_offset)
        x2 = v.kernel_view(x, vec)
        res2 = v.kernel_view(residual, vec) if residual is not None else None
        h2 = _rows_view(h_new, hidden) if residual is not None else None
        with v.on_device(device):
            fn(x2, res2, v.aligned_vector(w, vec), _rows_view(y, hidden), h2, r, eps)
    for src, dst in ((y, y_copy), (r, r_copy)) + (((h_new, h_copy),) if residual is not None else ()):
        if dst is not None:
            dst.copy_(src)
    y_out = y if y_copy is None else y_copy
    r_out = r if r_copy is None else r_copy
    if residual is None:
        return y_out, r_out
    return y_out, r_out, (h_new if h_copy is None else h_copy)


def cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, *, residual=False) -> int:
    """Bytes of the FP32 dW partial rows a backward of up to ``rows`` rows needs (any dtype)."""
    v.check_count("rows", rows, 0)
    v.check_count("hidden", hidden, 1, v.MAX_HIDDEN)
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device must name a CUDA device, got {device!r}") from err
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    v.device_arch(device)
    facts = v.device_facts(device)
    most = max(dispatch.backward_launch(max(rows, 1), hidden, act, residual, facts)[1] for act in dispatch.DTYPE_NAMES)
    return most * dispatch.partial_row_stride(hidden) * 4


def cake_rmsnorm_train_backward_workspace(rows, hidden, device, *, residual=False) -> torch.Tensor:
    nbytes = cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, residual=residual)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _check_workspace_tensor(workspace, device) -> None:
    v.check_tensor("workspace", workspace, dtypes=(torch.uint8,), device=device)
    if workspace.dim() != 1 or not workspace.is_contiguous() or workspace.data_ptr() % 16 != 0:
        raise ValueError("workspace must be a contiguous 1-D uint8 tensor with a 16-byte aligned base")


def _partials(workspace, partial_rows: int, stride: int, hidden: int, device) -> torch.Tensor:
    """The FP32 (partial_rows, hidden) view (row stride ``stride``) the backward writes dW rows into:
    carved from the caller's workspace, or freshly allocated."""
    if workspace is None:
        partials = torch.empty((partial_rows, stride), dtype=torch.float32, device=device)
    else:
        needed = partial_rows * stride * 4
        if workspace.numel() < needed:
            raise ValueError(f"workspace holds {workspace.numel()} bytes; this call needs at least {needed}")
        partials = workspace[:needed].view(torch.float32).view(partial_rows, stride)
    return partials if stride == hidden else partials[:, :hidden]


def cake_rmsnorm_train_backward(
    g, x, w, rstd, *, deterministic=True, g_residual=None, workspace=None, dx=None, dw=None,
    weight_offset: float = 0.0, dw_dtype: torch.dtype = torch.float32,
):
    """RMSNorm backward: ``(dx, dw)``. ``x`` is what the forward normalized (x, or h_new in residual
    mode); in residual mode ``g_residual`` (dL/dh_new) is added into dx. dw is FP32 unless
    ``dw_dtype`` says otherwise (autograd asks for w's dtype). Both values of ``deterministic`` run
    the deterministic kernels for now (no atomic dW path yet)."""
    device, hidden = v.check_activation(x)
    v.check_tensor("g", g, dtypes=(x.dtype,), device=device)
    if tuple(g.shape) != tuple(x.shape):
        raise ValueError(f"g must have shape {tuple(x.shape)} like x, got {tuple(g.shape)}")
    v.check_weight(w, x)
    rows = v.rows_of(x)
    v.check_rstd(rstd, rows, device)
    if g_residual is not None:
        v.check_like("g_residual", g_residual, x)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    weight_offset = v.check_weight_offset(weight_offset)
    dw_dtype = v.check_dw_dtype(dw_dtype)
    _check_output("dx", dx, x.shape, x.dtype, device)
    _check_output("dw", dw, (hidden,), dw_dtype, device)
    if workspace is not None:
        _check_workspace_tensor(workspace, device)
    arch = v.device_arch(device)
    act = v.dtype_name(x.dtype)
    vec = dispatch.vector_elems(hidden, act)

    facts = v.device_facts(device)
    residual = g_residual is not None
    programs, partial_rows = dispatch.backward_launch(max(rows, 1), hidden, act, residual, facts)
    stride = dispatch.partial_row_stride(hidden)
    partials = _partials(workspace, partial_rows, stride, hidden, device)
    dx_t, dx_copy = _outputs_for(dx, x.shape, x.dtype, device, vec)
    dw_t, dw_copy = _outputs_for(dw, (hidden,), dw_dtype, device, 1)

    if rows == 0:
        dw_t.zero_()
    else:
        wname = v.dtype_name(w.dtype)
        bwd = kernel("bwd", arch, act, wname, hidden, residual, weight_offset)
        reduce = kernel("dw", arch, v.dtype_name(dw_dtype), "fp32", hidden)
        with v.on_device(device):
            bwd(
                v.kernel_view(g, vec), v.kernel_view(x, vec), v.aligned_vector(w, vec), rstd if rstd.is_contiguous() else rstd.contiguous(),
                v.kernel_view(g_residual, vec) if residual else None,
                _rows_view(dx_t, hidden), partials, programs,
            )
            reduce(partials, dw_t)
    if dx_copy is not None:
        dx_copy.copy_(dx_t)
        dx_t = dx_copy
    if dw_copy is not None:
        dw_copy.copy_(dw_t)
        dw_t = dw_copy
    return dx_t, dw_t
