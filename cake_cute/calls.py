"""The call values: what a public entry's checks produce, and all that the layers below it read.

Each public entry turns its arguments into one immutable value here, with the checks of
``validation`` in the order that names the first bad argument and the device last (so argument
errors can be exercised without a GPU). The layers below check nothing again. A custom op is an
entry too (users and compiled graphs call it), so on the tracing, DTensor and CPU routes both the
entry and the op check: the op's schema would raise an error naming no argument, and a DTensor's
sharding rule runs before the op's body.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .runtime.operands import Operands, known_operands, operands, operands_of
from .validation import (
    check_activation,
    check_backward_outputs,
    check_bool,
    check_dw_dtype,
    check_eps,
    check_forward_outputs,
    check_gate_activation,
    check_gradient_parts,
    check_group_size,
    check_like,
    check_memory_efficient,
    check_recipe,
    check_rstd,
    check_scale_layout,
    check_weight,
    check_weight_offset,
    check_workspace,
)
from .vocab import SILU


class NormCall(NamedTuple):
    """A plain-norm forward as ``norm_call`` accepted it."""

    x: torch.Tensor
    w: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    weight_offset: float
    operands: Operands | None  # None where no kernel runs: the CPU reference, tracing, a DTensor
    out: torch.Tensor | None = None
    rstd: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    memory_efficient: bool = False  # the autograd entries' mode: save y instead of x or h_new

    @property
    def math_arguments(self) -> tuple:
        """``(x, w, eps, residual, weight_offset)``: what the references take."""
        return self.x, self.w, self.eps, self.residual, self.weight_offset


def norm_call(
    x,
    w,
    eps,
    residual=None,
    weight_offset=0.0,
    out=None,
    rstd=None,
    residual_out=None,
    *,
    on_gpu=True,
    torch_math=False,
    memory_efficient=False,
) -> NormCall:
    """Check every argument of a plain-norm forward, the device last (``on_gpu``: the kernels will run;
    ``torch_math``: FP64 accepted; ``memory_efficient``: the autograd entries' mode)."""
    known = known_operands(x, w) if on_gpu else None  # the hot path: (x, w) seen before
    if known is None:
        check_activation(x, torch_math=torch_math)
        check_weight(w, x)
    eps = check_eps(eps)
    weight_offset = check_weight_offset(weight_offset)
    if residual is not None:
        check_like("residual", residual, x)
    if out is not None or rstd is not None or residual_out is not None:
        check_forward_outputs(x, x.numel() // x.shape[-1], residual, out, rstd, residual_out)
    if memory_efficient is not False:
        check_memory_efficient(memory_efficient)
    if on_gpu and known is None:
        known = operands(x, w)
    return NormCall(x, w, eps, residual, weight_offset, known, out, rstd, residual_out, memory_efficient)


def module_call(x, w, residual, form, x_name: str = "x") -> NormCall:
    """Check a norm module's tensors (x named ``x_name``, FP64 included; a weight of any floating dtype,
    or None for a unit scale; residual like x). The module's settings (``form``: its eps, weight_offset
    and memory_efficient) are trusted: they were checked when they were set."""
    if w is None or known_operands(x, w) is None:  # a pair the kernels' checks passed passes these
        check_activation(x, torch_math=True, name=x_name)
        if w is not None:
            check_weight(w, x, any_dtype=True)
    if residual is not None:
        check_like("residual", residual, x)
    return NormCall(
        x, w, form.eps, residual, form.weight_offset, None, None, None, None, form.memory_efficient
    )


class BackwardCall(NamedTuple):
    """A plain-norm backward as ``backward_call`` accepted it, or as autograd saved it."""

    g_parts: tuple  # g's summands, usually one tensor
    h: torch.Tensor  # what the forward normalized (x or h_new), or its output y when memory_efficient
    w: torch.Tensor
    rstd: torch.Tensor  # FP32 [rows]
    g_residual: torch.Tensor | None
    weight_offset: float
    dw_dtype: torch.dtype
    operands: Operands
    memory_efficient: bool = False  # h is y, xhat is recomputed from it
    workspace: torch.Tensor | None = None
    dx: torch.Tensor | None = None
    dw: torch.Tensor | None = None


def backward_call(
    g,
    x,
    w,
    rstd,
    g_residual=None,
    weight_offset=0.0,
    dw_dtype=torch.float32,
    workspace=None,
    dx=None,
    dw=None,
    memory_efficient=False,
) -> BackwardCall:
    """Check every argument of a plain-norm backward on the GPU, the device last."""
    known = known_operands(x, w)
    if known is None:
        check_activation(x)
    g_parts = check_gradient_parts(g, x)
    if known is None:
        check_weight(w, x)
    check_rstd(rstd, x.numel() // x.shape[-1], x.device)
    if g_residual is not None:
        check_like("g_residual", g_residual, x)
    weight_offset = check_weight_offset(weight_offset)
    dw_dtype = check_dw_dtype(dw_dtype)
    if dx is not None or dw is not None:
        check_backward_outputs(x, dx, dw, dw_dtype)
    if workspace is not None:
        check_workspace(workspace, x.device)
    if known is None:
        known = operands(x, w)
    return BackwardCall(
        g_parts, x, w, rstd, g_residual, weight_offset, dw_dtype, known, memory_efficient, workspace, dx, dw
    )


class Fp8Call(NamedTuple):
    """A forward to FP8 as ``fp8_call`` accepted it."""

    norm: NormCall
    recipe: str
    emit_y: bool


def fp8_call(
    x, w, eps, residual, recipe, emit_y, weight_offset, scale_layout="compact", *, on_gpu
) -> Fp8Call:
    """Check every argument of a forward to FP8, the device last."""
    norm = norm_call(x, w, eps, residual, weight_offset, on_gpu=False)
    check_recipe(recipe)
    check_bool("emit_y", emit_y)
    check_scale_layout(scale_layout, recipe)
    if on_gpu:
        norm = norm._replace(operands=operands_of(x, w))
    return Fp8Call(norm, recipe, emit_y)


class GatedCall(NamedTuple):
    """A gated-norm call's common arguments as ``gated_call`` accepted them, in the gated ops' order."""

    x: torch.Tensor
    z: torch.Tensor
    w: torch.Tensor
    eps: float | None  # None for a backward, which takes the forward's rstd instead
    group_size: int
    norm_before_gate: bool
    weight_offset: float
    activation: str  # vocab.GATE_ACTIVATIONS


def gated_call(
    x,
    z,
    w,
    eps,
    group_size,
    norm_before_gate,
    weight_offset,
    activation=SILU,
    weight_name="w",
    *,
    torch_math=False,
) -> GatedCall:
    """Check the gated norm's arguments, naming the weight ``weight_name``; ``torch_math``: FP64 accepted."""
    check_activation(x, torch_math=torch_math)
    check_like("z", z, x)
    check_weight(w, x, weight_name)
    check_bool("norm_before_gate", norm_before_gate)
    group_size = check_group_size(group_size, x.shape[-1])
    eps = None if eps is None else check_eps(eps)
    weight_offset, activation = check_weight_offset(weight_offset), check_gate_activation(activation)
    return GatedCall(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
