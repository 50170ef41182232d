"""Autograd: one ``torch.autograd.Function`` per forward kind, saving exactly (x or h_new, w, rstd), or
(y, w, rstd) in the memory-efficient mode.

``cake_cute.routing`` decides the path of a call. The eager Functions and the custom ops' autograd share
one save/backward pair (``library_ops.save_for_backward``, ``library_ops.norm_backward``), so a new
forward kind is a Function here whose backward is ``norm_backward``.
"""

from __future__ import annotations

import torch

from . import dispatch
from . import validation as v
from .calls import Fp8Call, NormCall, norm_call
from .launch_fp8 import op_outputs
from .library_ops import cake_rmsnorm_traceable, fp8_backward, norm_backward, save_for_backward
from .reference import compute_dtype_of, forward_reference
from .routing import MATH, NATIVE, OP, PYTHON, route
from .runtime.operands import operands_of


def _math(call: NormCall):
    """The ``MATH`` route: ``cake_rmsnorm``'s outputs in torch operations at the kernels' rounding points
    (FP32, or FP64 for FP64 inputs), which autograd and every ``torch.func`` transform differentiate as
    they do ``F.rms_norm``."""
    y, _, h = forward_reference(*call.math_arguments, compute_dtype=compute_dtype_of(call.x.dtype))
    y = y.to(call.x.dtype)
    return y if call.residual is None else (y, h)


class CakeRMSNormFunction(torch.autograd.Function):
    """Fused RMSNorm as a ``torch.autograd.Function``.

    ``CakeRMSNormFunction.apply(x, w, eps, residual=None, deterministic=True, weight_offset=0.0,
    memory_efficient=False)``; ``apply`` follows the routing rule as ``cake_rmsnorm`` does, since
    FlashInfer's users call it as their entry.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., H]`` activations, bf16, fp16 or fp32, on CUDA (kernels) or CPU (reference math); a
        DTensor sharded on any dimension but the last, or replicated.
    w : torch.Tensor
        ``[H]`` weight in x's dtype or fp32 (a ``Replicate()`` DTensor when x is a DTensor).
    eps : float
        Added to the mean square; finite and >= 0.
    residual : torch.Tensor, optional
        Added to x first (``h_new = x + residual``, rounded to x's dtype), placed like x.
    deterministic : bool
        Accepted for API compatibility; the kernels are deterministic either way.
    weight_offset : float
        The scale is ``w + weight_offset`` (1.0 for Gemma's ``1 + w``).
    memory_efficient : bool
        Save the returned y instead of x (or h_new); the backward recomputes xhat from y and w.

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        y, or ``(y, h_new)`` in residual mode, in x's dtype and placed like x. The backward gives x and
        residual the same dx and w a dw in w's dtype (``Partial()`` for a DTensor w).

    Raises
    ------
    TypeError, ValueError
        A wrong dtype, shape or device, named by argument, before any launch; ``deterministic`` or
        ``memory_efficient`` not a bool.
    """

    @classmethod
    def apply(  # noqa: D102
        cls, x, w, eps, residual=None, deterministic=True, weight_offset=0.0, memory_efficient=False
    ):
        return _norm(
            cls,
            x,
            w,
            eps,
            residual,
            deterministic=deterministic,
            weight_offset=weight_offset,
            memory_efficient=memory_efficient,
        )

    @staticmethod
    def forward(ctx, x, w, eps, residual=None, deterministic=True, weight_offset=0.0, memory_efficient=False):
        """The Python path; while dynamo traces this Function the custom op stands for the kernels."""
        mode = memory_efficient
        if not torch.compiler.is_compiling():
            return _launch(ctx, norm_call(x, w, eps, residual, weight_offset, memory_efficient=mode))
        call = norm_call(x, w, eps, residual, weight_offset, on_gpu=False, memory_efficient=mode)
        y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(*call.math_arguments)
        return _saved(ctx, call, y, rstd, None if residual is None else h_new, direct=False)

    @staticmethod
    def backward(ctx, g, *g_h_new):
        dx, dw, d_residual = norm_backward(ctx, g, g_h_new[0] if ctx.residual else None)
        return dx, dw, None, d_residual, None, None, None


class CheckedRMSNormFunction(torch.autograd.Function):
    """``CakeRMSNormFunction`` for a call its entry checked: ``forward(ctx, x, w, residual, call)``, the
    tensors given beside ``call`` so that autograd records them."""

    @staticmethod
    def forward(ctx, x, w, residual, call):
        return _launch(ctx, call)

    @staticmethod
    def backward(ctx, g, *g_h_new):
        dx, dw, d_residual = norm_backward(ctx, g, g_h_new[0] if ctx.residual else None)
        return dx, dw, d_residual, None


def _launch(ctx, call: NormCall):
    """Both Functions' eager forward: the kernels launched from Python, and what the backward needs saved."""
    y, rstd, *h_new = dispatch.python_forward(call)
    return _saved(ctx, call, y, rstd, h_new[0] if h_new else None, direct=True)


