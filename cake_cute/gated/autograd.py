"""The gated RMSNorm kernels as ``torch.library`` custom ops with autograd and CPU kernels, and the public
entry ``cake_gated_rmsnorm``.

``cake_cute::gated_rmsnorm_fwd`` returns ``(y, rstd)``, rstd FP32 shaped ``gated.ops.rstd_shape``;
``cake_cute::gated_rmsnorm_bwd`` returns ``(dx, dz, dw)``, dw in w's dtype. The autograd saves exactly
``(x, z, w, rstd)``. Every call goes through the ops (opaque to torch.compile, sharded by DTensor, no
host synchronization on CUDA). The CPU kernels use the Hugging Face classes' operations in FP32 and
round each output once, so a swapped FP32 model on CPU computes bitwise what the stock one does.
"""

from __future__ import annotations

import torch

from .. import validation as v
from ..calls import gated_call
from ..library_ops import records_second_order
from ..reference import compute_dtype_of
from ..routing import MATH, route
from ..runtime.views import as_output, new_output
from ..vocab import SILU
from .ops import gated_rmsnorm_backward, gated_rmsnorm_forward, rstd_shape
from .reference import gate_terms, gated_backward_reference, gated_forward_reference

__all__ = ["cake_gated_rmsnorm"]

_FWD_SCHEMA = (
    "gated_rmsnorm_fwd(Tensor x, Tensor z, Tensor w, float eps, int? group_size=None, "
    "bool norm_before_gate=True, float weight_offset=0.0, str activation='silu') -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "gated_rmsnorm_bwd(Tensor g, Tensor x, Tensor z, Tensor w, Tensor rstd, int? group_size=None, "
    "bool norm_before_gate=True, float weight_offset=0.0, str activation='silu') -> (Tensor, Tensor, Tensor)"
)

# A fragment of the cake_cute namespace; keeps these registrations alive.
_LIB = torch.library.Library("cake_cute", "FRAGMENT")


# --- CUDA (the kernels) ---------------------------------------------------------------------------


def _forward_cuda(x, z, w, eps, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU):
    return gated_rmsnorm_forward(
        x,
        z,
        w,
        eps,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=weight_offset,
        activation=activation,
    )


def _backward_cuda(
    g, x, z, w, rstd, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU
):
    """dw in w's dtype: the FP32 sum rounded once by the reduction itself."""
    return gated_rmsnorm_backward(
        g,
        x,
        z,
        w,
        rstd,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=weight_offset,
        activation=activation,
        dw=new_output(w),
    )


# --- CPU (FP32, the Hugging Face classes' operations, one rounding) -------------------------------


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], t.shape[-1] // group_size, group_size)


def _scale(w: torch.Tensor, weight_offset: float) -> torch.Tensor:
    wf = w.float()
    return wf if weight_offset == 0.0 else wf + weight_offset


def _forward_cpu(x, z, w, eps, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU):
    call = gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
    group_size = call.group_size
    xf = x.float()
    gate, _ = gate_terms(z.float(), call.activation)
    h = _grouped(xf if norm_before_gate else xf * gate, group_size)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + call.eps)
    y = (h * rstd).reshape(x.shape) * _scale(w, call.weight_offset)
    if norm_before_gate:
        y = y * gate
    return as_output(y, x), as_output(rstd, x, rstd_shape(x, group_size), torch.float32)


def _backward_cpu(
    g, x, z, w, rstd, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU
):
    """The closed form the CUDA backward evaluates, in FP32 from the saved rstd."""
    group_size = v.check_group_size(group_size, x.shape[-1])
    gf, xf = g.float(), x.float()
    gate, dgate = gate_terms(z.float(), v.check_gate_activation(activation))
    scale = _scale(w, weight_offset)
    r = rstd.reshape(*x.shape[:-1], x.shape[-1] // group_size, 1)
    h = xf if norm_before_gate else xf * gate
    n = (_grouped(h, group_size) * r).reshape(x.shape)
    a = gf * scale * gate if norm_before_gate else gf * scale
    c = _grouped(a * n, group_size).mean(-1, keepdim=True)
    dh = ((_grouped(a, group_size) - _grouped(n, group_size) * c) * r).reshape(x.shape)
    rows = tuple(range(x.dim() - 1))
    if norm_before_gate:
        dx, dz, dw = dh, gf * n * scale * dgate, (gf * n * gate).sum(rows)
    else:
        dx, dz, dw = dh * gate, dh * xf * dgate, (gf * n).sum(rows)
    return as_output(dx, x), as_output(dz, x), as_output(dw, w)


# --- fake (tracing, meta tensors) -----------------------------------------------------------------


def _forward_fake(x, z, w, eps, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU):
    """The real op's outputs; argument errors surface while tracing."""
    call = gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
    return new_output(x), new_output(x, rstd_shape(x, call.group_size), torch.float32)


def _backward_fake(
    g, x, z, w, rstd, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU
):
    return new_output(x), new_output(x), new_output(w)


# --- autograd -------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    """Saves exactly (x, z, w, rstd); rstd gets no gradient, an unused y's gradient is None."""
    x, z, w, eps, group_size, norm_before_gate, weight_offset, activation = inputs
    _y, rstd = output
    ctx.save_for_backward(x, z, w, rstd)
    ctx.eps = eps
    ctx.options = (group_size, norm_before_gate, weight_offset, activation)
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)


