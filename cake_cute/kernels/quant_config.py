"""The forward to block-scaled FP8's config, built by per-arch rules like the others (``kernels.config``):

- ``quant_forward_config(arch, act_dtype, hidden, recipe, persistent=False)`` -> ``QuantForwardConfig``
  (``rmsnorm_fwd_quant``, or ``rmsnorm_fwd_quant_persistent`` with ``persistent``),

with the recipes (``QUANT_RECIPES``) and the FP8 / E8M0 bit constants that the quantizing epilogue and
its reference (``fp8_numerics``) share. Its choices are overridden through ``config.overridden`` (kind
``"quant"``, one entry for both recipes), which clears its cache with the other configs'.
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
    """The quantizing forward: its tiling and register hint, the recipe's block width and scale type,
    whether the lanes of a block split its groups' maxima between them (``amax_scatter``: see
    ``scatter_steps``; off, every lane reduces every group's maximum over the block's lanes), and for
    the persistent kernel its programs per SM (``programs_per_sm``; 0: one CTA per row tile)."""

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
    """Reduce-scatter steps of the quantizing epilogue's block maxima: a lane holds the maxima of
    ``groups`` blocks (one per group of its vectors) shared by ``lanes_per_block`` lanes; each step
    halves the groups a lane keeps and the lanes that keep the same ones, so after log2(min(groups,
    lanes)) steps every lane reduces (and writes the scale of) only its own share. Where the groups
    are not a power of two or a block is wider than a warp, 0: every lane reduces every group."""
    if not amax_scatter or groups & (groups - 1) or lanes_per_block > 32:
        return 0
    return min(groups, lanes_per_block).bit_length() - 1


def blocks_nest(tiling: RowTiling, block: int) -> bool:
    """A k-slice of the tiling (threads_per_row * vec columns) holds whole blocks, or a block whole
    k-slices: the quantizing epilogue's lane groups need one of the two."""
    span = tiling.threads_per_row * tiling.vec
    return span % block == 0 or block % span == 0


# The persistent forward to FP8 keeps two row tiles of x per program and holds more registers than
# the one-tile kernel. 2-byte rows: four programs per SM while a CTA's tile is at most FOUR_PER_SM_MAX_TILE
# elements of 16-byte vectors, two up to TWO_PER_SM_MAX_TILE, one above (rows of narrower vectors, odd H,
# hold a register per element and spill when held to four per SM). FP32 rows of 16-byte vectors: four
# up to FP32_FOUR_PER_SM_MAX_TILE, two up to FP32_TWO_PER_SM_MAX_TILE (at 8192 elements four would not
# fit the SM's shared memory; at 4096 two ran 1-2% faster than four), none above or for narrower
# vectors (not measured).
# Measurements: evidence/kernel-rules-h200-2026-12-01/persistent-forward/.
PERSISTENT_FOUR_PER_SM_MAX_TILE = 5120
PERSISTENT_TWO_PER_SM_MAX_TILE = 8192
PERSISTENT_FP32_FOUR_PER_SM_MAX_TILE = 2048
PERSISTENT_FP32_TWO_PER_SM_MAX_TILE = 8192


def persistent_programs_per_sm(tiling: RowTiling, act_dtype: str) -> int:
    """Programs per SM of the persistent forward to FP8 (``rmsnorm_fwd_quant_persistent``), 0 where it
    does not apply: rows split over a cluster (a program would hold a cluster per tile; measured
    slower) and FP32 rows outside the measured tiles."""
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
    """The persistent forward's ``min_blocks_per_mp`` hint: every program must be resident from the
    start (one waiting for a slot would run its tiles after the others finished theirs), so where
    that needs fewer than 128 registers per thread the hint holds the kernel to them; elsewhere no
    hint, as measured."""
    fits = REGISTERS_PER_SM // (programs_per_sm * tiling.threads_per_cta) >= MAX_REGISTERS_PER_THREAD
    return 0 if fits else programs_per_sm


@cache
def quant_forward_config(
    arch: str, act_dtype: str, hidden: int, recipe: str, persistent: bool = False
) -> QuantForwardConfig:
    """The quantizing forward's tiling and register hint: the forward's (up to 64 values per thread;
    with the reduce-scatter of the block maxima they cost 80 registers, 3 CTAs of 256 threads per SM,
    and on the H200 run plain-mode rows wider than 8192 3-7% faster than tilings held to 32 values,
    residual ones 1-2% slower: evidence/kernel-rules-h200-2026-12-01/fp8-epilogue/), plus the recipe's block
    width and scale type. Both recipes share one override entry (kind ``"quant"``). Every such tiling
    nests with both block widths (its k-slices are a power of two or, for the exact covers of a
    non-power-of-two warp count, a multiple of 128 columns; tests/test_fp8_cpu.py checks every H).
    ``persistent``: the persistent kernel's config, with its ``persistent_programs_per_sm``.

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
