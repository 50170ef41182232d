"""Megatron-Core integration: cake_cute norms built the way Megatron builds its own, and GPT layer specs
that hold them, so a Megatron-LM user switches with one line::

    --spec cake_cute.integrations.megatron gpt_layer_spec            # input and pre-MLP norms
    --spec cake_cute.integrations.megatron gpt_layer_spec_qk_norm    # the same, with --qk-layernorm

(``--spec`` imports a module attribute and hands it to ``GPTModel`` as it is: these are layer
``ModuleSpec`` objects, built when this module is imported.) A model provider written in Python calls
``get_gpt_decoder_block_spec(config)`` instead, which also makes the model's final norm a cake norm: a
layer spec cannot reach it, since ``TransformerBlock`` takes the final norm from a block spec only.

The norms honour the norm fields of ``TransformerConfig`` (``normalization``, ``layernorm_epsilon``,
``layernorm_zero_centered_gamma``, ``sequence_parallel``, ``fused_residual_rmsnorm``,
``persist_layer_norm``, ``params_dtype``, ``use_cpu_initialization``, ``init_model_with_meta_device``)
and refuse by name what they cannot honour (docs/integrations.md). Their state dict is the stock norm's
(one ``weight``), so Megatron checkpoints load in both directions.

This module imports without Megatron-Core; the norm classes (``megatron_norms``, re-exported here)
need only a config object, and the specs and the spec provider exist when ``megatron.core`` imports.
"""

from __future__ import annotations

import dataclasses
import functools

from .megatron_norms import (
    MegatronCakeInputRMSNorm,
    MegatronCakeQKRMSNorm,
    MegatronCakeResidualRMSNorm,
    MegatronCakeRMSNorm,
)

try:
    import megatron.core  # noqa: F401
except ModuleNotFoundError as error:
    if error.name not in ("megatron", "megatron.core"):
        raise
    HAS_MEGATRON = False
else:
    HAS_MEGATRON = True

__all__ = [
    "HAS_MEGATRON",
    "MegatronCakeInputRMSNorm",
    "MegatronCakeQKRMSNorm",
    "MegatronCakeRMSNorm",
    "MegatronCakeResidualRMSNorm",
]


