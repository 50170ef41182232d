"""Autograd: saves exactly (x or h_new, w, rstd) and calls the kernels.

Eager calls on plain CUDA tensors take the native autograd node (``native``: C++, for the plain
layouts of a signature the Python path has validated) or else launch the kernels directly from
``CakeRMSNormFunction`` (``ops``). Every other call goes through
the ``cake_cute::`` custom ops: while torch.compile traces (``torch.compiler.is_compiling()`` is True;
dynamo folds it to a constant, in eager it is a flag read of ~0.2 µs), because dynamo cannot trace the
launch code; for DTensor inputs, because the ops carry the sharding rules (``cake_cute.distributed``);
and for CPU tensors, which the ops' CPU kernels handle. The eager ``CakeRMSNormFunction`` and the ops'
registered autograd share one save/backward helper (``custom_ops.save_for_backward`` and
``custom_ops.norm_backward``).
"""

from __future__ import annotations

import torch

from . import native
from . import validation as v
from .custom_ops import cake_rmsnorm_traceable, check_forward_arguments, norm_backward, save_for_backward
from .ops import train_forward_python

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch built without distributed has no DTensor, so no input is one

    class DTensor:  # noqa: D101
        pass


def _launches_directly(x, w) -> bool:
    """True for plain CUDA tensors in eager (the fast path without the dispatcher)."""
    return (
        x.is_cuda
        and not torch.compiler.is_compiling()
        and not isinstance(x, DTensor)
        and not isinstance(w, DTensor)
    )


def _forward(x, w, eps, residual, weight_offset, deterministic, direct):
    """``(y, rstd, h_new)``, h_new None in plain mode."""
    if direct:
        outs = train_forward_python(x, w, eps, residual, weight_offset=weight_offset)
        return outs if residual is not None else (*outs, None)
    # The op's schema would turn a bad argument into a RuntimeError that names no argument.
    check_forward_arguments(x, w, eps, residual)
    weight_offset = v.check_weight_offset(weight_offset)
    y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, eps, residual, weight_offset, deterministic)
    return y, rstd, (None if residual is None else h_new)


class CakeRMSNormFunction(torch.autograd.Function):
    """Fused RMSNorm as a ``torch.autograd.Function``.

    ``CakeRMSNormFunction.apply(x, w, eps, residual=None, deterministic=True, weight_offset=0.0)``

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

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        y, or ``(y, h_new)`` in residual mode, in x's dtype and placed like x. The backward gives x and
        residual the same dx and w a dw in w's dtype (``Partial()`` for a DTensor w).

    Raises
    ------
    TypeError, ValueError
        A wrong dtype, shape or device, named by argument, before any launch.

    Notes
    -----
    Saves exactly ``(x or h_new, w, rstd)``; gradients that are not needed are not materialized.
    """

    @staticmethod
    def forward(ctx, x, w, eps, residual=None, deterministic=True, weight_offset=0.0):
        direct = _launches_directly(x, w)
        y, rstd, h_new = _forward(x, w, eps, residual, weight_offset, deterministic, direct)
        save_for_backward(ctx, x, w, residual, rstd, h_new, weight_offset, deterministic, direct)
        # Unused outputs get None rather than a materialized zero tensor of size [T, H].
        ctx.set_materialize_grads(False)
        return y if residual is None else (y, h_new)

    @staticmethod
    def backward(ctx, g, *g_h_new):
        dx, dw, d_residual = norm_backward(ctx, g, g_h_new[0] if ctx.residual else None)
        return dx, dw, None, d_residual, None, None


def cake_rmsnorm(x, w, eps=1e-6, residual=None, deterministic=True, weight_offset=0.0):
    """Fused RMSNorm with autograd, optionally after a fused residual add.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., H]`` activations (bf16, fp16, fp32) on CUDA or CPU, or a DTensor sharded on a
        non-hidden dimension or replicated.
    w : torch.Tensor
        ``[H]`` weight in x's dtype or fp32; a ``Replicate()`` DTensor when x is a DTensor.
    eps : float
        Added to the mean square (finite, >= 0).
    residual : torch.Tensor, optional
        Added to x before the norm; same shape, dtype, device and placement as x.
    deterministic : bool
        Accepted for API compatibility; results are deterministic either way.
    weight_offset : float
        The scale is ``w + weight_offset``.

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        ``y = h * rstd * (w + weight_offset)``, or ``(y, h_new)`` with ``h_new = x + residual``.
        DTensor outputs keep x's placements; the weight gradient of a DTensor w is ``Partial()``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments (named), before any launch; a DTensor sharded on its last dimension.

    Notes
    -----
    Under torch.compile this traces to the ``cake_cute::rmsnorm_fwd`` custom op with its registered
    autograd; in eager it is the native autograd node for plain calls of a signature seen before
    (``cake_cute.native``), else ``CakeRMSNormFunction``.
    """
    if torch.compiler.is_compiling():
        return cake_rmsnorm_traceable(x, w, eps, residual, deterministic, weight_offset)
    fast = native.fast
    if fast is not None:
        out = fast.rmsnorm(x, w, eps, residual, weight_offset)
        if out is not None:
            return out
    return CakeRMSNormFunction.apply(x, w, eps, residual, deterministic, weight_offset)
