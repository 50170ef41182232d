"""Megatron-Core integration: cake_cute norms built the way Megatron builds its own, and GPT layer specs
that hold them, so a Megatron-LM user switches with one line::

    --spec cake_cute.integrations.megatron gpt_layer_spec            # input and pre-MLP norms
    --spec cake_cute.integrations.megatron gpt_layer_spec_qk_norm    # the same, with --qk-layernorm

(``--spec`` imports a module attribute and hands it to ``GPTModel`` as it is: these are layer
``ModuleSpec`` objects, built when this module is imported.) A model provider written in Python calls
``get_gpt_decoder_block_spec(config)`` instead, which also makes the model's final norm a cake norm (a
layer spec cannot reach it, since ``TransformerBlock`` takes the final norm from a block spec only) and
serves configs with Gated DeltaNet layers. Hybrid models (``pretrain_hybrid.py``) take a stack spec::

    --spec cake_cute.integrations.megatron hybrid_stack_spec

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
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as _variant_specs
    from megatron.core.models.gpt import gpt_layer_specs as _gpt_specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import L2Norm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    HAS_TE = bool(_te.HAVE_TE)

    # The linear layer of each sublayer into which Megatron's TE specs fuse the norm before it:
    # attention's linear_qkv (Gated DeltaNet's in_proj), the MLP's linear_fc1.
    _ATTENTION_LINEARS = ("linear_qkv", "in_proj")
    _MLP_LINEARS = ("linear_fc1",)

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

    def _fused_norm_key(sublayer: str, linear_field: str) -> str:
        """The checkpoint name a TE norm-fused linear gives the norm's weight (Megatron's local spec maps
        its norms to the same names): a norm taken out of it keeps that name, so checkpoints move
        between the specs."""
        return f"{sublayer}.{linear_field}.layer_norm_"

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

    def _with_cake_sublayer(spec, linear_fields: tuple, norm_slots: dict):
        """``spec`` (an attention or MLP spec) with its norm slots in ``norm_slots`` replaced by cake
        norms, and the name of its linear among ``linear_fields`` that had a norm fused in that now
        moved out (None if none did)."""
        subs = _submodules(spec)
        if subs is None:
            return spec, None
        changes = {
            name: builder
            for name, builder in norm_slots.items()
            if hasattr(subs, name) and _is_norm_builder(getattr(subs, name))
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
        """Whether an attention spec with per-head q/k norm slots (``SelfAttention``'s ``q_layernorm`` /
        ``k_layernorm``) holds a norm in one of them (L2Norm included); True for any other spec, where
        there is nothing to check (multi-latent attention's q / kv norms may be fused into its
        up-projections, leaving its slots empty under ``qk_layernorm``)."""
        subs = _submodules(attention)
        if not hasattr(subs, "k_layernorm"):
            return True
        return any(getattr(subs, name) not in (None, IdentityOp) for name in ("q_layernorm", "k_layernorm"))

    def with_cake_norms(spec):
        """A GPT layer spec (or a block spec) with its RMSNorms replaced by cake norms.

        The input and pre-MLP norms become ``MegatronCakeResidualRMSNorm`` (the input norm of a layer
        without q/k norms ``MegatronCakeInputRMSNorm``, which refuses ``config.qk_layernorm``), the
        per-head q/k norms ``MegatronCakeQKRMSNorm`` (``L2Norm`` stays), Gated DeltaNet's per-head
        ``out_norm`` ``MegatronCakeRMSNorm`` (the layer gates its output itself, after the norm's
        rounding), a block's final norm ``MegatronCakeRMSNorm``.
        Where Transformer Engine's ``TELayerNormColumnParallelLinear`` holds the input or pre-MLP
        norm (attention's ``linear_qkv``, Gated DeltaNet's ``in_proj``, the MLP's ``linear_fc1``), it
        becomes ``TEColumnParallelLinear`` after a cake norm (TE's other layers stay), and the norm
        keeps the checkpoint name the fused layer used.

        Parameters
        ----------
        spec : ModuleSpec or TransformerBlockSubmodules
            A ``TransformerLayer`` spec (``get_gpt_layer_local_spec``,
            ``get_gpt_layer_with_transformer_engine_spec``) or a block spec of them
            (``get_transformer_block_with_experimental_attention_variant_spec`` included).

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
        attention_norms = {
            "q_layernorm": qk,
            "k_layernorm": qk,
            "kv_layernorm": qk,
            "out_norm": MegatronCakeRMSNorm,
        }
        attention, attention_unfused = _with_cake_sublayer(
            subs.self_attention, _ATTENTION_LINEARS, attention_norms
        )
        mlp, mlp_unfused = _with_cake_sublayer(subs.mlp, _MLP_LINEARS, {})
        changes = {"self_attention": attention, "mlp": mlp}
        keys = dict(getattr(subs, "sharded_state_dict_keys_map", None) or {})
        input_norm = MegatronCakeResidualRMSNorm if _has_qk_norms(attention) else MegatronCakeInputRMSNorm
        for name, sublayer, unfused, builder in (
            ("input_layernorm", "self_attention", attention_unfused, input_norm),
            ("pre_mlp_layernorm", "mlp", mlp_unfused, MegatronCakeResidualRMSNorm),
        ):
            if unfused or _is_norm_builder(getattr(subs, name)):
                changes[name] = builder
            if unfused:
                keys[f"{name}."] = _fused_norm_key(sublayer, unfused)
        if attention_unfused or mlp_unfused:
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

    def _variant_block_spec(config, use_transformer_engine, **kwargs):
        """Megatron's block spec for a config with an experimental attention variant (Gated DeltaNet
        layers: Qwen3-Next), the spec Megatron-LM's GPT builder takes for such a config; TE only."""
        if not HAS_TE:
            raise ImportError(
                f"config.experimental_attention_variant={config.experimental_attention_variant!r} is built "
                "from Megatron's Transformer Engine specs, and Transformer Engine does not import"
            )
        if use_transformer_engine is False or config.transformer_impl != "transformer_engine":
            raise ValueError(
                f"config.experimental_attention_variant={config.experimental_attention_variant!r} is built "
                "from Megatron's Transformer Engine specs only: set config.transformer_impl to "
                f"'transformer_engine' (got {config.transformer_impl!r}) and leave use_transformer_engine "
                f"unset (got {use_transformer_engine!r})"
            )
        return _variant_specs.get_transformer_block_with_experimental_attention_variant_spec(config, **kwargs)

    def get_gpt_decoder_block_spec(config, use_transformer_engine=None, qk_l2_norm=False, **kwargs):
        """A GPT block spec with cake norms, the final norm included: the block spec Megatron-LM's GPT
        builder takes for ``config`` (Megatron's ``get_gpt_decoder_block_spec``: dense and MoE layers;
        with ``config.experimental_attention_variant``, its
        ``get_transformer_block_with_experimental_attention_variant_spec``: Gated DeltaNet and
        attention layers; this pipeline stage's share) through ``with_cake_norms``. Pass it to
        ``GPTModel(transformer_layer_spec=...)``.

        Parameters
        ----------
        config : TransformerConfig
            The model's config (its ``qk_layernorm``, attention variant, MoE and pipeline fields shape
            the layers).
        use_transformer_engine : bool, optional
            Start from TE's layers; default: whether TE imports (always, for an attention variant).
        qk_l2_norm : bool
            As for Megatron's function (an attention variant's block reads ``config.qk_l2_norm``).
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
            ``use_transformer_engine=True``, or an attention variant, without Transformer Engine.
        ValueError
            An attention variant with ``use_transformer_engine=False`` or a ``config.transformer_impl``
            other than ``"transformer_engine"`` (Megatron builds those layers from TE's specs only).
        """
        if getattr(config, "experimental_attention_variant", None) is not None:
            return with_cake_norms(_variant_block_spec(config, use_transformer_engine, **kwargs))
        use_te = _use_te(use_transformer_engine)
        stock = _gpt_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", qk_l2_norm=qk_l2_norm, **kwargs
        )
        return with_cake_norms(stock)

    def _with_cake_mtp_norms(spec):
        """A multi-token prediction block spec (``MultiTokenPredictionBlockSubmodules``, or a
        ``ModuleSpec`` holding them) with its layers' norms (``enorm``, ``hnorm``, ``layer_norm``) cake
        norms."""
        if isinstance(spec, ModuleSpec):
            return dataclasses.replace(spec, submodules=_with_cake_mtp_norms(spec.submodules))
        norms = ("enorm", "hnorm", "layer_norm")
        layers = []
        for layer in spec.layer_specs:
            changes = {
                name: MegatronCakeRMSNorm
                for name in norms
                if _is_norm_builder(getattr(layer.submodules, name))
            }
            layers.append(
                dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, **changes))
            )
        return dataclasses.replace(spec, layer_specs=layers)

    def get_gpt_mtp_block_spec(config, spec, use_transformer_engine=None, **kwargs):
        """Megatron's multi-token prediction block spec (``get_gpt_mtp_block_spec``) for a cake layer or
        block spec, its norms (``enorm``, ``hnorm``, the final ``layer_norm``) cake norms. Pass it to
        ``GPTModel(mtp_block_spec=...)``; the MTP layers' transformer layer is ``spec``'s (last) layer.

        Parameters
        ----------
        config : TransformerConfig
            The model's config (``mtp_num_layers``, pipeline fields).
        spec : ModuleSpec or TransformerBlockSubmodules
            The decoder's layer or block spec (``get_gpt_layer_spec``, ``get_gpt_decoder_block_spec``).
        use_transformer_engine : bool, optional
            Start from TE's layers; default: whether TE imports.
        **kwargs
            ``vp_stage``, ``pp_rank``: passed on.

        Returns
        -------
        MultiTokenPredictionBlockSubmodules or None
            None where this pipeline stage builds no MTP layer (as Megatron's function).

        Raises
        ------
        ImportError
            ``use_transformer_engine=True`` without Transformer Engine.
        """
        use_te = _use_te(use_transformer_engine)
        stock = _gpt_specs.get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, **kwargs)
        return None if stock is None else _with_cake_mtp_norms(stock)

    # What ``--spec cake_cute.integrations.megatron <name>`` imports: Megatron-LM passes the attribute
    # itself (not a call's result) as the layer spec, and attention (0.19) refuses q/k norm builders when
    # qk_layernorm is off, so the two settings are two objects.
    gpt_layer_spec = get_gpt_layer_spec()
    gpt_layer_spec_qk_norm = get_gpt_layer_spec(qk_layernorm=True)

    # Megatron's hybrid models (pretrain_hybrid.py, 0.19+; pretrain_mamba.py before) take a stack spec:
    # ``--spec cake_cute.integrations.megatron hybrid_stack_spec``. Their modules import triton, which a
    # Megatron installation without it lacks; then there is no hybrid spec here.
    try:
        from megatron.core.models.mamba import mamba_layer_specs as _stack_specs
        from megatron.core.ssm.mamba_block import MambaStack as _HybridStack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as _HybridStackSubmodules
    except ImportError:
        HAS_HYBRID = False
    else:
        HAS_HYBRID = True

    if HAS_HYBRID:

        def _with_cake_mamba_layer(spec):
            """A ``MambaLayer`` spec with its input norm a cake norm: TE's norm-fused ``in_proj`` of the mixer
            becomes ``TEColumnParallelLinear`` after ``MegatronCakeRMSNorm`` (the layer takes one tensor back
            from its norm), under the fused layer's checkpoint name; a norm in the slot is replaced."""
            subs = spec.submodules
            mixer, unfused = _with_cake_sublayer(subs.mixer, ("in_proj",), {})
            if unfused is None and not _is_norm_builder(subs.norm):
                return spec
            changes = {"norm": MegatronCakeRMSNorm, "mixer": mixer}
            if unfused is not None:
                keys = {**subs.sharded_state_dict_keys_map, "norm.": _fused_norm_key("mixer", unfused)}
                changes["sharded_state_dict_keys_map"] = keys
            return dataclasses.replace(spec, submodules=dataclasses.replace(subs, **changes))

        def _with_cake_stack_layer(name: str, layer):
            """One layer spec of a hybrid stack spec, with cake norms."""
            if layer is None or layer is IdentityOp:
                return layer
            if name == "mtp_block_spec":
                return _with_cake_mtp_norms(layer)
            if hasattr(layer.submodules, "mixer"):
                return _with_cake_mamba_layer(layer)
            return with_cake_norms(layer)

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

        def with_cake_stack_norms(spec, qk_layernorm=False):
            """A hybrid stack spec (Megatron's ``hybrid_stack_spec``, ``mamba_stack_spec`` before 0.19) with
            its RMSNorms replaced by cake norms: each layer spec as ``with_cake_norms`` replaces them (the
            attention, Gated DeltaNet, MLA / DSA, MLP and MoE layers), the Mamba layers' input norm (fused
            into the mixer's ``in_proj`` by TE's spec) ``MegatronCakeRMSNorm``, the multi-token prediction
            norms, and the stack's final norm, which the stack builds itself, through ``CakeHybridStack``.

            Parameters
            ----------
            spec : ModuleSpec
                A ``HybridStack`` (``MambaStack``) spec.
            qk_layernorm : bool
                Put cake q/k norms in the attention layer's q/k norm slots, which Megatron's stack spec
                leaves empty (Megatron 0.19 then builds TE's norms there under ``config.qk_layernorm``);
                must match the config's, as for the GPT layer specs.

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
                field.name: _with_cake_stack_layer(field.name, getattr(subs, field.name))
                for field in dataclasses.fields(subs)
            }
            return dataclasses.replace(
                spec, module=CakeHybridStack, submodules=dataclasses.replace(subs, **layers)
            )

        class CakeHybridStack(_HybridStack):
            """Megatron's hybrid stack (``HybridStack``; ``MambaStack`` before 0.19) whose final norm is a
            cake norm: the stack builds that norm itself (``TENorm``), with no spec slot. Arguments as the
            stack's; the norm keeps the name ``final_norm`` (the checkpoint key)."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                if hasattr(self, "final_norm"):
                    self.final_norm = MegatronCakeRMSNorm(
                        config=self.config,
                        hidden_size=self.config.hidden_size,
                        eps=self.config.layernorm_epsilon,
                    )

        # Two objects, as for the GPT layer specs: attention refuses q/k norm builders when qk_layernorm is
        # off, and the layer without them refuses qk_layernorm.
        hybrid_stack_spec = with_cake_stack_norms(_stack_specs.mamba_stack_spec)
        hybrid_stack_spec_qk_norm = with_cake_stack_norms(_stack_specs.mamba_stack_spec, qk_layernorm=True)
        mamba_stack_spec = hybrid_stack_spec
        __all__ += [
            "CakeHybridStack",
            "hybrid_stack_spec",
            "hybrid_stack_spec_qk_norm",
            "mamba_stack_spec",
            "with_cake_stack_norms",
        ]

    __all__ += [
        "CakeSpecProvider",
        "HAS_HYBRID",
        "HAS_TE",
        "get_gpt_decoder_block_spec",
        "get_gpt_layer_spec",
        "get_gpt_mtp_block_spec",
        "gpt_layer_spec",
        "gpt_layer_spec_qk_norm",
        "with_cake_norms",
    ]