if HAS_MEGATRON:
    from megatron.core.extensions import transformer_engine as _te
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs as _gpt_specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import L2Norm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    HAS_TE = bool(_te.HAVE_TE)

    # Megatron's local spec stores these norms under the names Transformer Engine's fused
    # norm-linear layers use, so checkpoints move between the local and TE specs; a spec that takes
    # a norm out of a fused TE layer keeps those names too.
    _FUSED_NORM_KEYS = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }

    class CakeSpecProvider(LocalSpecProvider):
        """Megatron's ``LocalSpecProvider`` with cake norms: for code that builds specs from a backend
        (``get_mlp_module_spec_for_backend``, ``get_gpt_mtp_block_spec_for_backend``, forks whose
        layer-spec functions take a backend).

        Methods as ``LocalSpecProvider``'s; ``layer_norm`` returns a cake norm builder.
        """

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
            """The cake norm builder for a norm slot.

            Parameters
            ----------
            rms_norm : bool
                Accepted as Megatron passes it; the config's ``normalization`` is what the norm checks.
            for_qk : bool
                A per-head q/k norm.
            has_residual : bool
                The norm's input is also the residual (input and pre-MLP norms).

            Returns
            -------
            type
                ``MegatronCakeQKRMSNorm``, ``MegatronCakeResidualRMSNorm`` or ``MegatronCakeRMSNorm``.
            """
            if for_qk:
                return MegatronCakeQKRMSNorm
            return MegatronCakeResidualRMSNorm if has_residual else MegatronCakeRMSNorm

    def _is_norm_builder(builder) -> bool:
        """Whether a spec slot holds a norm to replace (not an identity, an empty slot or the weightless
        L2Norm, which has no RMSNorm weight to carry)."""
        return builder is not None and builder is not IdentityOp and builder is not L2Norm

    def _unfused_linear(builder):
        """TE's norm-fused column-parallel linear becomes TE's plain one; anything else is kept."""
        if HAS_TE and builder is _te.TELayerNormColumnParallelLinear:
            return _te.TEColumnParallelLinear
        return None

    def _submodules(spec):
        """The submodules of a sublayer spec: a ``ModuleSpec``, or (Megatron 0.18+ MLPs) a
        ``functools.partial`` of the module class with ``submodules=``; None for anything else."""
        if isinstance(spec, functools.partial):
            return spec.keywords.get("submodules")
        return spec.submodules if isinstance(spec, ModuleSpec) else None

    def _with_submodules(spec, submodules):
        if isinstance(spec, functools.partial):
            return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
        return dataclasses.replace(spec, submodules=submodules)

    def _with_cake_sublayer(spec, linear_field: str, norm_slots: dict):
        """``spec`` (an attention or MLP spec) with its norm slots in ``norm_slots`` replaced by cake
        norms, and whether its ``linear_field`` linear had a norm fused in that now moved out."""
        subs = _submodules(spec)
        if subs is None:
            return spec, False
        changes = {
            name: builder
            for name, builder in norm_slots.items()
            if hasattr(subs, name) and _is_norm_builder(getattr(subs, name))
        }
        unfused = _unfused_linear(getattr(subs, linear_field, None))
        if unfused is not None:
            changes[linear_field] = unfused
        if not changes:
            return spec, False
        return _with_submodules(spec, dataclasses.replace(subs, **changes)), unfused is not None

    def _has_qk_norms(attention) -> bool:
        """Whether an attention spec has q/k norm slots holding a norm (L2Norm included), or is not an
        attention spec with such slots at all (then there is nothing to check)."""
        subs = _submodules(attention)
        slots = [
            getattr(subs, name)
            for name in ("q_layernorm", "k_layernorm", "kv_layernorm")
            if hasattr(subs, name)
        ]
        return not slots or any(slot not in (None, IdentityOp) for slot in slots)

    def with_cake_norms(spec):
        """A GPT layer spec (or a block spec) with its RMSNorms replaced by cake norms.

        The input and pre-MLP norms become ``MegatronCakeResidualRMSNorm`` (the input norm of a layer
        without q/k norms ``MegatronCakeInputRMSNorm``, which refuses ``config.qk_layernorm``), the
        per-head q/k norms ``MegatronCakeQKRMSNorm`` (``L2Norm`` stays), a block's final norm
        ``MegatronCakeRMSNorm``.
        Where Transformer Engine's ``TELayerNormColumnParallelLinear`` holds the input or pre-MLP
        norm, it becomes ``TEColumnParallelLinear`` after a cake norm (TE's other layers stay), and the
        norm keeps the checkpoint name the fused layer used.

        Parameters
        ----------
        spec : ModuleSpec or TransformerBlockSubmodules
            A ``TransformerLayer`` spec (``get_gpt_layer_local_spec``,
            ``get_gpt_layer_with_transformer_engine_spec``) or a block spec of them.

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
                layer_specs=[with_cake_norms(layer) for layer in spec.layer_specs],
                layer_norm=MegatronCakeRMSNorm,
            )
        subs = getattr(spec, "submodules", None)
        if not isinstance(spec, ModuleSpec) or not hasattr(subs, "input_layernorm"):
            raise TypeError(
                "spec must be a TransformerLayer ModuleSpec or TransformerBlockSubmodules, got "
                f"{type(spec).__name__}"
            )
        qk = MegatronCakeQKRMSNorm
        attention, qkv_unfused = _with_cake_sublayer(
            subs.self_attention, "linear_qkv", {"q_layernorm": qk, "k_layernorm": qk, "kv_layernorm": qk}
        )
        mlp, fc1_unfused = _with_cake_sublayer(subs.mlp, "linear_fc1", {})
        changes = {"self_attention": attention, "mlp": mlp}
        keys = dict(getattr(subs, "sharded_state_dict_keys_map", None) or {})
        input_norm = MegatronCakeResidualRMSNorm if _has_qk_norms(attention) else MegatronCakeInputRMSNorm
        for name, unfused, builder in (
            ("input_layernorm", qkv_unfused, input_norm),
            ("pre_mlp_layernorm", fc1_unfused, MegatronCakeResidualRMSNorm),
        ):
            if unfused or _is_norm_builder(getattr(subs, name)):
                changes[name] = builder
            if unfused:
                keys[f"{name}."] = _FUSED_NORM_KEYS[f"{name}."]
        if qkv_unfused or fc1_unfused:
            changes["sharded_state_dict_keys_map"] = keys
        return dataclasses.replace(spec, submodules=dataclasses.replace(subs, **changes))

    def _use_te(use_transformer_engine) -> bool:
        """Whether to start from Megatron's TE specs: as asked, by default where TE imports."""
        if use_transformer_engine is None:
            return HAS_TE
        if use_transformer_engine and not HAS_TE:
            raise ImportError("use_transformer_engine=True needs Transformer Engine, which does not import")
        return bool(use_transformer_engine)

    def get_gpt_layer_spec(
        num_experts=None,
        moe_grouped_gemm=False,
        qk_layernorm=False,
        multi_latent_attention=False,
        qk_l2_norm=False,
        use_transformer_engine=None,
        **kwargs,
    ):
        """A GPT ``TransformerLayer`` spec with cake norms: Megatron's TE spec (where Transformer Engine
        is installed) or local spec, through ``with_cake_norms``.

        Parameters
        ----------
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, qk_l2_norm
            As for ``get_gpt_layer_local_spec``; ``qk_layernorm`` must match the config's.
        use_transformer_engine : bool, optional
            Start from TE's spec (its linear layers and attention); default: whether TE imports.
        **kwargs
            Passed on to Megatron's spec function of this version.

        Returns
        -------
        ModuleSpec
            The layer spec.

        Raises
        ------
        ImportError
            ``use_transformer_engine=True`` without Transformer Engine.
        """
        use_te = _use_te(use_transformer_engine)
        build = (
            _gpt_specs.get_gpt_layer_with_transformer_engine_spec
            if use_te
            else _gpt_specs.get_gpt_layer_local_spec
        )
        stock = build(
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            qk_l2_norm=qk_l2_norm,
            **kwargs,
        )
        return with_cake_norms(stock)

    def get_gpt_decoder_block_spec(config, use_transformer_engine=None, qk_l2_norm=False, **kwargs):
        """A GPT block spec with cake norms, the final norm included: Megatron's
        ``get_gpt_decoder_block_spec`` (dense and MoE layers, this pipeline stage's share) through
        ``with_cake_norms``. Pass it to ``GPTModel(transformer_layer_spec=...)``.

        Parameters
        ----------
        config : TransformerConfig
            The model's config (its ``qk_layernorm``, MoE and pipeline fields shape the layers).
        use_transformer_engine : bool, optional
            Start from TE's layers; default: whether TE imports.
        qk_l2_norm : bool
            As for Megatron's function.
        **kwargs
            ``vp_stage``, ``pp_rank``: passed on.

        Returns
        -------
        TransformerBlockSubmodules
            This pipeline stage's layer specs, each through ``with_cake_norms``, and the final norm
            ``MegatronCakeRMSNorm``.

        Raises
        ------
        ImportError
            ``use_transformer_engine=True`` without Transformer Engine.
        """
        use_te = _use_te(use_transformer_engine)
        stock = _gpt_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", qk_l2_norm=qk_l2_norm, **kwargs
        )
        return with_cake_norms(stock)

    # What ``--spec cake_cute.integrations.megatron <name>`` imports: Megatron-LM passes the attribute
    # itself (not a call's result) as the layer spec, and attention (0.19) refuses q/k norm builders when
    # qk_layernorm is off, so the two settings are two objects.
    gpt_layer_spec = get_gpt_layer_spec()
    gpt_layer_spec_qk_norm = get_gpt_layer_spec(qk_layernorm=True)

    __all__ += [
        "CakeSpecProvider",
        "HAS_TE",
        "get_gpt_decoder_block_spec",
        "get_gpt_layer_spec",
        "gpt_layer_spec",
        "gpt_layer_spec_qk_norm",
        "with_cake_norms",
    ]
