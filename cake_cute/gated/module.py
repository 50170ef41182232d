"""``CakeGatedRMSNorm``: the gated RMSNorm as a module, called as the Hugging Face gated norm classes
call theirs, with their gate activation (SiLU or sigmoid) and their roundings (``cast_policy``;
docs/gated.md lists the classes):

* ``"one_rounding"``: FP32 math, y rounded once to x's dtype, the kernels' own arithmetic.
* ``"round_then_scale"``: the normalized values rounded to x's dtype, then scaled by the weight in
  torch's promoted dtype. Gate then norm: ``y = w * round(rmsnorm_g(x * act(z)))``, the gated kernel
  with a unit weight, then torch's multiply. Norm then gate: ``y = round((w * round(x * rstd)) *
  act(z))``, the plain kernel with a unit weight, then torch's weight and gate (the gated kernel
  rounds once, so it cannot serve a gate after a rounding).
* ``"scale_then_round"``: norm then gate ``y = round(round(x * rstd * w) * act(z))``, the plain
  kernel with the weight, then torch's gate; gate then norm rounds once, as ``"one_rounding"``.

In eager mode the backward recomputes torch's gate products rather than keeping them. With FP32
activations and weight every policy runs the gated kernel directly. A gate of another dtype than x (the
classes compute from ``gate.float()`` whatever the dtypes) runs the FP32 kernels on x and the widened
gate and rounds y to x's dtype once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import validation as v
from ..autograd import cake_rmsnorm
from ..runtime.views import kernel_weight
from ..vocab import SIGMOID, SILU
from .autograd import cake_gated_rmsnorm

ONE_ROUNDING = "one_rounding"
ROUND_THEN_SCALE = "round_then_scale"
SCALE_THEN_ROUND = "scale_then_round"
GATED_CAST_POLICIES = (ONE_ROUNDING, ROUND_THEN_SCALE, SCALE_THEN_ROUND)
# The gate activations as torch computes them (the Hugging Face classes' own functions).
_TORCH_ACTIVATIONS = {SILU: F.silu, SIGMOID: torch.sigmoid}


def check_gated_cast_policy(name: str, value) -> str:
    """``value`` if it is one of ``GATED_CAST_POLICIES``, else a ValueError naming ``name``."""
    if value not in GATED_CAST_POLICIES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, GATED_CAST_POLICIES))}; got {value!r}")
    return value


class GatedForm(NamedTuple):
    """What a gated norm computes besides its tensors: ``CakeGatedRMSNorm``'s settings or a Hugging Face
    one's."""

    eps: float
    group_size: int  # columns per statistics group, dividing H
    norm_before_gate: bool
    weight_offset: float
    cast_policy: str
    activation: str = SILU


def gated_rmsnorm_with_casts(
    x: torch.Tensor, gate: torch.Tensor | None, w: torch.Tensor, form: GatedForm
) -> torch.Tensor:
    """The gated RMSNorm of ``x`` ([H] or [..., H]) by ``gate`` (None: the grouped RMSNorm alone), gated
    and rounded as ``form`` says: what ``CakeGatedRMSNorm`` and the kernel route's gated layer compute.
    Shaped like x, in x's dtype or, for ``"round_then_scale"`` gate then norm, the promotion of w's and
    x's; raises ``cake_gated_rmsnorm``'s errors."""
    if x.dim() == 1:
        row = None if gate is None else gate.unsqueeze(0)
        return gated_rmsnorm_with_casts(x.unsqueeze(0), row, w, form).squeeze(0)
    if x.dtype == torch.float64:
        # The Hugging Face gated classes cast their input and gate to FP32 whatever the model's dtype:
        # an FP64 model's gated norm is FP32 math, returned in FP64.
        row_gate = None if gate is None else gate.float()
        return gated_rmsnorm_with_casts(x.float(), row_gate, w, form).to(torch.float64)
    if gate is None:
        return _ungated(x, w, form)
    if _rounds_once(x, w, form):
        return _gated(x, gate, kernel_weight(w, x), form, form.weight_offset)
    if not form.norm_before_gate:
        # w * round(rmsnorm_g(x * act(z))): the gated kernel with a unit scale, then torch's product.
        return _scale(w, form) * _gated(x, gate, x.new_ones(x.shape[-1]), form, 0.0)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # Autograd would keep torch's FP32 gate and products for the backward (12 bytes per
        # element); the backward recomputes them instead, the same operations and so the same bits,
        # and the norm keeps x and z alone. A compiled graph leaves that choice to its partitioner.
        # w is held by the closure, not handed to the checkpoint, which would keep it as an input.
        norm_then_gate = functools.partial(_norm_then_gate, w=w, form=form)
        return checkpoint(norm_then_gate, x, gate, use_reentrant=False, preserve_rng_state=False)
    return _norm_then_gate(x, gate, w, form)


def _norm_then_gate(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, form: GatedForm) -> torch.Tensor:
    """Norm then gate under the two-rounding policies, grouped when group_size < H."""
    if form.cast_policy == ROUND_THEN_SCALE:
        scaled = _scale(w, form) * _normalized(x, x.dtype, form)
    else:
        scaled = _scaled(x, w, form)
    return (scaled * _TORCH_ACTIVATIONS[form.activation](gate.float())).to(x.dtype)


def _scaled(x: torch.Tensor, w: torch.Tensor, form: GatedForm) -> torch.Tensor:
    """``round(x * rstd * (w + weight_offset))`` per group, the product in FP32."""
    if form.group_size == x.shape[-1] and w.dtype in (x.dtype, torch.float32):
        return cake_rmsnorm(x, w, form.eps, weight_offset=form.weight_offset)
    return (_normalized(x, torch.float32, form) * (w.float() + form.weight_offset)).to(x.dtype)


