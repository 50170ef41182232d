"""The Python launch path of the plain norm: validate, pick the compiled variant, launch. No autograd,
no tiling, no routing here (the public functional entries and the native path are ``dispatch``'s).

The hot path is written for the host: (x, w) properties seen before are recognised with one dict lookup
(``operands.known_operands``), outputs come from ``torch.empty_like``, and a 2-D contiguous input
goes to the kernel as it is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from . import launch_plan
from . import validation as v
from .compile_cache import kernel
from .device import device_arch, device_facts, on_device
from .kernels.config import on_override_change
from .operands import known_operands
from .operands import operands as validated_operands
from .views import aligned_vector, finish, kernel_view, output_like, rows_view, vector_output
from .vocab import DTYPE_NAMES, dtype_name


def forward_kernel(operands, residual: bool, weight_offset: float):
    """The compiled forward of validated (x, w) facts, mode and offset."""
    return kernel(
        "fwd", operands.arch, operands.act, operands.w_name, operands.hidden, residual, weight_offset
    )


def train_forward_python(x, w, eps, residual=None, out=None, rstd=None, residual_out=None, weight_offset=0.0):
    """``cake_rmsnorm_train_forward`` on the Python path: validation, then the launch."""
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
        fn = forward_kernel(operands, residual is not None, weight_offset)
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


def _partial_rows_view(workspace, partial_rows: int, hidden: int, device) -> torch.Tensor:
    """The FP32 (partial_rows, H) view (row stride padded to 4) the backward writes dW rows into: carved
    from the caller's workspace, or freshly allocated."""
    stride = launch_plan.partial_row_stride(hidden)
    if workspace is None:
        partials = torch.empty((partial_rows, stride), dtype=torch.float32, device=device)
    else:
        partials = workspace[: partial_rows * stride * 4].view(torch.float32).view(partial_rows, stride)
    return partials if stride == hidden else partials[:, :hidden]


def train_backward_python(
    g,
    x,
    w,
    rstd,
    g_residual=None,
    workspace=None,
    dx=None,
    dw=None,
    weight_offset=0.0,
    dw_dtype=torch.float32,
    from_output=False,
):
    """``cake_rmsnorm_train_backward`` on the Python path (``deterministic`` checked at the edge):
    validation, then the launch. ``from_output``: x is the forward's output y (the memory-efficient
    mode's backward, ``kernels.rmsnorm_bwd``)."""
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
    weight_offset = v.check_weight_offset(weight_offset)
    dw_dtype = v.check_dw_dtype(dw_dtype)
    if dx is not None or dw is not None:
        v.check_backward_outputs(x, dx, dw, dw_dtype)
    if workspace is not None:
        v.check_workspace(workspace, x.device)
    if operands is None:
        operands = validated_operands(x, w)
    outputs = (workspace, dx, dw)
    return _backward(operands, g_parts, x, w, rstd, g_residual, outputs, weight_offset, dw_dtype, from_output)


def backward_from_saved(g, h, w, rstd, g_residual, weight_offset: float, from_output: bool = False):
    """The backward for autograd: h, w, rstd are what the forward validated and saved (h is y when
    ``from_output``: the memory-efficient mode), and the engine has already matched g (and g_residual)
    to the outputs' shape, dtype and device, so only the (x, w) facts are looked up again. dw comes
    back in w's dtype."""
    operands = known_operands(h, w) or validated_operands(h, w)
    outputs = (None, None, None)
    return _backward(operands, (g,), h, w, rstd, g_residual, outputs, weight_offset, w.dtype, from_output)


def backward_from_saved_output(g, y, w, rstd, g_residual, weight_offset: float):
    """``backward_from_saved`` of the memory-efficient mode, whose saved tensor is the output y."""
    return backward_from_saved(g, y, w, rstd, g_residual, weight_offset, from_output=True)


class _BackwardPlan(NamedTuple):
    programs: int
    partial_rows: int
    workspace_bytes: int  # the least a caller's workspace must hold
    vec: int


@lru_cache(maxsize=4096)
def backward_launch_plan(operands, rows, residual) -> _BackwardPlan:
    """The launch shape of a backward call (g in summands or not, reading h or y), looked up once per
    distinct (operands, T, residual)."""
    programs = launch_plan.backward_programs(
        max(rows, 1), operands.hidden, operands.act, operands.w_name, residual, operands.facts
    )
    partial_rows = programs  # one FP32 partial row of dW per program: its row groups fold theirs first
    return _BackwardPlan(
        programs,
        partial_rows,
        launch_plan.partial_rows_bytes(partial_rows, operands.hidden),
        launch_plan.vector_elems(operands.hidden, operands.act),
    )


on_override_change(backward_launch_plan.cache_clear)


def backward_kernels(
    operands, residual: bool, weight_offset: float, dw_dtype, g_parts: int = 1, from_output: bool = False
):
    """The backward's two kernels: dx with the FP32 partial rows of dW (from ``g_parts`` summands of
    g; reading y in h's place when ``from_output``), and their reduction."""
    # The default variant (one summand, reading h) keeps its field tuple.
    parts = (g_parts, True) if from_output else (g_parts,) if g_parts > 1 else ()
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


def _backward(operands, g_parts, x, w, rstd, g_residual, outputs, weight_offset, dw_dtype, from_output):
    """The launch of a validated backward; ``g_parts``: the tuple of g's summands (usually one);
    ``outputs``: the caller's (workspace, dx, dw), each None when not given."""
    workspace, dx, dw = outputs
    hidden = operands.hidden
    rows = x.numel() // hidden
    residual = g_residual is not None
    plan = backward_launch_plan(operands, rows, residual)
    vec = plan.vec
    if workspace is not None:
        v.check_workspace_size(workspace, plan.workspace_bytes)
    dx_t, dx_copy = output_like(dx, x, vec)
    dw_t, dw_copy = vector_output(dw, hidden, dw_dtype, operands.device)

    if rows == 0:  # nothing to launch (and nothing to compile)
        dw_t.zero_()
    else:
        bwd, reduce = backward_kernels(operands, residual, weight_offset, dw_dtype, len(g_parts), from_output)
        partials = _partial_rows_view(workspace, plan.partial_rows, hidden, operands.device)
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
