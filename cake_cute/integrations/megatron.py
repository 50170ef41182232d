"""Megatron-Core integration: cake_cute norms built the way Megatron builds its own, and GPT specs that
hold them, so a Megatron-LM user switches with one line::

    --spec cake_cute.integrations.megatron gpt_layer_spec            # any Megatron-LM version
    --spec cake_cute.integrations.megatron gpt_decoder_block_spec    # Megatron-LM 0.19+: the final norm too
    --spec cake_cute.integrations.megatron hybrid_stack_spec         # pretrain_hybrid.py

The specs adapt to the config as Megatron-LM's GPT builder does (dense or MoE layers, multi-latent
attention, q/k norms, Transformer Engine or local layers): the same parameters and checkpoint keys as
Megatron's spec, with cake norms, or a ``ValueError`` naming the config field they cannot serve.
Before 0.19 ``--spec`` hands the named object to the model uncalled, so ``gpt_layer_spec``'s layer
class picks each layer's spec when Megatron constructs it, and the final norm stays Megatron's.

The norms honour ``TransformerConfig``'s norm fields and refuse by name what they cannot honour; their
state dict is the stock norm's. This module imports without Megatron-Core; the specs exist when
``megatron.core`` imports.
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
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as _variant_specs
    from megatron.core.models.gpt import gpt_layer_specs as _gpt_specs
    from megatron.core.transformer import transformer_block as _transformer_block
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer
    from megatron.core.utils import get_pg_rank

    from . import megatron_specs as _specs
    from .megatron_norms import check_norm_config
    from .megatron_specs import with_cake_mtp_norms, with_cake_norms

    HAS_TE = _specs.HAS_TE

    class CakeSpecProvider(LocalSpecProvider):
        """Megatron's ``LocalSpecProvider`` with cake norms, for code that builds specs from a backend."""

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
        """A GPT ``TransformerLayer`` spec with cake norms, from Megatron's TE or local spec.

        Parameters
        ----------
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, qk_l2_norm
            As for ``get_gpt_layer_local_spec``; ``qk_layernorm`` must match the config's.
        use_transformer_engine : bool, optional
            Start from TE's spec; default: whether TE imports.
        **kwargs
            Passed on to Megatron's spec function.

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
        """Megatron's (TE-only) block spec for a config with an experimental attention variant."""
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
        """The block spec Megatron-LM's GPT builder takes for ``config`` (this pipeline stage's dense, MoE
        or attention-variant layers), with cake norms and the final norm; for
        ``GPTModel(transformer_layer_spec=...)``.

        Parameters
        ----------
        config : TransformerConfig
            The model's config.
        use_transformer_engine : bool, optional
            Start from TE's layers; default: whether TE imports (always, for an attention variant).
        qk_l2_norm : bool
            As for Megatron's function.
        fused_output_gate : bool
            Opt-in: Gated DeltaNet layers run their output norm and SiLU gate as one gated kernel (one
            rounding, where the stock layer rounds before the gate).
        **kwargs
            ``vp_stage``, ``pp_rank``: passed on.

        Returns
        -------
        TransformerBlockSubmodules
            This stage's layer specs and the final norm.

        Raises
        ------
        ImportError
            Transformer Engine missing where asked for or needed (an attention variant).
        ValueError
            An attention variant without Transformer Engine's layers.
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
        """Megatron's multi-token prediction block spec for a cake layer or block spec, its norms cake norms;
        for ``GPTModel(mtp_block_spec=...)``.

        Parameters
        ----------
        config : TransformerConfig
            The model's config.
        spec : ModuleSpec or TransformerBlockSubmodules
            The decoder's layer or block spec; the MTP layers take its (last) layer.
        use_transformer_engine : bool, optional
            Start from TE's layers; default: whether TE imports.
        **kwargs
            ``vp_stage``, ``pp_rank``: passed on.

        Returns
        -------
        MultiTokenPredictionBlockSubmodules or None
            None where this pipeline stage builds no MTP layer.

        Raises
        ------
        ImportError, ValueError
            As ``get_gpt_decoder_block_spec`` (for ``gpt_layer_spec``, ``gpt_decoder_block_spec``'s).
        """
        use_te = _use_te(use_transformer_engine)
        if isinstance(spec, ModuleSpec) and spec.module is CakeGPTLayer:
            spec = _builder_block_spec(config, **kwargs)
        stock = _gpt_specs.get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, **kwargs)
        return None if stock is None else with_cake_mtp_norms(stock)

    # The config fields torch's norm refuses when Megatron builds it through WrappedTorchNorm (one assert
    # each), and which import makes Megatron's final norm class what it is.
    _TORCH_NORM_REFUSES = (
        "layernorm_zero_centered_gamma",
        "persist_layer_norm",
        "sequence_parallel",
        "memory_efficient_layer_norm",
    )
    _FINAL_NORM_ORIGIN = {
        WrappedTorchNorm: "torch's norm: neither Transformer Engine nor Apex imports",
        FusedLayerNorm: "Apex's LayerNorm kernel, which refuses every normalization but 'LayerNorm'",
    }

    def _builder_uses_te(config) -> bool:
        """Whether the GPT builder starts from TE's specs, after refusing configs no cake spec serves."""
        check_norm_config(config)
        if getattr(config, "heterogeneous_block_specs", False):
            raise ValueError(
                "config.heterogeneous_block_specs=True: per-layer configs (heterogeneous_layers_config_path) "
                "are built from Megatron's heterogeneous layer specs, which have no cake form"
            )
        impl = config.transformer_impl
        if impl == "local":
            return False
        if impl == "transformer_engine" and _specs.HAS_TE:
            return True
        if impl == "transformer_engine":
            raise ValueError(
                "config.transformer_impl='transformer_engine' but Transformer Engine does not import: pass "
                "--transformer-impl local (transformer_impl='local') or install Transformer Engine"
            )
        raise ValueError(
            f"config.transformer_impl={impl!r}: the cake specs are Megatron's 'transformer_engine' and "
            "'local' specs"
        )

    def _check_megatron_final_norm(config) -> None:
        """Refuse now what Megatron's own final norm would refuse after every layer is built."""
        final_norm = _transformer_block.LayerNormImpl
        if final_norm is FusedLayerNorm:
            refused = [("normalization", config.normalization)]
        elif final_norm is WrappedTorchNorm:
            refused = [(name, getattr(config, name)) for name in _TORCH_NORM_REFUSES if getattr(config, name)]
        else:
            refused = []
        if refused:
            name, value = refused[0]
            raise ValueError(
                f"config.{name}={value!r}: under a layer spec (gpt_layer_spec) Megatron builds the model's "
                f"final norm itself, as {final_norm.__name__} ({_FINAL_NORM_ORIGIN[final_norm]}), which "
                "refuses it; Megatron-LM 0.19+ takes --spec cake_cute.integrations.megatron "
                "gpt_decoder_block_spec (a cake final norm), a model provider "
                "get_gpt_decoder_block_spec(config)"
            )

    def _builder_block_spec(config, **stage):
        """``get_gpt_decoder_block_spec`` as Megatron-LM's GPT builder chooses it for ``config``."""
        use_te = _builder_uses_te(config)
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, qk_l2_norm=config.qk_l2_norm, **stage
        )

    def _transformer_config(config):
        """The ``TransformerConfig`` in what the builder passes a ``--spec`` function."""
        transformer = getattr(config, "transformer", None)
        return transformer if isinstance(transformer, TransformerConfig) else config

    def gpt_decoder_block_spec(config, vp_stage=None):
        """The ``--spec`` function for Megatron-LM 0.19+, whose builder calls it with the model config: the
        block spec the builder would build, with cake norms and the final norm.

        Parameters
        ----------
        config : GPTModelConfig or TransformerConfig
            The model config the builder passes, or a ``TransformerConfig``.
        vp_stage : int, optional
            The virtual pipeline stage being built.

        Returns
        -------
        TransformerBlockSubmodules
            This pipeline stage's layers.

        Raises
        ------
        ValueError
            ``normalization`` other than ``"RMSNorm"``, ``heterogeneous_block_specs``, a
            ``transformer_impl`` neither ``"local"`` nor an importable ``"transformer_engine"``;
            ``get_gpt_decoder_block_spec``'s.
        """
        return _builder_block_spec(_transformer_config(config), vp_stage=vp_stage)

    class CakeGPTLayer(BaseTransformerLayer):
        """The layer class of ``gpt_layer_spec`` (a layer spec's only place to read the config before
        Megatron-LM 0.19): constructing it builds and returns the layer the GPT builder would build at that
        position, Megatron's own class, with cake norms.

        Parameters
        ----------
        config : TransformerConfig
            The model's config.
        layer_number : int
            The layer's 1-based number within this pipeline stage.
        pg_collection : ProcessGroupCollection, optional
            The model's process groups (its pipeline rank picks the stage's layers).
        vp_stage : int, optional
            The virtual pipeline stage.
        **layer_kwargs
            Passed on to the layer.

        Returns
        -------
        torch.nn.Module
            The layer, with cake norms.

        Raises
        ------
        ValueError
            ``gpt_decoder_block_spec``'s errors, and what Megatron's own final norm would refuse.
        """

        def __new__(cls, *, config, layer_number=1, pg_collection=None, vp_stage=None, **layer_kwargs):
            pp_rank = None if pg_collection is None else get_pg_rank(pg_collection.pp)
            block = _builder_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
            _check_megatron_final_norm(config)
            return build_module(
                block.layer_specs[layer_number - 1],
                config=config,
                layer_number=layer_number,
                pg_collection=pg_collection,
                vp_stage=vp_stage,
                **layer_kwargs,
            )

    # What ``--spec cake_cute.integrations.megatron gpt_layer_spec`` imports: Megatron-LM hands the
    # attribute itself to the model, which repeats it over the stage's layers. The name that chose q/k
    # norms before the spec followed the config stays, the same object.
    gpt_layer_spec = ModuleSpec(module=CakeGPTLayer)
    gpt_layer_spec_qk_norm = gpt_layer_spec

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
        "CakeGPTLayer",
        "CakeSpecProvider",
        "HAS_HYBRID",
        "HAS_TE",
        "get_gpt_decoder_block_spec",
        "get_gpt_layer_spec",
        "get_gpt_mtp_block_spec",
        "gpt_decoder_block_spec",
        "gpt_layer_spec",
        "gpt_layer_spec_qk_norm",
        "with_cake_norms",
    ]
