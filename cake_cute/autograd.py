"""Autograd: saves exactly (x or h_new, w, rstd) and calls the functional kernels.

Eager calls launch the kernels directly. While torch.compile traces, ``torch.compiler.is_compiling()``
is True (dynamo folds it to a constant; in eager it is a flag read of ~0.2 µs) and the same calls go
through the ``cake_cute::`` custom ops instead, because dynamo cannot trace the launch code. See
``custom_ops`` for why eager avoids the ops.
"""

from __future__ import annotations

import torch

from .custom_ops import cake_rmsnorm_traceable
from .ops import backward_from_saved, cake_rmsnorm_train_forward


def _forward(x, w, eps, residual, weight_offset, deterministic):
    """``(y, rstd, h_new)``, h_new None in plain mode."""
    if torch.compiler.is_compiling():
        y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, eps, residual, weight_offset, deterministic)
        return y, rstd, (None if residual is None else h_new)
    outs = cake_rmsnorm_train_forward(x, w, eps, residual=residual, weight_offset=weight_offset)
    return outs if residual is not None else (*outs, None)


def _backward(g, h, w, rstd, g_residual, weight_offset, deterministic):
    """``(dx, dw)`` with dw in w's dtype."""
    if torch.compiler.is_compiling():
        return torch.ops.cake_cute.rmsnorm_bwd(
            g, h, w, rstd, g_residual, weight_offset, deterministic, w.dtype
        )
    # deterministic=False runs the deterministic kernels too (see ops.cake_rmsnorm_train_backward).
    return backward_from_saved(g, h, w, rstd, g_residual, weight_offset)


class CakeRMSNormFunction(torch.autograd.Function):
    """``forward(ctx, x, w, eps, residual=None, deterministic=True, weight_offset=0.0)`` returns y, or
    (y, h_new) when a residual is given; the backward returns the same dx for x and residual."""

    @staticmethod
    def forward(ctx, x, w, eps, residual=None, deterministic=True, weight_offset=0.0):
        y, rstd, h_new = _forward(x, w, eps, residual, weight_offset, deterministic)
        ctx.save_for_backward(x if residual is None else h_new, w, rstd)
        # Unused outputs get None rather than a materialized zero tensor of size [T, H].
        ctx.set_materialize_grads(False)
        ctx.residual = residual is not None
        ctx.deterministic = deterministic
        ctx.weight_offset = weight_offset
        return y if residual is None else (y, h_new)

    @staticmethod
    def backward(ctx, g, *g_h_new):
        h, w, rstd = ctx.saved_tensors
        g_residual = g_h_new[0] if ctx.residual else None
        if g is None:
            # Only h_new was used: its gradient reaches x and residual unchanged, and w gets none.
            return g_residual, None, None, g_residual, None, None
        dx, dw = _backward(g, h, w, rstd, g_residual, ctx.weight_offset, ctx.deterministic)
        return dx, dw, None, (dx if ctx.residual else None), None, None


def cake_rmsnorm(x, w, eps=1e-6, residual=None, deterministic=True, weight_offset=0.0):
    """Fused RMSNorm with autograd: y, or (y, h_new) with ``h_new = x + residual``.

    Under torch.compile this traces to the ``cake_cute::rmsnorm_fwd`` custom op with its registered
    autograd; in eager it is ``CakeRMSNormFunction`` launching the kernels directly."""
    if torch.compiler.is_compiling():
        return cake_rmsnorm_traceable(x, w, eps, residual, deterministic, weight_offset)
    return CakeRMSNormFunction.apply(x, w, eps, residual, deterministic, weight_offset)
