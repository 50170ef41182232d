"""The kernels as ``torch.library`` custom ops, and the save/backward logic both autograd paths share.

``cake_cute::rmsnorm_fwd`` returns ``(y, rstd, h_new)``, ``rmsnorm_fp8_fwd`` ``(data, compact scales,
y, rstd, h_new)``, ``rmsnorm_bwd`` ``(dx, dw)`` and ``rmsnorm_bwd_parts`` the same from g's summands.
The memory-efficient mode has its own pair (``rmsnorm_fwd_saving_output``, ``rmsnorm_bwd_from_output``),
so the C++ kernels typed on the default schemas stay as they are. rstd is shaped ``x.shape[:-1]``, so
N-D and DTensor inputs need no redistribution; dw comes back in w's dtype; plain mode's ``h_new`` is
empty (a schema has a fixed number of outputs).

The ops serve torch.compile, DTensor and CPU tensors; eager calls on plain CUDA tensors launch
directly, without the dispatcher's per-call cost. Once the native extension is loaded, its C++ kernels
on the CUDA keys serve the registered signatures and call the Python bodies below for the rest.
"""

from __future__ import annotations

import torch

from . import cpu, dispatch
from .calls import NormCall, backward_call, fp8_call, norm_call
from .fp8_numerics import scale_blocks
from .kernels.quant_config import QUANT_RECIPES
from .launch import backward_from_saved, launch_backward
from .launch_fp8 import op_outputs, placeholder
from .reference import differentiable_backward, summed_gradient
from .runtime import native
from .runtime.views import new_output

