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
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as _variant_specs
    from megatron.core.models.gpt import gpt_layer_specs as _gpt_specs

    from . import megatron_specs as _specs
    from .megatron_specs import with_cake_mtp_norms, with_cake_norms

    HAS_TE = _specs.HAS_TE

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

    def _use_te(use_transformer_engine) -> bool:
        """Whether to start from Megatron's TE specs: as asked, by default where TE imports."""
        if use_transformer_engine is None:
            return _specs.HAS_TE
        if use_transformer_engine and not _specs.HAS_TE:
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
        if not _specs.HAS_TE:
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

    def get_gpt_decoder_block_spec(
        config, use_transformer_engine=None, qk_l2_norm=False, *, fused_output_gate=False, **kwargs
    ):
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
        fused_output_gate : bool
            Opt-in for Gated DeltaNet layers: their output norm and SiLU gate as one gated kernel (one
            rounding; the stock layer rounds the norm's output before the gate), ``with_cake_norms``.
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
            stock = _variant_block_spec(config, use_transformer_engine, **kwargs)
            return with_cake_norms(stock, fused_output_gate=fused_output_gate)
        use_te = _use_te(use_transformer_engine)
        stock = _gpt_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", qk_l2_norm=qk_l2_norm, **kwargs
        )
        return with_cake_norms(stock)

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
        return None if stock is None else with_cake_mtp_norms(stock)

    # What ``--spec cake_cute.integrations.megatron <name>`` imports: Megatron-LM passes the attribute
    # itself (not a call's result) as the layer spec, and attention (0.19) refuses q/k norm builders when
    # qk_layernorm is off, so the two settings are two objects.
    gpt_layer_spec = get_gpt_layer_spec()
    gpt_layer_spec_qk_norm = get_gpt_layer_spec(qk_layernorm=True)

    # Megatron's hybrid models take a stack spec (``megatron_hybrid``). Their modules import triton,
    # which a Megatron installation without it lacks; then there is no hybrid spec here.
    try:
        from megatron.core.models.mamba import mamba_layer_specs  # noqa: F401
        from megatron.core.ssm import mamba_block  # noqa: F401
    except ImportError:
        HAS_HYBRID = False
    else:
        HAS_HYBRID = True
        from .megatron_hybrid import (
            CakeHybridStack,
            hybrid_stack_spec,
            hybrid_stack_spec_qk_norm,
            mamba_stack_spec,
            with_cake_stack_norms,
        )

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
