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
from .operands import operands_of
from .reference import compute_dtype_of, forward_reference
from .routing import MATH, NATIVE, OP, route


def rmsnorm_math(x, w, eps, residual=None, weight_offset=0.0):
    """``cake_rmsnorm``'s outputs in torch operations, at the kernels' rounding points (FP32, or FP64 for
    FP64 inputs), for the ``MATH`` route: autograd and every ``torch.func`` transform take it as they
    take ``F.rms_norm``.

    Raises
    ------
    TypeError, ValueError
        The errors of ``calls.norm_call``.
    """
    call = norm_call(x, w, eps, residual, weight_offset, on_gpu=False, torch_math=True)
    y, _, h = forward_reference(*call.math_arguments, compute_dtype=compute_dtype_of(x.dtype))
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


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
        direct = not torch.compiler.is_compiling()
        call = norm_call(x, w, eps, residual, weight_offset, on_gpu=direct)
        if direct:
            y, rstd, *h_new = dispatch.python_forward(call)
            h_new = h_new[0] if h_new else None
        else:
            y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, call.eps, residual, call.weight_offset)
            h_new = None if residual is None else h_new
        saved_y = y if memory_efficient else None
        save_for_backward(
            ctx, x, w, residual, rstd, h_new, call.eps, call.weight_offset, direct=direct, y=saved_y
        )
        # Unused outputs get None rather than a materialized zero tensor of size [T, H].
        ctx.set_materialize_grads(False)
        return y if residual is None else (y, h_new)

    @staticmethod
    def backward(ctx, g, *g_h_new):
        dx, dw, d_residual = norm_backward(ctx, g, g_h_new[0] if ctx.residual else None)
        return dx, dw, None, d_residual, None, None, None


_function_apply = torch.autograd.Function.apply.__func__  # the engine's apply, below the routing


def _norm(cls, x, w, eps, residual, *, deterministic, weight_offset, memory_efficient):
    """Run a call on its route: torch math, the custom op, the C++ node, else the Function ``cls``."""
    if type(deterministic) is not bool or type(memory_efficient) is not bool:  # one cheap test per call
        _refuse_flags(deterministic, memory_efficient)
    path = route(x, w, residual)
    if path is MATH:
        return rmsnorm_math(x, w, eps, residual, weight_offset)
    if path is OP:
        if not torch.compiler.is_compiling():
            # Checked here as well as in the op: its schema would turn a bad argument into a RuntimeError
            # naming none, and a DTensor's sharding rule runs on the global shapes before the op's body
            # (while tracing, the op's fake kernel checks them).
            norm_call(x, w, eps, residual, weight_offset, on_gpu=False)
        return cake_rmsnorm_traceable(x, w, eps, residual, weight_offset, memory_efficient)
    if path is NATIVE and cls is CakeRMSNormFunction:  # a subclass keeps its own forward
        out = dispatch.native_rmsnorm(x, w, eps, residual, weight_offset, memory_efficient)
        if out is not None:
            return out
    return _function_apply(cls, x, w, eps, residual, deterministic, weight_offset, memory_efficient)


def _refuse_flags(deterministic, memory_efficient) -> None:
    v.check_bool("deterministic", deterministic)
    v.check_memory_efficient(memory_efficient)


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
