"""Configurations of the gated RMSNorm kernels: one frozen value per (arch, dtypes, H, group size).

A gated kernel normalizes *segments*: the whole row (norm then gate) or a group of ``group_size``
columns (gate then norm), each tiled like one row of the plain kernels. In the forward a segment stays
in one CTA (``SEGMENT_ELEMS_PER_LANE`` elements per lane, up to ``MAX_THREADS_PER_CTA`` lanes, so up to
``MAX_SEGMENT`` columns). The backward holds about eleven registers per element across its row sum,
so its lanes take ``HELD_ELEMS_PER_LANE`` elements, and a wider segment is split over a cluster whose
row sums meet in distributed shared memory. Short segments share a CTA. No config depends on T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from ..vocab import dtype_bytes
from .config import (
    HOPPER,
    finish_cells_bytes,
    on_override_change,
    override_choices,
    reduce_config,
    resident_ctas_per_sm,
)
from .tiling import MAX_THREADS_PER_CTA, REGISTERS_PER_SM, SMEM_STATIC_PER_CTA, RowTiling, vector_width

# Elements of each operand one lane holds (x, z, the gate and w fit well under 128 registers).
SEGMENT_ELEMS_PER_LANE = 16
MAX_SEGMENT = MAX_THREADS_PER_CTA * SEGMENT_ELEMS_PER_LANE
# Elements per lane of a backward that holds its terms across the row sum: 16 would spill under the
# 128-register cap.
HELD_ELEMS_PER_LANE = 8
# Registers per thread such a backward of 2-byte rows is held to (the ``min_blocks_per_mp`` hint), so
# that three 256-thread CTAs share an SM: the persistent grid launches as many programs as are
# resident, and each program has one row tile in flight, so residency is what keeps bytes in flight.
# FP32 rows keep 128 (H = 128 spills under 80 on sm_100a). So do rows of one segment narrower than
# PREFETCH_MIN_ROW on sm_100a / sm_103a, whose compiler takes a few more registers for the same lanes:
# under 80, bf16 and fp16 gate-then-norm rows of 64 to 1024 columns and bf16 norm-then-gate rows of
# 512 spill there (`cake-cute warmup --gated ... --report`); the grouped forms fit.
HELD_REGISTER_BUDGET = 80
# A backward whose CTA holds at most this many segments (segments of 1024 columns and more) prefetches
# its later row tiles into the L2, one bulk prefetch per segment and operand: a program has one row
# tile in flight, and its loads then wait on the L2 instead of HBM. Short segments (head_dim rows, 16
# to a CTA) are left without: 48 prefetches of 256 bytes per tile. So are whole rows of fewer than
# PREFETCH_MIN_ROW columns (the norm-then-gate form, or one group): with w in FP32 next to fp16 rows,
# sm_100a's 80-register lanes spill with the prefetch's addresses at H = 1024.
PREFETCH_MAX_SEGMENTS_PER_CTA = 2
PREFETCH_MIN_ROW = 2048
# Threads of each CTA of a cluster that shares a wide segment (groups of more than 4096 columns): 128
# lanes of 8 elements, eight CTAs to a group of 8192, six CTAs on an SM; measured faster than 256- or
# 512-lane CTAs, and than one CTA of 512 lanes reading its rows twice.
CLUSTER_CTA_THREADS = 128
# Threads of a CTA whose segments are short enough to share it (the plain forward's and the plain
# several-rows backward's CTA sizes).
FORWARD_CTA_THREADS = 128
BACKWARD_CTA_THREADS = 256


@dataclass(frozen=True)
class GatedConfig:
    """One gated kernel: a segment's tiling, the register hint and the persistent backward's residency."""

    tiling: RowTiling
    min_ctas_per_sm: int
    ctas_per_sm: int
    # Backward: g, x and z of the program's later row tiles are prefetched into the L2.
    prefetch: bool = False
    # Backward: it sums its partial rows of dW itself (``dw_finish``), in a cooperative launch or not.
    dw_in_launch: bool = False
    cooperative: bool = True

    def describe(self) -> str:
        prefetch = " prefetch" if self.prefetch else ""
        finish = (
            (" dW in launch" + ("" if self.cooperative else " non-cooperative")) if self.dw_in_launch else ""
        )
        return (
            f"{self.tiling.describe()} min_ctas/SM={self.min_ctas_per_sm} ctas/SM={self.ctas_per_sm}"
            f"{prefetch}{finish}"
        )


def check_segment(hidden: int, group_size: int) -> None:
    """Raise ValueError unless ``group_size`` divides H and lies in [1, ``MAX_SEGMENT``]."""
    if not 1 <= group_size <= MAX_SEGMENT or hidden % group_size:
        raise ValueError(
            f"group_size must divide hidden ({hidden}) and be in [1, {MAX_SEGMENT}], got {group_size}"
        )


def segment_tiling(segment: int, act_dtype: str, cta_threads: int, elems_per_lane: int) -> RowTiling:
    """Tile a segment: 16-byte vectors where it allows, at most ``elems_per_lane`` elements in the fewest
    power-of-two lanes, segments per CTA up to ``cta_threads``."""
    vec = vector_width(segment, dtype_bytes(act_dtype))
    vecs = -(-segment // vec)
    max_vpt = max(1, elems_per_lane // vec)
    lanes = min(MAX_THREADS_PER_CTA, 1 << max(0, math.ceil(math.log2(-(-vecs // max_vpt)))))
    return RowTiling(segment, vec, lanes, -(-vecs // lanes), 1, max(1, cta_threads // lanes))


def backward_smem_bytes(tiling: RowTiling, finish_cells: int) -> int:
    """Shared memory of one backward CTA, an upper bound (the finish's cells counted either way)."""
    reduction = 4 * 2 * tiling.rows_per_cta * (tiling.warps_per_row + tiling.cluster_n) + 64
    fold = 4 * tiling.rows_per_cta * tiling.cols_per_cta if tiling.rows_per_cta > 1 else 0
    return reduction + fold + finish_cells + SMEM_STATIC_PER_CTA + 256


@cache
def gated_forward_config(act_dtype: str, hidden: int, group_size: int) -> GatedConfig:
    """The gated forward's config, the same on every architecture; ValueError as ``check_segment``."""
    check_segment(hidden, group_size)
    tiling = segment_tiling(group_size, act_dtype, FORWARD_CTA_THREADS, SEGMENT_ELEMS_PER_LANE)
    return GatedConfig(tiling, tiling.min_ctas_per_sm, tiling.min_ctas_per_sm)


@cache
def gated_backward_config(arch: str, act_dtype: str, hidden: int, group_size: int) -> GatedConfig:
    """The gated backward's config for ``arch``: ``HELD_ELEMS_PER_LANE`` elements per lane (2-byte rows
    held to ``HELD_REGISTER_BUDGET`` registers, except one-segment rows off sm_90a), one CTA or a
    cluster per segment, twice the forward's threads for short segments, the L2 prefetch for wide
    segments, the persistent grid's residency, and whether it sums dW in its own launch (override
    choices ``dw_in_launch`` and ``cooperative``). ValueError as ``check_segment``."""
    check_segment(hidden, group_size)
    if group_size > MAX_THREADS_PER_CTA * HELD_ELEMS_PER_LANE:
        tiling = cluster_segment_tiling(group_size, act_dtype)
    else:
        tiling = segment_tiling(group_size, act_dtype, BACKWARD_CTA_THREADS, HELD_ELEMS_PER_LANE)
    one_segment_rows = group_size == hidden and hidden < PREFETCH_MIN_ROW
    min_ctas = tiling.min_ctas_per_sm
    if dtype_bytes(act_dtype) == 2 and (arch == HOPPER or not one_segment_rows):
        min_ctas = max(min_ctas, REGISTERS_PER_SM // (HELD_REGISTER_BUDGET * tiling.threads_per_cta))
    cells = finish_cells_bytes(reduce_config(arch, "fp32", hidden), tiling.threads_per_cta)
    per_sm = resident_ctas_per_sm(tiling, backward_smem_bytes(tiling, cells), min_ctas)
    prefetch = tiling.rows_per_cta <= PREFETCH_MAX_SEGMENTS_PER_CTA and not one_segment_rows
    finish = override_choices("gated_bwd", arch, act_dtype, hidden)
    return GatedConfig(tiling, min_ctas, per_sm, prefetch, **finish)


on_override_change(gated_backward_config.cache_clear)


def cluster_segment_tiling(segment: int, act_dtype: str) -> RowTiling:
    """A segment wider than one CTA of held lanes, over a cluster of up to 8 CTAs."""
    vec = vector_width(segment, dtype_bytes(act_dtype))
    vecs_per_lane = max(1, HELD_ELEMS_PER_LANE // vec)
    cluster = -(-segment // (CLUSTER_CTA_THREADS * vecs_per_lane * vec))
    vecs = -(-segment // vec)
    lanes = 1 << max(0, math.ceil(math.log2(-(-vecs // (cluster * vecs_per_lane)))))
    return RowTiling(segment, vec, lanes, vecs_per_lane, cluster, 1)
