"""The call values: what a public entry's checks produce, and all that the layers below it read.

Each public entry (the functional forward and backward, the autograd Functions, the forward to FP8,
the gated norm, and the custom ops' bodies, which compiled graphs and users call directly) turns its
arguments into one immutable value here (``norm_call``, ``backward_call``, ``fp8_call``,
``gated_call``), with the checks of ``validation`` in the order that names the first bad argument, the
device last (so the argument errors can be exercised without a GPU). The launches, the CPU reference
and the native hand-over take the value and check nothing again. On the tracing, DTensor and CPU route
an entry calls a custom op, which is an entry itself (called directly too), so both check: the op's
schema would turn a value of the wrong kind into an error naming no argument, and a DTensor's sharding
rule runs on the global shapes before the op's body.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .operands import Operands, known_operands, operands, operands_of
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
    check_recipe,
    check_rstd,
    check_scale_layout,
    check_weight,
    check_weight_offset,
    check_workspace,
)
from .vocab import SILU


class NormCall(NamedTuple):
    """A plain-norm forward as ``norm_call`` accepted it: eps and weight_offset as floats, the
    caller's outputs checked, and (x, w)'s device facts where the kernels run."""

    x: torch.Tensor
    w: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    weight_offset: float
    operands: Operands | None  # None where no kernel runs: the CPU reference, tracing, a DTensor
    out: torch.Tensor | None = None
    rstd: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    @property
    def math_arguments(self) -> tuple:
        """``(x, w, eps, residual, weight_offset)``: what the SPEC's math takes
        (``reference.forward_reference``, ``cpu.forward``, the FP8 reference)."""
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
) -> NormCall:
    """Every argument of a plain-norm forward, the device last (``on_gpu``: the kernels will run, so x
    must be on a supported GPU; False for the CPU reference, fake tensors and DTensors, whose local
    calls are checked again by the op they reach). ``torch_math``: torch operations compute it (the
    ``MATH`` route), so FP64 is accepted too.

    Raises
    ------
    TypeError, ArgumentError, ValueError
        As the checks of x, w, eps, weight_offset, residual and the outputs raise them, naming the
        argument; ``ValueError`` for x off a supported GPU when ``on_gpu``.
    """
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
    if on_gpu and known is None:
        known = operands(x, w)
    return NormCall(x, w, eps, residual, weight_offset, known, out, rstd, residual_out)


class BackwardCall(NamedTuple):
    """A plain-norm backward as ``backward_call`` accepted it (or as autograd saved it: the forward
    validated those tensors)."""

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
    """Every argument of a plain-norm backward on the GPU, the device last.

    Raises
    ------
    TypeError, ArgumentError, ValueError
        As the checks of g, x, w, rstd, g_residual, weight_offset, dw_dtype, the outputs and the
        workspace raise them, naming the argument; ``ValueError`` for x off a supported GPU.
    """
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
    """Every argument of a forward to FP8, the device last (``on_gpu`` as for ``norm_call``).

    Raises
    ------
    TypeError, ArgumentError, ValueError
        ``norm_call``'s errors, an unknown recipe or scale layout, emit_y not a bool.
    """
    norm = norm_call(x, w, eps, residual, weight_offset, on_gpu=False)
    check_recipe(recipe)
    check_bool("emit_y", emit_y)
    check_scale_layout(scale_layout, recipe)
    if on_gpu:
        norm = norm._replace(operands=operands_of(x, w))
    return Fp8Call(norm, recipe, emit_y)


class GatedCall(NamedTuple):
    """A gated-norm call's common arguments as ``gated_call`` accepted them (group_size resolved), in
    the order of the gated custom ops' arguments after the tensors."""

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
    """The gated norm's arguments, before anything runs (the device excepted: the kernels' variant
    names the architecture, CPU tensors run the CPU kernels); errors name the weight ``weight_name``
    (FlashInfer's entries call it ``weight``). ``torch_math``: torch operations compute it (the
    ``MATH`` route), so FP64 is accepted too.

    Raises
    ------
    TypeError, ArgumentError, ValueError
        The argument named, with what was expected.
    """
    check_activation(x, torch_math=torch_math)
    check_like("z", z, x)
    check_weight(w, x, weight_name)
    check_bool("norm_before_gate", norm_before_gate)
    group_size = check_group_size(group_size, x.shape[-1])
    eps = None if eps is None else check_eps(eps)
    weight_offset, activation = check_weight_offset(weight_offset), check_gate_activation(activation)
    return GatedCall(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
