r"""torchtitan 0.3's Qwen3.5 norms as cake_cute's, through its override mechanism::

    --override.imports cake_cute.integrations.torchtitan_qwen35.cake_offset_rmsnorm \
        cake_cute.integrations.torchtitan_qwen35.cake_rmsnorm_gated

- ``OffsetRMSNorm``, ``(1 + w) * norm(x)`` in FP32 rounded once, becomes ``CakeRMSNorm`` with weight
  offset 1 under ``"scale_then_round"``;
- ``RMSNormGated``, the Gated DeltaNet output norm (``round(norm(x) * w)`` times the FP32 SiLU of the
  gate, rounded again), becomes ``CakeGatedRMSNorm`` under ``"scale_then_round"``.

Each keeps the config's ``param_init`` and ``ShardingConfig``, the forward's parameter names (by which
torchtitan binds layouts) and the state dict. Importing this module imports torchtitan's Qwen3.5 model,
and so fla.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config import derive, override
from torchtitan.models.qwen3_5.model import OffsetRMSNorm, RMSNormGated
from torchtitan.protocols.module import Module

from ..casts import SCALE_THEN_ROUND
from ..gated.module import SCALE_THEN_ROUND as GATED_SCALE_THEN_ROUND
from ..gated.module import CakeGatedRMSNorm
from ..module import CakeRMSNorm
from ..validation import check_memory_efficient

__all__ = ["TorchtitanCakeOffsetRMSNorm", "TorchtitanCakeRMSNormGated"]


class TorchtitanCakeOffsetRMSNorm(CakeRMSNorm, Module):
    """``CakeRMSNorm`` scaling by ``1 + weight``, built from ``OffsetRMSNorm.Config``'s fields."""

    @dataclass(kw_only=True, slots=True)
    class Config(OffsetRMSNorm.Config):
        memory_efficient: bool = False

    def __init__(self, config: Config):
        super().__init__(
            config.dim,
            eps=config.eps,
            weight_offset=1.0,
            cast_policy=SCALE_THEN_ROUND,
            memory_efficient=config.memory_efficient,
        )

    def forward(self, x):
        return super().forward(x)


class TorchtitanCakeRMSNormGated(CakeGatedRMSNorm, Module):
    """``CakeGatedRMSNorm`` built from ``RMSNormGated.Config``'s fields."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNormGated.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config.dim, config.eps, cast_policy=GATED_SCALE_THEN_ROUND)

    def forward(self, x, gate):
        return super().forward(x, gate)


# exact: a subclass of either config would configure a norm with a forward of its own.
@override(target=OffsetRMSNorm.Config, exact=True, description="cake_cute RMSNorm, weight offset 1")
def cake_offset_rmsnorm(cfg: OffsetRMSNorm.Config, *, memory_efficient: bool = False):
    """Every ``OffsetRMSNorm`` becomes a ``TorchtitanCakeOffsetRMSNorm`` with the same fields.

    Parameters
    ----------
    cfg : OffsetRMSNorm.Config
        The matched norm config.
    memory_efficient : bool
        The norms save their output instead of their input (``CakeRMSNorm``'s argument).

    Returns
    -------
    TorchtitanCakeOffsetRMSNorm.Config

    Raises
    ------
    TypeError
        memory_efficient is not a bool.
    """
    return derive(
        cfg, TorchtitanCakeOffsetRMSNorm.Config, memory_efficient=check_memory_efficient(memory_efficient)
    )


@override(target=RMSNormGated.Config, exact=True, description="cake_cute gated RMSNorm")
def cake_rmsnorm_gated(cfg: RMSNormGated.Config):
    """Every ``RMSNormGated`` becomes a ``TorchtitanCakeRMSNormGated`` with the same fields.

    Parameters
    ----------
    cfg : RMSNormGated.Config
        The matched norm config.

    Returns
    -------
    TorchtitanCakeRMSNormGated.Config
    """
    return derive(cfg, TorchtitanCakeRMSNormGated.Config)
