"""The kernels as ``torch.library`` custom ops, so that torch.compile sees two opaque nodes instead of
launch code it cannot trace (no graph break).

``cake_cute::rmsnorm_fwd`` returns ``(y, rstd, h_new)`` and ``cake_cute::rmsnorm_bwd`` returns
``(dx, dw)``. Both have fake implementations (output shapes, dtypes and devices without running
anything) and the forward has a registered autograd formula, so AOTAutograd puts the backward op in the
backward graph. A schema has a fixed number of outputs, so in plain mode (no residual) ``h_new`` is an
empty tensor.

Eager code never comes here: a Python custom op pays the dispatcher tens of microseconds per call, so
``cake_rmsnorm`` and ``CakeRMSNormFunction`` launch the kernels directly and switch to these ops only
while ``torch.compiler.is_compiling()``. Caller-owned ``out=`` buffers are an eager feature and have no
op form.
"""

from __future__ import annotations

import math

import torch

from . import validation as v
from .ops import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward

_FWD_SCHEMA = (
    "(Tensor x, Tensor w, float eps, Tensor? residual=None, float weight_offset=0.0, "
    "bool deterministic=True) -> (Tensor, Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor g, Tensor x, Tensor w, Tensor rstd, Tensor? g_residual=None, float weight_offset=0.0, "
    "bool deterministic=True, ScalarType? dw_dtype=None) -> (Tensor, Tensor)"
)


@torch.library.custom_op("cake_cute::rmsnorm_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def rmsnorm_fwd(x, w, eps, residual=None, weight_offset=0.0, deterministic=True):
    """``(y, rstd, h_new)``. ``deterministic`` only travels to the backward through autograd."""
    outs = cake_rmsnorm_train_forward(x, w, eps, residual=residual, weight_offset=weight_offset)
    if residual is None:
        return outs[0], outs[1], x.new_empty(0)
    return outs


@rmsnorm_fwd.register_fake
def _rmsnorm_fwd_fake(x, w, eps, residual=None, weight_offset=0.0, deterministic=True):
    """Contiguous outputs like the real op; argument errors surface while tracing, not at run time."""
    v.check_activation(x)
    v.check_weight(w, x)
    v.check_eps(eps)
    if residual is not None:
        v.check_like("residual", residual, x)
    rows = math.prod(x.shape[:-1])
    h_new = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32), h_new


@torch.library.custom_op("cake_cute::rmsnorm_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def rmsnorm_bwd(g, x, w, rstd, g_residual=None, weight_offset=0.0, deterministic=True, dw_dtype=None):
    """``(dx, dw)``; dw is FP32 unless ``dw_dtype`` is given (autograd asks for w's dtype)."""
    return cake_rmsnorm_train_backward(
        g,
        x,
        w,
        rstd,
        deterministic=deterministic,
        g_residual=g_residual,
        weight_offset=weight_offset,
        dw_dtype=dw_dtype or torch.float32,
    )


@rmsnorm_bwd.register_fake
def _rmsnorm_bwd_fake(g, x, w, rstd, g_residual=None, weight_offset=0.0, deterministic=True, dw_dtype=None):
    return x.new_empty(x.shape), x.new_empty((x.shape[-1],), dtype=dw_dtype or torch.float32)


def _setup_context(ctx, inputs, output):
    """Saves exactly (x or h_new, w, rstd), like the eager ``CakeRMSNormFunction``."""
    x, w, _eps, residual, weight_offset, deterministic = inputs
    _y, rstd, h_new = output
    ctx.mark_non_differentiable(rstd)
    if residual is None:
        ctx.mark_non_differentiable(h_new)
    ctx.save_for_backward(x if residual is None else h_new, w, rstd)
    ctx.residual = residual is not None
    ctx.weight_offset = weight_offset
    ctx.deterministic = deterministic


def _backward(ctx, g, _g_rstd, g_h):
    """One dx for both x and residual (h = x + residual); dw in w's dtype."""
    h, w, rstd = ctx.saved_tensors
    dx, dw = torch.ops.cake_cute.rmsnorm_bwd(
        g, h, w, rstd, g_h if ctx.residual else None, ctx.weight_offset, ctx.deterministic, w.dtype
    )
    return dx, dw, None, (dx if ctx.residual else None), None, None


rmsnorm_fwd.register_autograd(_backward, setup_context=_setup_context)


def cake_rmsnorm_traceable(x, w, eps, residual=None, deterministic=True, weight_offset=0.0):
    """``cake_rmsnorm`` as torch.compile traces it: y, or (y, h_new) when a residual is given."""
    y, _rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, eps, residual, weight_offset, deterministic)
    return y if residual is None else (y, h_new)
