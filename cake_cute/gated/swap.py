"""``swap_gated_rmsnorm``: ``CakeGatedRMSNorm`` in place of the gated RMSNorm modules of a Hugging Face
model (Qwen3-Next's ``Qwen3NextRMSNormGated`` and its copies, Mamba-2's ``Mamba2RMSNormGated``, named
``MambaRMSNormGated`` before transformers 5.25, NemotronH, Bamba, FalconH1, GraniteMoeHybrid, Zamba2, ...).

A module is a gated norm when its class name ends in "NormGated", it learns one 1-D ``weight`` and
nothing else, holds a float ``variance_epsilon`` (or ``eps``), and its forward takes a ``gate`` and
computes a reciprocal root of the mean of squares. Its forward's source says the rest:

* the gate's activation: ``silu(`` in the source, or ``ACT2FN[self.activation]`` with the module's
  ``activation`` "silu" / "swish"; anything else is refused (the kernels gate with SiLU only);
* the order: the module's ``norm_before_gate`` where it has one (FalconH1), else whether the gate is
  applied before the reciprocal root;
* the groups: ``group_size``, or H / ``n_groups`` (FalconH1), else H; a size not dividing H is refused;
* the casts: ``self.weight * hidden_states.to(input_dtype)`` is ``"round_then_scale"``; a weight taken
  to FP32 (``self.weight.to(torch.float32) *``, or a view of it times the FP32 values) with one final
  ``.to(input_dtype)`` is ``"one_rounding"``; other casts are refused.

A refused module is an error (``GatedNormNotServed``) naming it and the reason: a swap never runs a
module differently from what its class computes.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .. import validation as v
from ..hf.norm_reading import averages_squares, forward_source, hf_eps, hf_weight
from .module import GATED_CAST_POLICIES, ONE_ROUNDING, ROUND_THEN_SCALE, CakeGatedRMSNorm

__all__ = ["GatedNormNotServed", "swap_gated_rmsnorm"]

_SILU_NAMES = ("silu", "swish")
_SILU_CALL = re.compile(r"\bsilu\(")
_ACT2FN_GATE = re.compile(r"ACT2FN\[self\.activation\]\(gate")
_ROUND_THEN_SCALE = re.compile(r"self\.weight \* hidden_states\.to\(input_dtype\)")
_FP32_SCALE = re.compile(r"self\.weight\.(to\(torch\.float32\)|float\(\)|view\([^)]*\)\)?) \* hidden_states")
_ONE_FINAL_ROUNDING = re.compile(r"return hidden_states\.to\(input_dtype\)$")


class GatedNormNotServed(ValueError):
    """A gated norm module ``swap_gated_rmsnorm`` cannot replace without changing what it computes."""


def is_gated_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face-style gated RMSNorm (the module docstring's shape test)."""
    if isinstance(module, CakeGatedRMSNorm) or not type(module).__name__.endswith("NormGated"):
        return False
    if hf_eps(module) is None or hf_weight(module) is None or next(module.children(), None) is not None:
        return False
    source = forward_source(type(module))
    if source is None or "gate" not in source or "rsqrt" not in source:
        return False
    return averages_squares(source)


def _gate_refusal(module: nn.Module, source: str) -> str | None:
    if _ACT2FN_GATE.search(source):
        activation = getattr(module, "activation", None)
        return None if activation in _SILU_NAMES else f"its gate activation is {activation!r}, not SiLU"
    return None if _SILU_CALL.search(source) else "its forward shows no SiLU gate"


def _norm_before_gate(module: nn.Module, source: str) -> bool:
    own = getattr(module, "norm_before_gate", None)
    if isinstance(own, bool):
        return own
    gate_at = min(m.start() for m in (_SILU_CALL.search(source), _ACT2FN_GATE.search(source)) if m)
    return gate_at > source.index("rsqrt")


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


def _replacement(module: nn.Module, cast_policy: str | None) -> CakeGatedRMSNorm:
    """The CakeGatedRMSNorm following ``module`` (holding its weight Parameter); GatedNormNotServed
    with the reason when that is not possible."""
    source = forward_source(type(module))
    refusal = _gate_refusal(module, source)
    if refusal is not None:
        raise GatedNormNotServed(refusal)
    weight = module.weight
    new = CakeGatedRMSNorm(
        weight.shape[0],
        eps=hf_eps(module),
        group_size=_group_size(module, weight.shape[0]),
        norm_before_gate=_norm_before_gate(module, source),
        cast_policy=_cast_policy(source) if cast_policy is None else cast_policy,
        device="meta",
    )
    new.weight = weight
    return new.train(module.training)


def swap_gated_rmsnorm(model: nn.Module, *, cast_policy: str | None = None) -> int:
    """Replace, in place, every Hugging Face gated RMSNorm of ``model`` with a ``CakeGatedRMSNorm``
    keeping its weight Parameter, eps, group size, gate order, casts and training mode.

    Swap before parallelizing (``parallelize_module``, ``fully_shard``): those replace parameters and
    hook the modules they see. A module used in several places is replaced by one module everywhere.

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place.
    cast_policy : str, optional
        None (default): each class's own roundings (module docstring). ``"one_rounding"``: the fused
        kernel's single rounding for every norm (faster for the norm-then-gate classes, whose own casts
        round twice; docs/gated.md states the difference); ``"round_then_scale"``;
        ``"scale_then_round"`` (``gated.module``).

    Returns
    -------
    int
        How many gated norms were replaced (a module used in several places counts once).

    Raises
    ------
    GatedNormNotServed (a ValueError)
        A gated norm whose gate is not SiLU, whose group size does not divide its hidden size, or whose
        casts are not recognized; the message names the module, its class and the reason. Nothing is
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
