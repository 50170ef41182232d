"""The forward to block-scaled FP8's config (``quant_forward_config``), built by per-arch rules like the
others and overridden through ``config.overridden`` (kind ``"quant"``), with the recipes and the FP8 /
E8M0 bit constants the quantizing epilogue and its reference share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ..vocab import dtype_bytes
from .config import forward_register_hint, on_override_change, override_choices
from .tiling import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM, RowTiling, forward_tiling

# Recipes of the quantizing forward (``rmsnorm_fwd_quant``): block width along H, and whether the
# scales are FP32 powers of two (else E8M0 bytes).
QUANT_RECIPES = {"mxfp8": (32, False), "1x128": (128, True)}
E4M3_MAX = 448.0
FP32_NAN_BITS = 0x7FC00000
FP32_BITS_OF_2_POW_M127 = 0x400000  # 2^-127, the smallest E8M0 value, is an FP32 subnormal
FP32_INF_BITS = 0x7F800000
E8M0_ONE = 127  # the E8M0 byte of 2^0
E8M0_MAX_FINITE = 254  # 2^127
E8M0_NAN = 255
# The E8M0 exponent of fp32(amax / 448) rounded up, from amax's bits (fp8_numerics.e8m0_round_up_from_bits):
E8M0_EXPONENT_OFFSET = 8  # 448 = 1.75 * 2^8
E8M0_SIGNIFICAND_CARRY = 0x1FFFFF  # 2^23 - 0x600001: a significand above 1.75 carries into the exponent
AMAX_BITS_E8M0_ZERO = 0x04600001  # the largest amax whose amax / 448 rounds to 2^-127 or less


@dataclass(frozen=True)
class QuantForwardConfig:
    """The quantizing forward: tiling, register hint, block width and scale type, ``amax_scatter``, and
    the persistent kernel's programs per SM (0: one CTA per row tile)."""

    tiling: RowTiling
    min_ctas_per_sm: int
    block: int
    fp32_scales: bool
    amax_scatter: bool = True
    programs_per_sm: int = 0

    def describe(self) -> str:
        scales = "fp32" if self.fp32_scales else "e8m0"
        scatter = " scatter" if self.amax_scatter else ""
        hint = self.min_ctas_per_sm or "-"
        programs = f" persistent {self.programs_per_sm}/SM" if self.programs_per_sm else ""
        return f"{self.tiling.describe()} min_ctas/SM={hint} 1x{self.block} {scales}{scatter}{programs}"


def scatter_steps(amax_scatter: bool, groups: int, lanes_per_block: int) -> int:
    """Reduce-scatter steps of the block maxima, log2(min(groups, lanes_per_block)); 0 where groups are
    not a power of two or a block is wider than a warp."""
    if not amax_scatter or groups & (groups - 1) or lanes_per_block > 32:
        return 0
    return min(groups, lanes_per_block).bit_length() - 1


def blocks_nest(tiling: RowTiling, block: int) -> bool:
    """A k-slice holds whole blocks, or a block whole k-slices, as the epilogue's lane groups need."""
    span = tiling.threads_per_row * tiling.vec
    return span % block == 0 or block % span == 0


# The persistent forward to FP8 keeps two row tiles of x per program and holds more registers than
# the one-tile kernel. 2-byte rows: four programs per SM while a CTA's tile is at most FOUR_PER_SM_MAX_TILE
# elements of 16-byte vectors, two up to TWO_PER_SM_MAX_TILE, one above (rows of narrower vectors, odd H,
# hold a register per element and spill when held to four per SM). FP32 rows of 16-byte vectors: four
# up to FP32_FOUR_PER_SM_MAX_TILE, two up to FP32_TWO_PER_SM_MAX_TILE (at 8192 elements four would not
# fit the SM's shared memory; at 4096 two measured faster), none above or for narrower vectors (not
# measured).
PERSISTENT_FOUR_PER_SM_MAX_TILE = 5120
PERSISTENT_TWO_PER_SM_MAX_TILE = 8192
PERSISTENT_FP32_FOUR_PER_SM_MAX_TILE = 2048
PERSISTENT_FP32_TWO_PER_SM_MAX_TILE = 8192


def persistent_programs_per_sm(tiling: RowTiling, act_dtype: str) -> int:
    """Programs per SM of the persistent forward to FP8, 0 where it does not apply."""
    if tiling.cluster_n > 1:
        return 0
    tile = tiling.rows_per_cta * tiling.cols_per_cta
    whole_vectors = tiling.vec * dtype_bytes(act_dtype) == 16
    if dtype_bytes(act_dtype) == 4:
        if not whole_vectors or tile > PERSISTENT_FP32_TWO_PER_SM_MAX_TILE:
            return 0
        return 4 if tile <= PERSISTENT_FP32_FOUR_PER_SM_MAX_TILE else 2
    if tile <= PERSISTENT_FOUR_PER_SM_MAX_TILE and whole_vectors:
        return 4
    return 2 if tile <= PERSISTENT_TWO_PER_SM_MAX_TILE else 1


def persistent_register_hint(tiling: RowTiling, programs_per_sm: int) -> int:
    """The persistent forward's register hint: every program must be resident from the start, so where
    that needs fewer than 128 registers the hint holds the kernel to them."""
    fits = REGISTERS_PER_SM // (programs_per_sm * tiling.threads_per_cta) >= MAX_REGISTERS_PER_THREAD
    return 0 if fits else programs_per_sm


@cache
def quant_forward_config(
    arch: str, act_dtype: str, hidden: int, recipe: str, persistent: bool = False
) -> QuantForwardConfig:
    """The quantizing forward's tiling and register hint, the forward's (up to 64 values per thread, which
    with the reduce-scatter of the block maxima measured faster than 32 for wide plain rows), plus the
    recipe's block width and scale type. Every such tiling nests with both block widths.
    ``persistent``: the persistent kernel's config.

    Raises
    ------
    ValueError
        ``persistent`` for a tiling or dtype the persistent kernel does not cover.
    """
    block, fp32_scales = QUANT_RECIPES[recipe]
    choices = override_choices("quant", arch, act_dtype, hidden)
    tiling = choices.get("tiling") or forward_tiling(hidden, act_dtype)
    hint = choices.get("min_ctas_per_sm", forward_register_hint(tiling, arch))
    programs = 0
    if persistent:
        rule = persistent_programs_per_sm(tiling, act_dtype)
        if not rule:
            raise ValueError(f"no persistent forward to FP8 for {act_dtype} rows of {tiling.describe()}")
        programs = choices.get("programs_per_sm") or rule
        hint = choices.get("min_ctas_per_sm", persistent_register_hint(tiling, programs))
    scatter = choices.get("amax_scatter", True)
    return QuantForwardConfig(tiling, hint, block, fp32_scales, scatter, programs)


on_override_change(quant_forward_config.cache_clear)