def _backward(ctx, g, _g_rstd):
    if g is None:
        return None, None, None, None, None, None, None, None
    x, z, w, rstd = ctx.saved_tensors
    if records_second_order(g, x, z, w):  # double backward: a formula autograd differentiates again
        dx, dz, dw = _differentiable_backward(g, x, z, w, ctx.eps, *ctx.options)
    else:
        dx, dz, dw = torch.ops.cake_cute.gated_rmsnorm_bwd(g, x, z, w, rstd, *ctx.options)
    return dx, dz, dw, None, None, None, None, None


def _on_rows(reference, tensors, w, eps, group_size, norm_before_gate, weight_offset, activation):
    """A ``gated.reference`` function of [..., H] tensors (their leading dims as rows), computing in
    FP32, or FP64 for FP64 inputs."""
    hidden = tensors[0].shape[-1]
    return reference(
        *(t.reshape(-1, hidden) for t in tensors),
        w,
        eps,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=weight_offset,
        activation=activation,
        compute_dtype=compute_dtype_of(tensors[0].dtype),
    )


def _differentiable_backward(g, x, z, w, eps, *options):
    """(dx, dz, dw) as the kernels give them, in torch operations (for double backward)."""
    dx, dz, dw = _on_rows(gated_backward_reference, (g, x, z), w, eps, *options)
    return dx.reshape(x.shape).to(x.dtype), dz.reshape(x.shape).to(x.dtype), dw.to(w.dtype)


def gated_rmsnorm_math(call) -> torch.Tensor:
    """y of a gated call in torch operations (the ``MATH`` route), rounded once."""
    x, z, w, eps, *options = call
    y, _rstd = _on_rows(gated_forward_reference, (x, z), w, eps, *options)
    return y.reshape(x.shape).to(x.dtype)


def _register() -> None:
    for schema, name, cuda, cpu, fake in (
        (_FWD_SCHEMA, "gated_rmsnorm_fwd", _forward_cuda, _forward_cpu, _forward_fake),
        (_BWD_SCHEMA, "gated_rmsnorm_bwd", _backward_cuda, _backward_cpu, _backward_fake),
    ):
        _LIB.define(schema)
        _LIB.impl(name, cuda, "CompositeExplicitAutograd")
        _LIB.impl(name, cpu, "CPU")
        torch.library.register_fake(f"cake_cute::{name}", fake, lib=_LIB)
    torch.library.register_autograd(
        "cake_cute::gated_rmsnorm_fwd", _backward, setup_context=_setup_context, lib=_LIB
    )


_register()


def cake_gated_rmsnorm(
    x, z, w, eps=1e-6, *, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU
):
    """Gated RMSNorm with autograd, FP32 math and one rounding of y.

    ``norm_before_gate=True``: ``y = x * rstd * (w + weight_offset) * act(z)``; ``False``:
    ``y = (x * act(z)) * rstd_group * (w + weight_offset)``, statistics per group of ``group_size``
    columns (either form takes groups).

    Parameters
    ----------
    x, z : torch.Tensor
        ``[..., H]`` input and gate of one dtype (bf16, fp16, fp32; FP64 by torch operations), shape and
        device, CUDA or CPU; DTensors sharded on any dimension but the last, or replicated.
    w : torch.Tensor
        ``[H]`` weight in x's dtype or fp32 (``Replicate()`` for DTensor inputs).
    eps : float
        Added to the mean square; finite, >= 0.
    group_size : int, optional
        Columns per statistics group, dividing H (default H).
    norm_before_gate : bool
        Normalize then gate (True) or gate then normalize (False).
    weight_offset : float
        The scale is ``w + weight_offset``.
    activation : str
        ``"silu"`` (default) or ``"sigmoid"``.

    Returns
    -------
    torch.Tensor
        y like x; x and z get gradients in x's dtype, w in w's (``Partial()`` for sharded rows).

    Raises
    ------
    TypeError, ValueError
        A bad argument, named, before anything runs.
    """
    v.check_tensor_kinds(x, w)
    if route(x, w) is MATH:
        return gated_rmsnorm_math(
            gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation, torch_math=True)
        )
    # Checked here as well as in the op: its schema would turn a bad argument into a RuntimeError
    # naming none, and a DTensor's sharding rule runs on the global shapes before the op's body.
    call = gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
    y, _rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(*call)
    return y
