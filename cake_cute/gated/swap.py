"""``swap_gated_rmsnorm``: ``CakeGatedRMSNorm`` in place of the gated RMSNorm modules of a Hugging Face
model (docs/gated.md lists the classes).

A module is a gated norm when its class name ends in "NormGated", it learns a 1-D ``weight`` and
nothing else, holds a float ``variance_epsilon`` (or ``eps``) and no submodule, and its forward takes a
``gate`` and computes a reciprocal root of the mean of squares. Its forward's source says the rest:

* the gate: ``hidden_states * act(gate)``, act ``silu`` or ``sigmoid`` (by name or through
  ``ACT2FN[self.activation]``); a gate used any other way is refused;
* the order: the gate before the reciprocal root or after the weight's product, or the module's
  ``norm_before_gate``; a gate between the norm and its weight is refused;
* the groups: ``group_size``, or H / ``n_groups``, else H; a size not dividing H is refused;
* the casts: ``self.weight * hidden_states.to(input_dtype)`` is ``"round_then_scale"``; an FP32
  weight product with one final ``.to(input_dtype)`` is ``"one_rounding"``; others are refused.

A refused module raises ``GatedNormNotServed`` naming it and the reason: a swap never computes
differently from the class it replaces.
"""

from __future__ import annotations

import functools
import re
import types

import torch
from torch import nn

from .. import validation as v
from ..hf.norm_reading import NormNotServed, averages_squares, forward_source, hf_eps, hf_weight
from ..vocab import SIGMOID, SILU
from .module import GATED_CAST_POLICIES, ONE_ROUNDING, ROUND_THEN_SCALE, CakeGatedRMSNorm, GatedForm

__all__ = ["GatedNormNotServed", "swap_gated_rmsnorm"]

# The names of ACT2FN[self.activation] the kernels' gate activations go by (ACT2FN's "swish" is SiLU).
_ACTIVATION_NAMES = {"silu": SILU, "swish": SILU, "sigmoid": SIGMOID}
# The gate's one accepted use: a factor of hidden_states, its activation named or the module's.
_GATE_FACTOR = re.compile(
    r"hidden_states \* (?:ACT2FN\[self\.activation\]|(?:(?:torch\.)?nn\.functional\.|F\.|torch\.)?"
    r"(?P<name>silu|sigmoid))\(gate(?:\.to\(torch\.float32\)|\.float\(\))?\)"
)
# What else may name the gate: the forward's signature and tests of whether a gate was given.
_FORWARD_SIGNATURE = re.compile(r"def forward\((?:[^()]|\([^()]*\))*\)[^:]*:")
_GATE_GIVEN = re.compile(r"\bgate is (?:not )?None\b")
_GATE = re.compile(r"\bgate\b")
_ROUND_THEN_SCALE = re.compile(r"self\.weight \* hidden_states\.to\(input_dtype\)")
_FP32_SCALE = re.compile(r"self\.weight\.(to\(torch\.float32\)|float\(\)|view\([^)]*\)\)?) \* hidden_states")
_ONE_FINAL_ROUNDING = re.compile(r"return hidden_states\.to\(input_dtype\)$")


class GatedNormNotServed(NormNotServed):
    """A gated norm module ``swap_gated_rmsnorm`` cannot replace without changing what it computes."""


