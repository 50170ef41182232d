"""The Python launch path of the plain norm: pick the compiled variant of a validated call, launch. No
argument checks, autograd, tiling or routing here.

The hot path is written for the host: (x, w) properties seen before are one dict lookup, outputs come
from ``torch.empty_like``, and a 2-D contiguous input goes to the kernel as it is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from . import validation as v
from .calls import BackwardCall, NormCall
from .kernels.config import on_override_change
from .runtime import launch_plan
from .runtime.cache import get_kernel
from .runtime.device import device_arch, device_facts, on_device
from .runtime.operands import operands_of
from .runtime.specs import ReduceSpec
from .runtime.views import (
    aligned_vector,
    barrier_counter,
    finish,
    kernel_view,
    output_like,
    partial_rows_view,
    rows_view,
    vector_output,
)
from .vocab import DTYPE_NAMES, dtype_name


def forward_kernel(operands, residual: bool, weight_offset: float):
    """The compiled forward of validated (x, w) facts, mode and offset."""
    return get_kernel(operands.spec("fwd", residual=residual, weight_offset=weight_offset))


def launch_forward(call: NormCall):
    """The forward of a validated call: ``(y, rstd[, h_new])``, the caller's outputs when given."""
    x, residual, operands = call.x, call.residual, call.operands
    hidden = operands.hidden
    rows = x.numel() // hidden
    vec = launch_plan.vector_elems(hidden, operands.act)

    y, y_copy = output_like(call.out, x, vec)
    r, r_copy = vector_output(call.rstd, rows, torch.float32, operands.device)
    h_new = h_copy = None
    if residual is not None:
        h_new, h_copy = output_like(call.residual_out, x, vec)

    if rows > 0:
        fn = forward_kernel(operands, residual is not None, call.weight_offset)
        with on_device(operands.device):
            fn(
                kernel_view(x, vec),
                None if residual is None else kernel_view(residual, vec),
                aligned_vector(call.w, vec),
                rows_view(y, hidden),
                None if residual is None else rows_view(h_new, hidden),
                r,
                call.eps,
            )
    if residual is None:
        return finish(y, y_copy), finish(r, r_copy)
    return finish(y, y_copy), finish(r, r_copy), finish(h_new, h_copy)


def cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, *, residual=False) -> int:
    """Bytes of workspace a backward of up to ``rows`` rows of ``hidden`` needs, for any dtype: the FP32
    partial rows of dW and, in its last 16 bytes, the grid barrier's counter (zero before the first call,
    as every call leaves it).

    Parameters
    ----------
    rows : int
        The most rows (T) a backward using the workspace will have; >= 0.
    hidden : int
        The hidden size H, 1 <= H <= 262144.
    device : torch.device, str or int
        The CUDA device, whose SM count sets the number of partial rows.
    residual : bool, default False
        Size it for residual-mode backwards.

    Returns
    -------
    int
        Bytes.

    Raises
    ------
    TypeError
        rows or hidden is not an int; residual is not a bool.
    ValueError
        rows or hidden out of range; device names no existing, supported CUDA device.
    """
    v.check_count("rows", rows, 0)
    v.check_count("hidden", hidden, 1, v.MAX_HIDDEN)
    v.check_bool("residual", residual)
    device = v.check_cuda_device(device)
    device_arch(device)
    facts = device_facts(device)
    most = max(
        launch_plan.most_partial_rows(rows, hidden, act, w, residual, facts)
        for act in DTYPE_NAMES
        for w in {act, "fp32"}
    )
    return launch_plan.workspace_bytes(most, hidden)