_FWD_SCHEMA = (
    "(Tensor x, Tensor w, float eps, Tensor? residual=None, float weight_offset=0.0) "
    "-> (Tensor, Tensor, Tensor)"
)
_BWD_ARGUMENTS = (
    "Tensor x, Tensor w, Tensor rstd, Tensor? g_residual=None, float weight_offset=0.0) -> (Tensor, Tensor)"
)
_FP8_SCHEMA = (
    "(Tensor x, Tensor w, float eps, Tensor? residual, str recipe, bool emit_y, float weight_offset) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BWD_SCHEMA = "(Tensor g, " + _BWD_ARGUMENTS
_BWD_PARTS_SCHEMA = "(Tensor[] g, " + _BWD_ARGUMENTS


# Keeps the namespace's registrations alive.
_LIB = torch.library.Library("cake_cute", "DEF")


def define_op(name: str, schema: str, kernel, *, fake, cpu=None, backward=None, setup_context=None) -> None:
    """Define ``cake_cute::<name>`` and register its kernels, fake and autograd with the dispatcher
    directly, without ``torch.library.custom_op``'s per-call Python checking layer."""
    _LIB.define(name + schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    if cpu is not None:
        _LIB.impl(name, cpu, "CPU")
    qualified = f"cake_cute::{name}"
    torch.library.register_fake(qualified, fake, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualified, backward, setup_context=setup_context, lib=_LIB)


def rmsnorm_fwd(x, w, eps, residual=None, weight_offset=0.0):
    """``(y, rstd, h_new)`` on CUDA."""
    outs = dispatch.cake_rmsnorm_train_forward(x, w, eps, residual=residual, weight_offset=weight_offset)
    rstd = outs[1].view(x.shape[:-1])
    return outs[0], rstd, (x.new_empty(0) if residual is None else outs[2])


def _rmsnorm_fwd_cpu(x, w, eps, residual=None, weight_offset=0.0):
    call = norm_call(x, w, eps, residual, weight_offset, on_gpu=False)
    y, rstd, h_new = cpu.forward(*call.math_arguments)
    return y, rstd, (x.new_empty(0) if h_new is None else h_new)


def _rmsnorm_fwd_fake(x, w, eps, residual=None, weight_offset=0.0):
    """The real op's outputs; argument errors surface while tracing."""
    norm_call(x, w, eps, residual, weight_offset, on_gpu=False)
    h_new = new_output(x) if residual is not None else x.new_empty(0)
    return new_output(x), new_output(x, x.shape[:-1], torch.float32), h_new


def rmsnorm_fp8_fwd(x, w, eps, residual, recipe, emit_y, weight_offset):
    """``(data, compact scales, y, rstd, h_new)``: y or the zero-memory placeholder, h_new empty in plain
    mode; the kernel on CUDA, the reference elsewhere."""
    call = fp8_call(x, w, eps, residual, recipe, emit_y, weight_offset, on_gpu=x.device.type == "cuda")
    return op_outputs(x, *dispatch.fp8_forward(call))


def _rmsnorm_fp8_fwd_fake(x, w, eps, residual, recipe, emit_y, weight_offset):
    fp8_call(x, w, eps, residual, recipe, emit_y, weight_offset, on_gpu=False)
    lead = x.shape[:-1]
    blocks = scale_blocks(x.shape[-1], recipe)
    scale_dtype = torch.float32 if QUANT_RECIPES[recipe][1] else torch.float8_e8m0fnu
    return (
        new_output(x, dtype=torch.float8_e4m3fn),
        new_output(x, (*lead, blocks), scale_dtype),
        new_output(x) if emit_y else placeholder(x),
        new_output(x, lead, torch.float32),
        new_output(x) if residual is not None else x.new_empty(0),
    )


def rmsnorm_bwd(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    """``(dx, dw)`` on CUDA, dw in w's dtype; ``rstd`` is shaped ``x.shape[:-1]``."""
    return dispatch.cake_rmsnorm_train_backward(
        g,
        x,
        w,
        rstd.reshape(-1),
        g_residual=g_residual,
        weight_offset=weight_offset,
        dw_dtype=w.dtype,
    )


def _rmsnorm_bwd_cpu(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    return cpu.backward(g, x, w, rstd, g_residual, weight_offset)


def _rmsnorm_bwd_fake(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    return new_output(x), new_output(w)


def rmsnorm_bwd_from_output(g, y, w, rstd, g_residual=None, weight_offset=0.0):
    """``(dx, dw)`` on CUDA from the saved output y (the memory-efficient mode), dw in w's dtype."""
    call = backward_call(g, y, w, rstd.reshape(-1), g_residual, weight_offset, w.dtype, memory_efficient=True)
    return launch_backward(call)


def _rmsnorm_bwd_from_output_cpu(g, y, w, rstd, g_residual=None, weight_offset=0.0):
    return cpu.backward_from_output(g, y, w, rstd, g_residual, weight_offset)


def rmsnorm_bwd_from_output_parts(g, y, w, rstd, g_residual=None, weight_offset=0.0):
    """``rmsnorm_bwd_from_output`` of a gradient given as the list of its summands."""
    return rmsnorm_bwd_from_output(tuple(g), y, w, rstd, g_residual, weight_offset)


def _rmsnorm_bwd_from_output_parts_cpu(g, y, w, rstd, g_residual=None, weight_offset=0.0):
    return cpu.backward_from_output(summed_gradient(g), y, w, rstd, g_residual, weight_offset)


def rmsnorm_bwd_parts(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    """``rmsnorm_bwd`` of a gradient given as its 2 or 3 summands, summed in the kernel (FP32, left to
    right, rounded once)."""
    return rmsnorm_bwd(tuple(g), x, w, rstd, g_residual, weight_offset)


def _rmsnorm_bwd_parts_cpu(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    return cpu.backward(summed_gradient(g), x, w, rstd, g_residual, weight_offset)


def _rmsnorm_bwd_parts_fake(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    return _rmsnorm_bwd_fake(g[0], x, w, rstd)


# --- the save/backward logic of both autograd paths ------------------------------------------------


def save_for_backward(ctx, x, w, residual, rstd, h_new, eps, weight_offset, direct, y=None) -> None:
    """Save exactly (x or h_new, w, rstd), or (y, w, rstd) when ``y`` is given, and what the backward
    needs; ``direct``: the forward launched the kernels itself, so the backward does too."""
    ctx.memory_efficient = y is not None
    ctx.save_for_backward(y if ctx.memory_efficient else x if residual is None else h_new, w, rstd)
    ctx.residual = residual is not None
    ctx.eps = eps
    ctx.weight_offset = weight_offset
    ctx.direct = direct


def records_second_order(*tensors) -> bool:
    """Whether a backward must record a graph of its own (``create_graph=True`` and a tensor in a graph)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def norm_backward(ctx, g, g_h_new):
    """``(dx, dw, d_residual)`` for a context ``save_for_backward`` filled.

    In residual mode one dx is the gradient of both x and residual. When only h_new was used (``g`` is
    None), its gradient reaches x and residual unchanged and w gets none. A backward that is itself
    differentiated runs the differentiable formula instead of the kernels; in the memory-efficient mode,
    which kept y and not the input, it raises RuntimeError."""
    h, w, rstd = ctx.saved_tensors
    g_residual = g_h_new if ctx.residual else None
    if g is None:
        return g_residual, None, g_residual
    if records_second_order(g, h, w, g_residual):
        if ctx.memory_efficient:
            raise RuntimeError(
                "cake_cute: double backward (create_graph=True) is not supported with memory_efficient=True: "
                "the norm kept its output, not the input the second-order terms need; use "
                "memory_efficient=False"
            )
        dx, dw = differentiable_backward(g, h, w, ctx.eps, g_residual, ctx.weight_offset)
    elif ctx.direct:
        dx, dw = backward_from_saved(g, h, w, rstd, g_residual, ctx.weight_offset, ctx.memory_efficient)
    else:
        op = (
            torch.ops.cake_cute.rmsnorm_bwd_from_output
            if ctx.memory_efficient
            else torch.ops.cake_cute.rmsnorm_bwd
        )
        dx, dw = op(g, h, w, rstd, g_residual, ctx.weight_offset)
    return dx, dw, (dx if ctx.residual else None)


def _save_op_context(ctx, no_gradient, x, w, residual, rstd, h_new, eps, weight_offset, y=None) -> None:
    """The op forms' ``save_for_backward``: outputs in ``no_gradient`` and a plain mode's h_new get none,
    and an unused output's gradient is None, not a zero tensor."""
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*no_gradient, *(() if residual is not None else (h_new,)))
    save_for_backward(ctx, x, w, residual, rstd, h_new, eps, weight_offset, direct=False, y=y)


def _setup_context(ctx, inputs, output):
    x, w, eps, residual, weight_offset = inputs
    _y, rstd, h_new = output
    _save_op_context(ctx, (rstd,), x, w, residual, rstd, h_new, eps, weight_offset)


def _setup_output_saving_context(ctx, inputs, output):
    """``rmsnorm_fwd_saving_output``'s: saves its y output (the memory-efficient mode)."""
    x, w, eps, residual, weight_offset = inputs
    y, rstd, h_new = output
    _save_op_context(ctx, (rstd,), x, w, residual, rstd, h_new, eps, weight_offset, y=y)


def _backward(ctx, g, _g_rstd, g_h_new):
    dx, dw, d_residual = norm_backward(ctx, g, g_h_new)
    return dx, dw, None, d_residual, None


def _setup_fp8_context(ctx, inputs, output):
    x, w, eps, residual, _recipe, _emit_y, weight_offset = inputs
    data, scales, _y, rstd, h_new = output
    _save_op_context(ctx, (data, scales, rstd), x, w, residual, rstd, h_new, eps, weight_offset)


def fp8_backward(ctx, _g_data, _g_scales, g, _g_rstd, g_h_new):
    """The gradients of the forward to FP8's inputs: only y and h_new carry one back."""
    dx, dw, d_residual = norm_backward(ctx, g, g_h_new)
    return dx, dw, None, d_residual, None, None, None


define_op(
    "rmsnorm_fwd",
    _FWD_SCHEMA,
    rmsnorm_fwd,
    cpu=_rmsnorm_fwd_cpu,
    fake=_rmsnorm_fwd_fake,
    backward=_backward,
    setup_context=_setup_context,
)
define_op(
    "rmsnorm_fwd_saving_output",
    _FWD_SCHEMA,
    rmsnorm_fwd,
    cpu=_rmsnorm_fwd_cpu,
    fake=_rmsnorm_fwd_fake,
    backward=_backward,
    setup_context=_setup_output_saving_context,
)
define_op(
    "rmsnorm_fp8_fwd",
    _FP8_SCHEMA,
    rmsnorm_fp8_fwd,
    fake=_rmsnorm_fp8_fwd_fake,
    backward=fp8_backward,
    setup_context=_setup_fp8_context,
)
define_op("rmsnorm_bwd", _BWD_SCHEMA, rmsnorm_bwd, cpu=_rmsnorm_bwd_cpu, fake=_rmsnorm_bwd_fake)
define_op(
    "rmsnorm_bwd_from_output",
    _BWD_SCHEMA,
    rmsnorm_bwd_from_output,
    cpu=_rmsnorm_bwd_from_output_cpu,
    fake=_rmsnorm_bwd_fake,
)
define_op(
    "rmsnorm_bwd_parts",
    _BWD_PARTS_SCHEMA,
    rmsnorm_bwd_parts,
    cpu=_rmsnorm_bwd_parts_cpu,
    fake=_rmsnorm_bwd_parts_fake,
)
define_op(
    "rmsnorm_bwd_from_output_parts",
    _BWD_PARTS_SCHEMA,
    rmsnorm_bwd_from_output_parts,
    cpu=_rmsnorm_bwd_from_output_parts_cpu,
    fake=_rmsnorm_bwd_parts_fake,
)
native.provide_op_bodies(
    rmsnorm_fwd, rmsnorm_bwd, rmsnorm_bwd_parts, rmsnorm_fp8_fwd, differentiable_backward
)


def cake_rmsnorm_traceable(call: NormCall):
    """``cake_rmsnorm`` of a checked call through the custom op (its memory-efficient twin in that mode)."""
    ops = torch.ops.cake_cute
    forward = ops.rmsnorm_fwd_saving_output if call.memory_efficient else ops.rmsnorm_fwd
    y, _rstd, h_new = forward(*call.math_arguments)
    return y if call.residual is None else (y, h_new)
