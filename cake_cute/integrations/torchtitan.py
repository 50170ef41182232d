"""torchtitan 0.3 integration: its RMSNorm modules become ``CakeRMSNorm`` through torchtitan's override
mechanism, in one config line::

    --override.imports cake_cute.integrations.torchtitan.cake_rmsnorm

The replacement keeps what torchtitan attached to the norm's config (``param_init``, the
``ShardingConfig``, the module protocol) and the state dict. For Llama 3 the residual add feeding
``ffn_norm`` can be fused too, with the two targets ``cake_llama3_fused_residual`` and
``cake_final_rmsnorm`` (overrides may not claim nested configs, so the final norm needs its own). Each
target takes the memory-efficient mode in torchtitan's keyword form::

    --override.imports 'cake_cute.integrations.torchtitan.cake_rmsnorm={"memory_efficient": true}'

With torchtitan 0.2.x, which has no overrides, importing this module registers the model converters
``cake_rmsnorm`` and ``cake_rmsnorm_memory_efficient`` instead::

    --experimental.custom_import cake_cute.integrations.torchtitan --model.converters cake_rmsnorm

This module imports without torchtitan and then registers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib.util import find_spec

from ..forward_names import INPUT_NAME
from ..hf.swap import swap_rmsnorm
from ..module import CakeRMSNorm
from ..validation import check_memory_efficient

__all__: list[str] = []

try:
    import torchtitan  # noqa: F401
except ModuleNotFoundError as error:
    if error.name != "torchtitan":
        raise
    HAS_TORCHTITAN = False
else:
    HAS_TORCHTITAN = True

# torchtitan 0.3 builds modules from Config classes and swaps them through overrides; 0.2.x builds
# torch.nn modules and changes the built model through registered model converters.
HAS_OVERRIDES = HAS_TORCHTITAN and find_spec("torchtitan.config.override") is not None

if HAS_OVERRIDES:
    from torchtitan.config import derive, override
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3.model import Llama3TransformerBlock
    from torchtitan.protocols.module import Module

    class TorchtitanCakeRMSNorm(CakeRMSNorm, Module):
        """``CakeRMSNorm`` as a torchtitan ``Module`` built from ``RMSNorm.Config``'s fields and
        ``memory_efficient``."""

        @dataclass(kw_only=True, slots=True)
        class Config(RMSNorm.Config):
            memory_efficient: bool = False

        def __init__(self, config: Config):
            super().__init__(
                config.normalized_shape,
                eps=config.eps,
                elementwise_affine=config.elementwise_affine,
                memory_efficient=config.memory_efficient,
            )

    class CakeLlama3TransformerBlock(Llama3TransformerBlock):
        """torchtitan's Llama 3 block with the attention residual add fused into ``ffn_norm``; ``h`` is the
        stock block's rounded sum."""

        @dataclass(kw_only=True, slots=True)
        class Config(Llama3TransformerBlock.Config):
            pass

        def forward(self, x, attention_masks, positions=None):
            attention_out = self.attention(self.attention_norm(x), attention_masks, positions)
            y, h = self.ffn_norm(attention_out, residual=x)
            return h + self.feed_forward(y)

    def _cake_norm_config(cfg: RMSNorm.Config, memory_efficient: bool) -> TorchtitanCakeRMSNorm.Config:
        return derive(
            cfg, TorchtitanCakeRMSNorm.Config, memory_efficient=check_memory_efficient(memory_efficient)
        )

    def _with_residual_input(norm_cfg: TorchtitanCakeRMSNorm.Config) -> TorchtitanCakeRMSNorm.Config:
        """Declare the residual in the input's layout (torchtitan binds layouts by parameter name)."""
        sharding = norm_cfg.sharding_config
        layout = None if sharding is None else (sharding.in_src_shardings or {}).get(INPUT_NAME)
        if layout is None:
            return norm_cfg
        in_src = {**sharding.in_src_shardings, "residual": layout}
        norm_cfg.sharding_config = replace(sharding, in_src_shardings=in_src)
        return norm_cfg

    # exact: subclasses of RMSNorm.Config configure norms with a forward of their own (a gain-centred
    # scale, say), which CakeRMSNorm does not reproduce.
    @override(target=RMSNorm.Config, exact=True, description="cake_cute fused RMSNorm (CakeRMSNorm)")
    def cake_rmsnorm(cfg: RMSNorm.Config, *, memory_efficient: bool = False) -> TorchtitanCakeRMSNorm.Config:
        """Every torchtitan ``RMSNorm`` becomes a ``TorchtitanCakeRMSNorm`` with the same fields.

        Parameters
        ----------
        cfg : RMSNorm.Config
            The matched norm config (exactly ``RMSNorm.Config``).
        memory_efficient : bool
            The norms save their output instead of their input.

        Returns
        -------
        TorchtitanCakeRMSNorm.Config
            The replacement.

        Raises
        ------
        TypeError
            ``memory_efficient`` is not a bool.
        """
        return _cake_norm_config(cfg, memory_efficient)

    @override(
        target=Llama3TransformerBlock.Config,
        exact=True,
        description="cake_cute RMSNorm with the attention residual add fused into ffn_norm",
    )
    def cake_llama3_fused_residual(
        cfg: Llama3TransformerBlock.Config, *, memory_efficient: bool = False
    ) -> CakeLlama3TransformerBlock.Config:
        """A Llama 3 block becomes a ``CakeLlama3TransformerBlock`` whose two norms are
        ``TorchtitanCakeRMSNorm``; ``ffn_norm``'s sharding also declares the residual input.

        Parameters
        ----------
        cfg : Llama3TransformerBlock.Config
            The matched block config.
        memory_efficient : bool
            Both norms save their output instead of their input.

        Returns
        -------
        CakeLlama3TransformerBlock.Config
            The replacement block config; attention and feed-forward configs are shared with ``cfg``.

        Raises
        ------
        TypeError
            ``memory_efficient`` is not a bool.
        """
        return derive(
            cfg,
            CakeLlama3TransformerBlock.Config,
            attention_norm=_cake_norm_config(cfg.attention_norm, memory_efficient),
            ffn_norm=_with_residual_input(_cake_norm_config(cfg.ffn_norm, memory_efficient)),
        )

    # The decoder's final norm: FQN "norm" under the model config, "model_spec.model" under the trainer's.
    @override(
        target=RMSNorm.Config,
        fqns=["norm", "*.model.norm"],
        exact=True,
        description="cake_cute final RMSNorm",
    )
    def cake_final_rmsnorm(
        cfg: RMSNorm.Config, *, memory_efficient: bool = False
    ) -> TorchtitanCakeRMSNorm.Config:
        """The decoder's final norm becomes a ``TorchtitanCakeRMSNorm`` (the companion of
        ``cake_llama3_fused_residual``).

        Parameters
        ----------
        cfg : RMSNorm.Config
            The matched norm config.
        memory_efficient : bool
            The norm saves its output instead of its input.

        Returns
        -------
        TorchtitanCakeRMSNorm.Config
            The replacement.

        Raises
        ------
        TypeError
            ``memory_efficient`` is not a bool.
        """
        return _cake_norm_config(cfg, memory_efficient)

    __all__ += [
        "CakeLlama3TransformerBlock",
        "TorchtitanCakeRMSNorm",
        "cake_final_rmsnorm",
        "cake_llama3_fused_residual",
        "cake_rmsnorm",
    ]

elif HAS_TORCHTITAN:
    from torchtitan.protocols.model_converter import register_model_converter

    class CakeRMSNormConverter:
        """torchtitan 0.2.x model converter ``cake_rmsnorm``: ``swap_rmsnorm`` on the meta-device model before
        parallelize; ``init_weights`` initializes the swapped norms."""

        memory_efficient = False

        def __init__(self, job_config, parallel_dims):
            pass

        def convert(self, model) -> None:
            swap_rmsnorm(model, memory_efficient=self.memory_efficient)

        def post_optimizer_hook(self, model) -> None:
            pass

    class CakeRMSNormMemoryEfficientConverter(CakeRMSNormConverter):
        """torchtitan 0.2.x model converter ``cake_rmsnorm_memory_efficient``: the same swap, every norm in
        the memory-efficient mode."""

        memory_efficient = True

    register_model_converter(CakeRMSNormConverter, "cake_rmsnorm")
    register_model_converter(CakeRMSNormMemoryEfficientConverter, "cake_rmsnorm_memory_efficient")
    __all__ += ["CakeRMSNormConverter", "CakeRMSNormMemoryEfficientConverter"]
