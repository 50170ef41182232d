"""Configurations of the gated RMSNorm kernels (``gated_fwd``, ``gated_bwd``): one frozen value per
(arch, dtypes, H, group size), built by the rules here.

A gated kernel normalizes *segments*: the whole row in the norm-then-gate form (statistics per row), a
group of ``group_size`` columns in the gate-then-norm form (statistics per group). A segment is tiled
like one row of the plain kernels (``tiling.RowTiling``, the same vocabulary). In the forward a
segment stays inside one CTA: a lane holds at most ``SEGMENT_ELEMS_PER_LANE`` elements of each
operand, and a segment gets up to ``MAX_THREADS_PER_CTA`` lanes, so segments of up to ``MAX_SEGMENT``
columns fit (head_dim rows, and the groups of the Mamba-2 hybrids: ``intermediate_size // n_groups``
of 1024-8192). The backward holds about eleven registers per element across its row sum (the FP32
terms of dx and dz, dW, the raw fragments), so its lanes take ``HELD_ELEMS_PER_LANE`` elements; a
segment wider than one CTA of such lanes covers is split over a cluster of CTAs whose row sums meet
in distributed shared memory, as the plain kernels' wide rows do (``cluster_segment_tiling``).
Short segments share a CTA (``rows_per_cta``), as the plain short-row tilings do.

Like every config of the package, none depends on the number of rows T (batch invariance).
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

# Elements of each operand one lane holds (the forward holds x, z, the gate and w in 72-85 registers).
SEGMENT_ELEMS_PER_LANE = 16
MAX_SEGMENT = MAX_THREADS_PER_CTA * SEGMENT_ELEMS_PER_LANE
# Elements per lane of a backward that holds its terms across the row sum: 8 take 72-75 registers
# (sm_90a, bf16 H = 128), 16 took 136-168 (spilling under the 128-register cap).
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
# lanes of 8 elements, eight CTAs to a group of 8192, six CTAs on an SM. At groups of 6144 and 8192
# the backward ran at 0.90-0.91 of a device copy with 128, 0.88-0.90 with 256 (four CTAs of 2048
# columns) and 0.60-0.77 with 512, where one CTA of 512 lanes that held 16 elements each and read
# their rows twice ran at 0.67-0.87 (bf16, H200: evidence/gated-gpu-h200-2026-12-05/cluster_ab.json).
CLUSTER_CTA_THREADS = 128
# Threads of a CTA whose segments are short enough to share it (the plain forward's and the plain
# several-rows backward's CTA sizes).
FORWARD_CTA_THREADS = 128
BACKWARD_CTA_THREADS = 256


@dataclass(frozen=True)
class GatedConfig:
    """One gated kernel: the tiling of a segment, the ``min_blocks_per_mp`` register hint (128
    registers per thread at most) and, for the persistent backward, how many CTAs an SM holds (the
    host launches that many programs per SM and group)."""

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
    """Raise ValueError unless ``group_size`` divides H and a segment fits one CTA.

    Raises
    ------
    ValueError
        ``group_size`` not a divisor of ``hidden`` in [1, ``MAX_SEGMENT``].
    """
    if not 1 <= group_size <= MAX_SEGMENT or hidden % group_size:
        raise ValueError(
            f"group_size must divide hidden ({hidden}) and be in [1, {MAX_SEGMENT}], got {group_size}"
        )


def segment_tiling(segment: int, act_dtype: str, cta_threads: int, elems_per_lane: int) -> RowTiling:
    """Tile a segment of ``segment`` columns: vectors of 16 bytes when the segment allows (every group
    then starts vector-aligned too), at most ``elems_per_lane`` elements per lane in the fewest
    power-of-two lanes, and as many segments per CTA as fill ``cta_threads`` threads."""
    vec = vector_width(segment, dtype_bytes(act_dtype))
    vecs = -(-segment // vec)
    max_vpt = max(1, elems_per_lane // vec)
    lanes = min(MAX_THREADS_PER_CTA, 1 << max(0, math.ceil(math.log2(-(-vecs // max_vpt)))))
    return RowTiling(segment, vec, lanes, -(-vecs // lanes), 1, max(1, cta_threads // lanes))


def backward_smem_bytes(tiling: RowTiling, finish_cells: int) -> int:
    """Shared memory of one backward CTA: the row sums' two slots of warp sums and of the cluster's CTA
    sums, the FP32 tile in which several segments fold their dW, the cells of the dW finish in the
    launch (``finish_cells`` bytes, counted whether it runs or not) and the DSL's static kilobyte (an
    upper bound)."""
    reduction = 4 * 2 * tiling.rows_per_cta * (tiling.warps_per_row + tiling.cluster_n) + 64
    fold = 4 * tiling.rows_per_cta * tiling.cols_per_cta if tiling.rows_per_cta > 1 else 0
    return reduction + fold + finish_cells + SMEM_STATIC_PER_CTA + 256


@cache
def gated_forward_config(act_dtype: str, hidden: int, group_size: int) -> GatedConfig:
    """The gated forward's config (the same on every architecture: no rule has been measured to
    differ).

    Raises
    ------
    ValueError
        As ``check_segment``.
    """
    check_segment(hidden, group_size)
    tiling = segment_tiling(group_size, act_dtype, FORWARD_CTA_THREADS, SEGMENT_ELEMS_PER_LANE)
    return GatedConfig(tiling, tiling.min_ctas_per_sm, tiling.min_ctas_per_sm)


@cache
def gated_backward_config(arch: str, act_dtype: str, hidden: int, group_size: int) -> GatedConfig:
    """The gated backward's config for ``arch``: ``HELD_ELEMS_PER_LANE`` elements per lane (2-byte rows
    held to ``HELD_REGISTER_BUDGET`` registers, except rows of one segment off sm_90a), in one CTA
    where ``MAX_THREADS_PER_CTA`` lanes cover the segment, else over a cluster
    (``cluster_segment_tiling``); twice the forward's threads per CTA when segments are short (more
    bytes in flight per program); the L2 prefetch of later row tiles for wide segments
    (``PREFETCH_MAX_SEGMENTS_PER_CTA``); its residency for the persistent grid; and whether it sums
    its partial rows of dW in its own launch (``dw_finish``: the override choices ``dw_in_launch`` and
    ``cooperative`` of kind ``"gated_bwd"``; by default a ``dw_reduce`` launch follows).

    Raises
    ------
    ValueError
        As ``check_segment``.
    """
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
    """A segment wider than one CTA of held lanes covers, over a cluster: CTAs of
    ``CLUSTER_CTA_THREADS`` lanes of ``HELD_ELEMS_PER_LANE`` elements, as many as cover the segment
    (at most 8: ``MAX_SEGMENT`` columns), each holding its slice of the columns; the row sum meets
    through distributed shared memory as in the plain kernels' clusters (``common.row_sum``)."""
    vec = vector_width(segment, dtype_bytes(act_dtype))
    vecs_per_lane = max(1, HELD_ELEMS_PER_LANE // vec)
    cluster = -(-segment // (CLUSTER_CTA_THREADS * vecs_per_lane * vec))
    vecs = -(-segment // vec)
    lanes = 1 << max(0, math.ceil(math.log2(-(-vecs // (cluster * vecs_per_lane)))))
    return RowTiling(segment, vec, lanes, vecs_per_lane, cluster, 1)
