"""How a Megatron-Core spec gets cake norms: norm slots replaced by the ``megatron_norms`` classes, and
Transformer Engine's norm-fused linear layers unfused into a cake norm and TE's plain linear, the norm
keeping the fused layer's checkpoint name.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.extensions import transformer_engine as _te
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .megatron_norms import (
    MegatronCakeInputRMSNorm,
    MegatronCakeQKRMSNorm,
    MegatronCakeResidualRMSNorm,
    MegatronCakeRMSNorm,
    with_fused_output_gate,
)

HAS_TE = bool(_te.HAVE_TE)

# The linear layer of each sublayer into which Megatron's TE specs fuse the norm before it:
# attention's linear_qkv (Gated DeltaNet's in_proj), the MLP's linear_fc1.
_ATTENTION_LINEARS = ("linear_qkv", "in_proj")
_MLP_LINEARS = ("linear_fc1",)


def is_norm_builder(builder) -> bool:
    """Whether a spec slot holds a norm to replace (not an identity, empty or L2Norm)."""
    return builder is not None and builder is not IdentityOp and builder is not L2Norm


def _unfused_linear(builder):
    """TE's norm-fused column-parallel linear becomes TE's plain one; anything else is kept."""
    if HAS_TE and builder is _te.TELayerNormColumnParallelLinear:
        return _te.TEColumnParallelLinear
    return None


def fused_norm_key(sublayer: str, linear_field: str) -> str:
    """The checkpoint name a TE norm-fused linear gives the norm's weight, which a norm taken out of it
    keeps."""
    return f"{sublayer}.{linear_field}.layer_norm_"


def _submodules(spec):
    """The submodules of a ``ModuleSpec`` or of a ``partial(..., submodules=)``; else None."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return spec.submodules if isinstance(spec, ModuleSpec) else None


def _with_submodules(spec, submodules):
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)


def with_cake_sublayer(spec, linear_fields: tuple, norm_slots: dict):
    """``spec`` with cake norms in ``norm_slots``, and the name of the linear whose fused norm moved out
    (or None)."""
    subs = _submodules(spec)
    if subs is None:
        return spec, None
    changes = {
        name: builder
        for name, builder in norm_slots.items()
        if hasattr(subs, name) and is_norm_builder(getattr(subs, name))
    }
    unfused_field = None
    for field in linear_fields:
        unfused = _unfused_linear(getattr(subs, field, None))
        if unfused is not None:
            changes[field], unfused_field = unfused, field
    if not changes:
        return spec, None
    return _with_submodules(spec, dataclasses.replace(subs, **changes)), unfused_field


def _has_qk_norms(attention) -> bool:
    """Whether a ``SelfAttention`` spec holds a q/k norm (True for other specs)."""
    subs = _submodules(attention)
    if not hasattr(subs, "k_layernorm"):
        return True
    return any(getattr(subs, name) not in (None, IdentityOp) for name in ("q_layernorm", "k_layernorm"))


def _with_fused_output_gate(attention):
    """A Gated DeltaNet spec with its output norm and gate fused; any other attention spec as it is."""
    module = getattr(attention, "module", None)
    if (
        isinstance(attention, ModuleSpec)
        and isinstance(module, type)
        and hasattr(module, "_apply_gated_norm")
    ):
        return dataclasses.replace(attention, module=with_fused_output_gate(module))
    return attention


def with_cake_norms(spec, *, fused_output_gate=False):
    """A GPT layer spec (or a block spec) with its RMSNorms replaced by cake norms.

    The input and pre-MLP norms become ``MegatronCakeResidualRMSNorm`` (``MegatronCakeInputRMSNorm`` in
    a layer without q/k norms), q/k norms ``MegatronCakeQKRMSNorm`` (``L2Norm`` stays), Gated DeltaNet's
    ``out_norm`` and the final norm ``MegatronCakeRMSNorm``. A ``TELayerNormColumnParallelLinear`` holding
    a norm becomes ``TEColumnParallelLinear`` after a cake norm under the fused layer's checkpoint name.

    Parameters
    ----------
    spec : ModuleSpec or TransformerBlockSubmodules
        A ``TransformerLayer`` spec or a block spec of them.
    fused_output_gate : bool
        Opt-in: Gated DeltaNet layers run their output norm and SiLU gate as one gated kernel.

    Returns
    -------
    ModuleSpec or TransformerBlockSubmodules
        A new spec; ``spec`` is not changed.

    Raises
    ------
    TypeError
        ``spec`` is neither a ``ModuleSpec`` with layer submodules nor ``TransformerBlockSubmodules``.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(
            spec,
            layer_specs=[
                with_cake_norms(layer, fused_output_gate=fused_output_gate) for layer in spec.layer_specs
            ],
            layer_norm=MegatronCakeRMSNorm,
        )
    subs = getattr(spec, "submodules", None)
    if not isinstance(spec, ModuleSpec) or not hasattr(subs, "input_layernorm"):
        raise TypeError(
            "spec must be a TransformerLayer ModuleSpec or TransformerBlockSubmodules, got "
            f"{type(spec).__name__}"
        )
    qk = MegatronCakeQKRMSNorm
    attention_norms = {
        "q_layernorm": qk,
        "k_layernorm": qk,
        "kv_layernorm": qk,
        "out_norm": MegatronCakeRMSNorm,
    }
    attention, attention_unfused = with_cake_sublayer(
        subs.self_attention, _ATTENTION_LINEARS, attention_norms
    )
    if fused_output_gate:
        attention = _with_fused_output_gate(attention)
    mlp, mlp_unfused = with_cake_sublayer(subs.mlp, _MLP_LINEARS, {})
    changes = {"self_attention": attention, "mlp": mlp}
    keys = dict(getattr(subs, "sharded_state_dict_keys_map", None) or {})
    input_norm = MegatronCakeResidualRMSNorm if _has_qk_norms(attention) else MegatronCakeInputRMSNorm
    for name, sublayer, unfused, builder in (
        ("input_layernorm", "self_attention", attention_unfused, input_norm),
        ("pre_mlp_layernorm", "mlp", mlp_unfused, MegatronCakeResidualRMSNorm),
    ):
        if unfused or is_norm_builder(getattr(subs, name)):
            changes[name] = builder
        if unfused:
            keys[f"{name}."] = fused_norm_key(sublayer, unfused)
    if attention_unfused or mlp_unfused:
        changes["sharded_state_dict_keys_map"] = keys
    return dataclasses.replace(spec, submodules=dataclasses.replace(subs, **changes))


def with_cake_mtp_norms(spec):
    """A multi-token prediction block spec with its layers' norms cake norms."""
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=with_cake_mtp_norms(spec.submodules))
    norms = ("enorm", "hnorm", "layer_norm")
    layers = []
    for layer in spec.layer_specs:
        changes = {
            name: MegatronCakeRMSNorm for name in norms if is_norm_builder(getattr(layer.submodules, name))
        }
        layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, **changes)))
    return dataclasses.replace(spec, layer_specs=layers)
