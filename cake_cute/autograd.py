"""Autograd: saves exactly (x or h_new, w, rstd) and calls the functional kernels."""

from __future__ import annotations

import torch

from .ops import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward


class CakeRMSNormFunction(torch.autograd.Function):
    """``forward(ctx, x, w, eps, residual=None, deterministic=True, weight_offset=0.0)`` returns y, or
    (y, h_new) when a residual is given; the backward returns the same dx for x and residual."""

    @staticmethod
    def forward(ctx, x, w, eps, residual=None, deterministic=True, weight_offset=0.0):
        outs = cake_rmsnorm_train_forward(x, w, eps, residual=residual, weight_offset=weight_offset)
        y, rstd = outs[0], outs[1]
        saved = outs[2] if residual is not None else x
        ctx.save_for_backward(saved, w, rstd)
        ctx.deterministic = deterministic
        ctx.weight_offset = weight_offset
        ctx.residual = residual is not None
        if residual is None:
            return y
        return y, outs[2]

    @staticmethod
    def backward(ctx, *grads):
        h, w, rstd = ctx.saved_tensors
        g = grads[0]
        g_residual = grads[1] if ctx.residual else None
        if g is None:
            # Only h_new was used: its gradient flows to x and residual unchanged; w gets none.
            return g_residual, None, None, g_residual, None, None
        dx, dw = cake_rmsnorm_train_backward(
            g, h, w, rstd,
            deterministic=ctx.deterministic,
            g_residual=g_residual,
            weight_offset=ctx.weight_offset,
            dw_dtype=w.dtype,
        )
        return dx, dw, None, (dx if ctx.residual else None), None, None


def cake_rmsnorm(x, w, eps=1e-6, residual=None, deterministic=True, weight_offset=0.0):
    """Fused RMSNorm with autograd: y, or (y, h_new) with ``h_new = x + residual``."""
    return CakeRMSNormFunction.apply(x, w, eps, residual, deterministic, weight_offset)