def cake_rmsnorm_train_backward_workspace(rows, hidden, device, *, residual=False) -> torch.Tensor:
    """A zero-filled workspace for backwards of up to ``rows`` rows; one workspace serves one stream at
    a time.

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


def backward_from_saved(g, h, w, rstd, g_residual, weight_offset: float, memory_efficient: bool):
    """The backward for autograd: the forward validated h (y in the memory-efficient mode), w and rstd,
    so only the (x, w) facts are looked up again."""
    operands = operands_of(h, w)
    call = BackwardCall((g,), h, w, rstd, g_residual, weight_offset, w.dtype, operands, memory_efficient)
    return launch_backward(call)


class _BackwardPlan(NamedTuple):
    programs: int
    partial_rows: int
    workspace_bytes: int  # the least a caller's workspace must hold
    vec: int
    dw_in_launch: bool  # the backward sums its partial rows itself; else a dw_reduce launch follows


@lru_cache(maxsize=4096)
def backward_launch_plan(operands, rows, residual, g_parts=1) -> _BackwardPlan:
    """The launch shape of a backward of g in ``g_parts`` summands, cached per shape."""
    rows = max(rows, 1)
    variant = (operands.hidden, operands.act, operands.w_name, residual)
    programs = launch_plan.backward_programs(rows, *variant, operands.facts)
    partial_rows = programs  # one FP32 partial row of dW per program: its row groups fold theirs first
    return _BackwardPlan(
        programs,
        partial_rows,
        launch_plan.workspace_bytes(partial_rows, operands.hidden),
        launch_plan.vector_elems(operands.hidden, operands.act),
        launch_plan.finishes_dw_in_launch(rows, *variant, g_parts, operands.facts),
    )


on_override_change(backward_launch_plan.cache_clear)


def backward_kernels(
    operands,
    residual: bool,
    weight_offset: float,
    dw_dtype,
    g_parts: int = 1,
    memory_efficient: bool = False,
    dw_in_launch: bool = False,
):
    """The backward's kernels: dx with the partial rows of dW and their reduction, or, ``dw_in_launch``,
    one kernel that also sums them, and None."""
    backward = operands.spec(
        "bwd",
        residual=residual,
        weight_offset=weight_offset,
        g_parts=g_parts,
        memory_efficient=memory_efficient,
        dw_dtype=dtype_name(dw_dtype) if dw_in_launch else "",
    )
    if dw_in_launch:
        return get_kernel(backward), None
    return get_kernel(backward), get_kernel(ReduceSpec(operands.arch, dtype_name(dw_dtype), operands.hidden))


def launch_backward(call: BackwardCall):
    """The backward of a validated call: ``(dx, dw)``, the caller's when given."""
    operands, x, g_parts = call.operands, call.h, call.g_parts
    hidden = operands.hidden
    rows = x.numel() // hidden
    residual = call.g_residual is not None
    plan = backward_launch_plan(operands, rows, residual, len(g_parts))
    vec = plan.vec
    if call.workspace is not None:
        v.check_workspace_size(call.workspace, plan.workspace_bytes)
    dx_t, dx_copy = output_like(call.dx, x, vec)
    dw_t, dw_copy = vector_output(call.dw, hidden, call.dw_dtype, operands.device)

    if rows == 0:  # nothing to launch (and nothing to compile)
        dw_t.zero_()
        return finish(dx_t, dx_copy), finish(dw_t, dw_copy)
    bwd, reduce = backward_kernels(
        operands,
        residual,
        call.weight_offset,
        call.dw_dtype,
        len(g_parts),
        call.memory_efficient,
        plan.dw_in_launch,
    )
    partials = partial_rows_view(call.workspace, plan.partial_rows, hidden, operands.device)
    rstd = call.rstd
    with on_device(operands.device):
        in_launch = (dw_t, barrier_counter(call.workspace, operands.device)) if plan.dw_in_launch else ()
        bwd(
            kernel_view(g_parts[0], vec),
            kernel_view(x, vec),
            aligned_vector(call.w, vec),
            rstd if rstd.is_contiguous() else rstd.contiguous(),
            kernel_view(call.g_residual, vec) if residual else None,
            rows_view(dx_t, hidden),
            partials,
            *in_launch,
            plan.programs,
            *(kernel_view(part, vec) for part in g_parts[1:]),
        )
        if reduce is not None:
            reduce(partials, dw_t)
    return finish(dx_t, dx_copy), finish(dw_t, dw_copy)