def is_gated_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face-style gated RMSNorm (the module docstring's shape test)."""
    if isinstance(module, CakeGatedRMSNorm) or not type(module).__name__.endswith("NormGated"):
        return False
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    if hf_eps(module) is None or next(module.children(), None) is not None:
        return False
    return _has_gated_source(type(module))


@torch.compiler.assume_constant_result
def _has_gated_source(cls: type) -> bool:
    """Whether ``cls``'s forward takes a gate and a reciprocal root of the mean of squares; a constant to
    torch.compile."""
    return _gated_source(cls)


@functools.cache
def _gated_source(cls: type) -> bool:
    source = forward_source(cls)
    if source is None or "gate" not in source or "rsqrt" not in source:
        return False
    return averages_squares(source)


def _gate_factors(source: str) -> list[re.Match]:
    """The forward's ``hidden_states * act(gate)`` factors; GatedNormNotServed for another use of the gate."""
    factors = list(_GATE_FACTOR.finditer(source))
    rest = _GATE_GIVEN.sub("", _GATE_FACTOR.sub("", _FORWARD_SIGNATURE.sub("", source, count=1)))
    if not factors or _GATE.search(rest):
        raise GatedNormNotServed("its forward does not gate as hidden_states * silu(gate) or sigmoid(gate)")
    return factors


def _gate_activation(module: nn.Module, factors: list[re.Match]) -> str:
    """The gate's activation; GatedNormNotServed for one the kernels do not have."""
    found = set()
    for factor in factors:
        name = factor["name"] or getattr(module, "activation", None)
        if name not in _ACTIVATION_NAMES:
            raise GatedNormNotServed(f"its gate activation is {name!r}, neither SiLU nor sigmoid")
        found.add(_ACTIVATION_NAMES[name])
    if len(found) > 1:
        raise GatedNormNotServed("its forward gates with both SiLU and sigmoid")
    return found.pop()


def _norm_before_gate(module: nn.Module, source: str, factors: list[re.Match]) -> bool:
    """Whether the gate comes after the norm and its weight; GatedNormNotServed where unreadable."""
    norm_at, weight_at = source.index("rsqrt"), source.rfind("self.weight")
    if weight_at < norm_at:
        raise GatedNormNotServed("its forward does not scale the normalized values by self.weight")
    if any(norm_at < factor.start() < weight_at for factor in factors):
        raise GatedNormNotServed("its gate comes between the norm and the weight")
    own = getattr(module, "norm_before_gate", None)
    if isinstance(own, bool):
        return own
    after = {factor.start() > weight_at for factor in factors}
    if len(after) > 1:
        raise GatedNormNotServed("its gate comes both before and after the norm")
    return after.pop()


def _group_size(module: nn.Module, hidden: int) -> int:
    """The statistics group of ``module``; GatedNormNotServed when it does not divide H."""
    size = getattr(module, "group_size", None)
    groups = getattr(module, "n_groups", None)
    if size is None and isinstance(groups, int) and groups >= 1:
        if hidden % groups:
            raise GatedNormNotServed(f"its n_groups {groups} does not divide the hidden size {hidden}")
        size = hidden // groups
    size = hidden if size is None else size
    if not isinstance(size, int) or size < 1 or hidden % size:
        raise GatedNormNotServed(f"its group_size {size!r} does not divide the hidden size {hidden}")
    return size


def _cast_policy(source: str) -> str:
    if _ROUND_THEN_SCALE.search(source):
        return ROUND_THEN_SCALE
    if _FP32_SCALE.search(source) and _ONE_FINAL_ROUNDING.search(source):
        return ONE_ROUNDING
    raise GatedNormNotServed("its casts are neither a rounding before the weight nor one final rounding")


# The attributes of a gated norm module its reading consults besides its weight and eps.
_READ_ATTRIBUTES = ("activation", "norm_before_gate", "group_size", "n_groups")


def hf_gated_form(module: nn.Module, cast_policy: str | None = None) -> GatedForm:
    """What a Hugging Face gated norm computes besides its tensors, for a ``CakeGatedRMSNorm`` in its place
    or a kernel-route layer computing in place of its class; ``cast_policy`` overrides the class's casts.
    Raises ``GatedNormNotServed`` (the reason; the caller names the module) for a module that is no gated
    norm or one refused."""
    if not is_gated_norm(module):
        raise GatedNormNotServed(
            "it is not shaped as a Hugging Face gated RMSNorm (a class named ...NormGated holding a float "
            "variance_epsilon or eps and a 1-D weight, whose forward takes a gate and a reciprocal root of "
            "the mean of squares)"
        )
    attributes = tuple(getattr(module, name, None) for name in _READ_ATTRIBUTES)
    weight_only = hf_weight(module) is not None
    hidden = module.weight.shape[0]
    return _class_form(type(module), attributes, weight_only, hidden, hf_eps(module), cast_policy)


@torch.compiler.assume_constant_result
def _class_form(cls: type, attributes: tuple, weight_only: bool, hidden: int, eps: float, cast_policy):
    """``hf_gated_form`` of a module of class ``cls``, a constant to torch.compile."""
    return _read_form(cls, attributes, weight_only, hidden, eps, cast_policy)


@functools.cache
def _read_form(cls: type, attributes: tuple, weight_only: bool, hidden: int, eps: float, cast_policy):
    if not weight_only:
        raise GatedNormNotServed("it learns parameters besides its weight")
    module = types.SimpleNamespace(**dict(zip(_READ_ATTRIBUTES, attributes)))  # what the readers consult
    source = forward_source(cls)
    factors = _gate_factors(source)
    activation = _gate_activation(module, factors)
    group_size = _group_size(module, hidden)
    norm_before_gate = _norm_before_gate(module, source, factors)
    policy = _cast_policy(source) if cast_policy is None else cast_policy
    return GatedForm(eps, group_size, norm_before_gate, 0.0, policy, activation)


def _replacement(module: nn.Module, cast_policy: str | None) -> CakeGatedRMSNorm:
    """The CakeGatedRMSNorm following ``module``, holding its weight Parameter."""
    form = hf_gated_form(module, cast_policy)
    weight = module.weight
    new = CakeGatedRMSNorm(
        weight.shape[0],
        eps=form.eps,
        group_size=form.group_size,
        norm_before_gate=form.norm_before_gate,
        cast_policy=form.cast_policy,
        activation=form.activation,
        device="meta",
    )
    new.weight = weight
    return new.train(module.training)


def swap_gated_rmsnorm(model: nn.Module, *, cast_policy: str | None = None) -> int:
    """Replace, in place, every Hugging Face gated RMSNorm of ``model`` with a ``CakeGatedRMSNorm``
    keeping its weight Parameter, eps, group size, gate activation and order, casts and training mode.
    Swap before parallelizing; a module used in several places is replaced by one module everywhere.

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place.
    cast_policy : str, optional
        None (default): each class's own roundings; or ``"one_rounding"`` (the fused kernel's single
        rounding for every norm; docs/gated.md states the difference), ``"round_then_scale"``,
        ``"scale_then_round"``.

    Returns
    -------
    int
        How many gated norms were replaced.

    Raises
    ------
    GatedNormNotServed (a ValueError)
        A gated norm the module's reading refuses, named with its class and the reason; nothing is
        replaced then.
    TypeError
        model is not a torch.nn.Module.
    ValueError
        An unknown cast_policy; a gated norm's weight is already a DTensor.
    """
    v.check_module("model", model)
    if cast_policy is not None and cast_policy not in GATED_CAST_POLICIES:
        raise ValueError(f"cast_policy must be None or one of {', '.join(map(repr, GATED_CAST_POLICIES))}")
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent._modules.items()
        if child is not None and is_gated_norm(child)
    ]
    replaced: dict[nn.Module, CakeGatedRMSNorm] = {}
    for parent, name, child in found:  # every replacement is decided before any is made
        if child not in replaced:
            replaced[child] = _checked_replacement(f"{type(parent).__name__}.{name}", child, cast_policy)
    for parent, name, child in found:
        setattr(parent, name, replaced[child])
    return len(replaced)


def _checked_replacement(where: str, module: nn.Module, cast_policy) -> CakeGatedRMSNorm:
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(module.weight, DTensor):
            raise ValueError(
                f"{where} ({type(module).__name__}) has a DTensor weight: swap_gated_rmsnorm must run before "
                "parallelize_module / fully_shard"
            )
    try:
        return _replacement(module, cast_policy)
    except GatedNormNotServed as refused:
        raise GatedNormNotServed(f"{where} ({type(module).__name__}) is not swapped: {refused}") from None
