"""Megatron-Core's hybrid models (``pretrain_hybrid.py``, 0.19+; ``pretrain_mamba.py`` before) with cake
norms: the stack spec through ``with_cake_stack_norms`` and a stack class whose final norm is a cake
norm. Imported where Megatron's hybrid modules import (they need triton).
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.mamba import mamba_layer_specs as _stack_specs
from megatron.core.ssm.mamba_block import MambaStack as _HybridStack
from megatron.core.ssm.mamba_block import MambaStackSubmodules as _HybridStackSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from .megatron_norms import MegatronCakeQKRMSNorm, MegatronCakeRMSNorm
from .megatron_specs import (
    fused_norm_key,
    is_norm_builder,
    with_cake_mtp_norms,
    with_cake_norms,
    with_cake_sublayer,
)

__all__ = [
    "CakeHybridStack",
    "hybrid_stack_spec",
    "hybrid_stack_spec_qk_norm",
    "mamba_stack_spec",
    "with_cake_stack_norms",
]


def _with_cake_mamba_layer(spec):
    """A ``MambaLayer`` spec whose TE-fused input norm is a ``MegatronCakeRMSNorm``."""
    subs = spec.submodules
    mixer, unfused = with_cake_sublayer(subs.mixer, ("in_proj",), {})
    if unfused is None and not is_norm_builder(subs.norm):
        return spec
    changes = {"norm": MegatronCakeRMSNorm, "mixer": mixer}
    if unfused is not None:
        keys = {**subs.sharded_state_dict_keys_map, "norm.": fused_norm_key("mixer", unfused)}
        changes["sharded_state_dict_keys_map"] = keys
    return dataclasses.replace(spec, submodules=dataclasses.replace(subs, **changes))


def _with_cake_stack_layer(name: str, layer, fused_output_gate: bool):
    """One layer spec of a hybrid stack spec, with cake norms."""
    if layer is None or layer is IdentityOp:
        return layer
    if name == "mtp_block_spec":
        return with_cake_mtp_norms(layer)
    if hasattr(layer.submodules, "mixer"):
        return _with_cake_mamba_layer(layer)
    return with_cake_norms(layer, fused_output_gate=fused_output_gate)


def _with_qk_norm_slots(layer):
    """A stack's attention layer spec with cake q/k norms in its (empty) q/k norm slots."""
    attention = layer.submodules.self_attention
    qk = dataclasses.replace(
        attention.submodules, q_layernorm=MegatronCakeQKRMSNorm, k_layernorm=MegatronCakeQKRMSNorm
    )
    attention = dataclasses.replace(attention, submodules=qk)
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)
    )


def with_cake_stack_norms(spec, qk_layernorm=False, *, fused_output_gate=False):
    """A hybrid stack spec with cake norms: each layer's as ``with_cake_norms`` replaces them, the Mamba
    layers' input norm, the multi-token prediction norms, and the stack's final norm.

    Parameters
    ----------
    spec : ModuleSpec
        A ``HybridStack`` (``MambaStack``) spec.
    qk_layernorm : bool
        Put cake q/k norms in the attention layers' empty q/k norm slots; must match the config's.
    fused_output_gate : bool
        Opt-in: the Gated DeltaNet layers' output norm and SiLU gate as one gated kernel.

    Returns
    -------
    ModuleSpec
        A new spec; ``spec`` is not changed.

    Raises
    ------
    TypeError
        ``spec`` is not a ``HybridStack`` spec.
    """
    if not (isinstance(spec, ModuleSpec) and isinstance(spec.submodules, _HybridStackSubmodules)):
        raise TypeError(f"spec must be a HybridStack ModuleSpec, got {type(spec).__name__}")
    subs = spec.submodules
    if qk_layernorm and subs.attention_layer is not IdentityOp:
        subs = dataclasses.replace(subs, attention_layer=_with_qk_norm_slots(subs.attention_layer))
    layers = {
        field.name: _with_cake_stack_layer(field.name, getattr(subs, field.name), fused_output_gate)
        for field in dataclasses.fields(subs)
    }
    return dataclasses.replace(spec, module=CakeHybridStack, submodules=dataclasses.replace(subs, **layers))


class CakeHybridStack(_HybridStack):
    """Megatron's hybrid stack whose own final norm (``final_norm``) is a cake norm."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if hasattr(self, "final_norm"):
            self.final_norm = MegatronCakeRMSNorm(
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )


# What ``--spec cake_cute.integrations.megatron hybrid_stack_spec`` imports. Two objects, as for the GPT
# layer specs: attention refuses q/k norm builders when qk_layernorm is off, and the layer without them
# refuses qk_layernorm.
hybrid_stack_spec = with_cake_stack_norms(_stack_specs.mamba_stack_spec)
hybrid_stack_spec_qk_norm = with_cake_stack_norms(_stack_specs.mamba_stack_spec, qk_layernorm=True)
mamba_stack_spec = hybrid_stack_spec