def _saved(ctx, call: NormCall, y, rstd, h_new, direct: bool):
    """Save what the backward needs (``direct``: the kernels ran here, so the backward launches them
    too); returns y or ``(y, h_new)``."""
    saved_y = y if call.memory_efficient else None
    eps, offset = call.eps, call.weight_offset
    save_for_backward(ctx, call.x, call.w, call.residual, rstd, h_new, eps, offset, direct=direct, y=saved_y)
    # Unused outputs get None rather than a materialized zero tensor of size [T, H].
    ctx.set_materialize_grads(False)
    return y if call.residual is None else (y, h_new)


_function_apply = torch.autograd.Function.apply.__func__  # the engine's apply, below the routing


def _norm(cls, x, w, eps, residual, *, deterministic, weight_offset, memory_efficient):
    """A functional entry's call: the native node where it serves the call (it checks what it serves),
    else the arguments checked once into a ``NormCall`` run on its route."""
    if type(deterministic) is not bool or type(memory_efficient) is not bool:  # one cheap test per call
        _refuse_flags(deterministic, memory_efficient)
    v.check_tensor_kinds(x, w, residual)
    path = route(x, w)
    if path is NATIVE and cls is CakeRMSNormFunction and not memory_efficient:
        out = dispatch.native_rmsnorm(x, w, eps, residual, weight_offset)
        if out is not None:
            return out
    if path is NATIVE or path is PYTHON:
        if cls is not CakeRMSNormFunction:  # a subclass keeps its own forward, which checks its arguments
            return _function_apply(cls, x, w, eps, residual, deterministic, weight_offset, memory_efficient)
        path = PYTHON
    mode = memory_efficient
    if path is OP and torch.compiler.is_compiling():  # traced: the op's fake kernel checks the arguments
        return run(NormCall(x, w, eps, residual, weight_offset, None, None, None, None, mode), path)
    call = norm_call(
        x, w, eps, residual, weight_offset, on_gpu=False, torch_math=path is MATH, memory_efficient=mode
    )
    return run(call, path)


def _refuse_flags(deterministic, memory_efficient) -> None:
    v.check_bool("deterministic", deterministic)
    v.check_memory_efficient(memory_efficient)


def run(call: NormCall, path: str):
    """Run a checked call on its route (``routing.route``; where the native node declines a ``NATIVE``
    call, the Python launch).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        y, or ``(y, h_new)`` when the call has a residual.
    """
    if path is MATH:
        return _math(call)
    if path is OP:
        return cake_rmsnorm_traceable(call)
    if path is NATIVE and not call.memory_efficient:
        out = dispatch.native_rmsnorm(call.x, call.w, call.eps, call.residual, call.weight_offset)
        if out is not None:
            return out
    call = call._replace(operands=operands_of(call.x, call.w))  # the device checked, its facts read
    return CheckedRMSNormFunction.apply(call.x, call.w, call.residual, call)


class CakeRMSNormFp8Function(torch.autograd.Function):
    """``forward(ctx, x, w, eps, residual, recipe, emit_y, weight_offset)`` ->
    ``(data, compact scales, y or placeholder, rstd, h_new or empty)``; saves (x or h_new, w, rstd).

    The eager form of ``cake_cute::rmsnorm_fp8_fwd``, for arguments ``calls.fp8_call`` has validated."""

    @staticmethod
    def forward(ctx, x, w, eps, residual, recipe, emit_y, weight_offset):
        direct = x.device.type == "cuda"  # the launched kernels take rstd as one value per row, flat
        operands = operands_of(x, w) if direct else None
        call = Fp8Call(NormCall(x, w, eps, residual, weight_offset, operands), recipe, emit_y)
        data, scales, y, rstd, h_new = dispatch.fp8_forward(call)
        saved_rstd = rstd.reshape(-1) if direct else rstd
        save_for_backward(ctx, x, w, residual, saved_rstd, h_new, eps, weight_offset, direct=direct)
        ctx.mark_non_differentiable(data, scales, rstd)
        ctx.set_materialize_grads(False)
        return op_outputs(x, data, scales, y, rstd, h_new)

    backward = staticmethod(fp8_backward)


def cake_rmsnorm(
    x, w, eps=1e-6, residual=None, deterministic=True, weight_offset=0.0, memory_efficient=False
):
    """Fused RMSNorm with autograd, optionally after a fused residual add.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., H]`` bf16, fp16 or fp32 on CUDA or CPU, or a DTensor sharded on a non-hidden dimension
        or replicated.
    w : torch.Tensor
        ``[H]`` weight in x's dtype or fp32; a ``Replicate()`` DTensor when x is a DTensor.
    eps : float
        Added to the mean square (finite, >= 0).
    residual : torch.Tensor, optional
        Added to x before the norm; like x, placement included.
    deterministic : bool
        Accepted for API compatibility; results are deterministic either way.
    weight_offset : float
        The scale is ``w + weight_offset``.
    memory_efficient : bool
        Save the returned y instead of x or h_new; the backward recomputes xhat = y / (w +
        weight_offset), the scale clamped away from zero (docs/memory.md states the error).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        ``y = h * rstd * (w + weight_offset)``, or ``(y, h_new)`` with ``h_new = x + residual``, placed
        like x; a DTensor w's gradient is ``Partial()``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments (named), before any launch; a DTensor sharded on its last dimension.
    """
    return _norm(
        CakeRMSNormFunction,
        x,
        w,
        eps,
        residual,
        deterministic=deterministic,
        weight_offset=weight_offset,
        memory_efficient=memory_efficient,
    )