def _rounds_once(x: torch.Tensor, w: torch.Tensor, form: GatedForm) -> bool:
    """Whether y is the fused kernel's one rounding under this form and these dtypes."""
    if x.dtype == w.dtype == torch.float32:
        return True
    return form.cast_policy == ONE_ROUNDING or (
        form.cast_policy == SCALE_THEN_ROUND and not form.norm_before_gate
    )


def _gated(x, gate, w, form: GatedForm, weight_offset: float):
    """The gated kernel on (x, gate, w); a gate of another dtype than x's takes the FP32 kernel."""
    if gate.dtype == x.dtype:
        return _gated_kernel(x, gate, w, form, weight_offset)
    wide = x.float()  # x itself when it is FP32
    return _gated_kernel(wide, gate.float(), kernel_weight(w, wide), form, weight_offset).to(x.dtype)


def _gated_kernel(x, gate, w, form: GatedForm, weight_offset: float) -> torch.Tensor:
    return cake_gated_rmsnorm(
        x,
        gate,
        w,
        form.eps,
        group_size=form.group_size,
        norm_before_gate=form.norm_before_gate,
        weight_offset=weight_offset,
        activation=form.activation,
    )


def _scale(w: torch.Tensor, form: GatedForm) -> torch.Tensor:
    return w if form.weight_offset == 0.0 else w + form.weight_offset


def _normalized(x: torch.Tensor, dtype: torch.dtype, form: GatedForm) -> torch.Tensor:
    """``x * rstd`` per group in ``dtype`` (the plain kernel with a unit scale, exact)."""
    source = x if dtype == x.dtype else x.to(dtype)
    size = form.group_size
    groups = source.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    return cake_rmsnorm(groups, groups.new_ones(size), form.eps).reshape(x.shape)


def _ungated(x: torch.Tensor, w: torch.Tensor, form: GatedForm) -> torch.Tensor:
    """The grouped RMSNorm without a gate, under the same casts."""
    if form.cast_policy != ROUND_THEN_SCALE:
        return _scaled(x, w, form)
    return _scale(w, form) * _normalized(x, torch.float32, form).to(x.dtype)


class CakeGatedRMSNorm(nn.Module):
    """Gated RMSNorm over the last dimension with the cake_cute kernels.

    ``forward(hidden_states, gate=None)``: ``norm_before_gate=True`` gives
    ``x * rstd * (w + weight_offset) * act(gate)``, ``False`` gives
    ``rmsnorm_group(x * act(gate)) * (w + weight_offset)``, rounded as ``cast_policy`` says; without a
    gate, the (grouped) RMSNorm with the same casts.

    Parameters
    ----------
    hidden_size : int
        H, the weight's size.
    eps : float
        Added to the mean square; finite, >= 0.
    group_size : int, optional
        Columns per statistics group, dividing H (default H).
    norm_before_gate : bool
        The order of the norm and the gate.
    weight_offset : float
        The scale is ``weight + weight_offset``.
    cast_policy : str
        ``"one_rounding"`` (default), ``"round_then_scale"`` or ``"scale_then_round"``.
    activation : str
        ``"silu"`` (default) or ``"sigmoid"``.
    device, dtype : optional
        Of the weight.

    Raises
    ------
    TypeError, ValueError
        A bad argument, named: hidden_size, a group_size not dividing it, eps, weight_offset,
        norm_before_gate, cast_policy, activation, device or dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        weight_offset: float = 0.0,
        cast_policy: str = ONE_ROUNDING,
        activation: str = SILU,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.hidden_size = v.check_count("hidden_size", hidden_size, 1)
        self.group_size = v.check_group_size(group_size, hidden_size)
        self.eps = v.check_eps(eps)
        v.check_bool("norm_before_gate", norm_before_gate)
        self.norm_before_gate = norm_before_gate
        self.weight_offset = v.check_weight_offset(weight_offset)
        self.cast_policy = check_gated_cast_policy("cast_policy", cast_policy)
        self.activation = v.check_gate_activation(activation)
        v.check_factory_arguments(device, dtype)
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def variance_epsilon(self) -> float:
        """eps under the Hugging Face classes' name, which the Mamba-2 mixers hand to a fused scan kernel."""
        return self.eps

    def reset_parameters(self) -> None:
        """weight = 1 - weight_offset: the scale starts at 1."""
        nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The gated norm of ``hidden_states`` ([..., H]) by ``gate`` (its shape), or the grouped norm alone
        when gate is None.

        Returns
        -------
        torch.Tensor
            Shaped like hidden_states; x's dtype, or the promotion of the weight's and x's dtypes for
            ``"round_then_scale"`` gate then norm.

        Raises
        ------
        TypeError, ValueError
            hidden_states or gate is not a tensor; the errors of ``cake_gated_rmsnorm`` (hidden_states
            named x, gate named z), a gate of another dtype than x's excepted.
        """
        v.check_tensor("hidden_states", hidden_states)
        if gate is not None:
            v.check_tensor("gate", gate)
        form = GatedForm(
            self.eps,
            self.group_size,
            self.norm_before_gate,
            self.weight_offset,
            self.cast_policy,
            self.activation,
        )
        return gated_rmsnorm_with_casts(hidden_states, gate, self.weight, form)

    def extra_repr(self) -> str:
        group = "" if self.group_size == self.hidden_size else f", group_size={self.group_size}"
        gate = "" if self.activation == SILU else f", activation={self.activation}"
        return (
            f"{self.hidden_size}, eps={self.eps}{group}, norm_before_gate={self.norm_before_gate}, "
            f"weight_offset={self.weight_offset}, cast_policy={self.cast_policy}{gate}"
        )
