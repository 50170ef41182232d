"""Kernel configurations: the one place that decides how a row of H elements is tiled.

A configuration depends only on (architecture, dtypes, H) and never on the number of rows T, so a row's
reduction order -- and therefore its bits -- cannot change with the batch (batch invariance). T only
decides how many CTAs a launch uses.

Tiling vocabulary used by every kernel in this package:

* ``vec``: elements per vector access; 16 bytes of the activation dtype when H allows it (128-bit
  LDG/STG), otherwise the largest power of two dividing H (narrower, still coalesced).
* ``threads_per_row``: threads of one CTA that share a row; lane ``l`` of the row owns the vectors
  ``l, l + threads_per_row, ...`` of the CTA's column slice, so every warp access is contiguous.
* ``vecs_per_thread``: vectors each thread keeps in registers (the row lives on-chip, read once).
* ``cluster_n``: CTAs of a thread-block cluster that split one row into contiguous column slices and
  combine their partial sums through distributed shared memory (wide rows).
* ``rows_per_cta``: rows a CTA handles at once when rows are short (threads_per_row < 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

MAX_HIDDEN = 262144
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
MAX_CLUSTER = 16
MAX_THREADS_PER_CTA = 512
MIN_THREADS_PER_CTA = 128

REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 128
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the driver's per-CTA reserve
SMEM_STATIC_PER_CTA = 1024  # static shared memory the DSL gives every kernel (cuobjdump: SHARED 1024)
MAX_CTAS_PER_SM = 32
MAX_THREADS_PER_SM = 2048

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class RowTiling:
    """How one row is spread over lanes, vectors and cluster CTAs (see the module docstring)."""

    hidden: int
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    cluster_n: int
    rows_per_cta: int
    wide_mode: bool = False

    @property
    def threads_per_cta(self) -> int:
        return self.threads_per_row * self.rows_per_cta

    @property
    def cols_per_cta(self) -> int:
        """Columns of the tile one CTA covers (a multiple of vec, >= its share of H)."""
        return self.vec * self.threads_per_row * self.vecs_per_thread

    @property
    def min_ctas_per_sm(self) -> int:
        """Resident CTAs a kernel asks the compiler to allow: caps registers at 128 per thread."""
        return max(1, REGISTERS_PER_SM // (MAX_REGISTERS_PER_THREAD * self.threads_per_cta))

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def even(self) -> bool:
        """True when the tiles cover H exactly, so no column needs a bounds check."""
        return self.cols_per_cta * self.cluster_n == self.hidden

    def describe(self) -> str:
        return (
            f"vec={self.vec} tpr={self.threads_per_row} vpt={self.vecs_per_thread} "
            f"cluster={self.cluster_n} rows/cta={self.rows_per_cta}" + (" wide" if self.wide_mode else "")
        )


def vector_width(hidden: int, act_bytes: int) -> int:
    """Elements per vector access: 16 bytes when H is a multiple of that, else the largest fit."""
    return math.gcd(hidden, 16 // act_bytes)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_tiling(hidden: int, act_bytes: int, bytes_per_thread: int, target_vecs: int) -> RowTiling:
    """Tile a row so each thread keeps at most ``bytes_per_thread`` of it in registers.

    Lanes grow first (up to 256 per row, aiming at ``target_vecs`` vectors each so loads overlap), then
    the row is split over a cluster (up to 16 CTAs), then lanes grow again up to 512 per row (past that
    the compiler caps registers at 32 per thread). Only rows wider than 16 * 512 * 128 bytes exceed the
    budget.
    """
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be in [1, {MAX_HIDDEN}], got {hidden}")
    vec = vector_width(hidden, act_bytes)
    vecs = -(-hidden // vec)
    max_vpt = max(1, min(32, bytes_per_thread // (vec * act_bytes)))
    tpr = min(_pow2_ceil(-(-vecs // target_vecs)), 256)
    cluster = 1
    while -(-vecs // (tpr * cluster)) > max_vpt and cluster < MAX_CLUSTER:
        cluster *= 2
    while -(-vecs // (tpr * cluster)) > max_vpt and tpr < MAX_THREADS_PER_CTA:
        tpr *= 2
    # A cluster CTA must own at least one vector per lane, or peers would cover no columns.
    while cluster > 1 and tpr * (cluster // 2) >= vecs:
        cluster //= 2
    vpt = -(-vecs // (tpr * cluster))
    rows = max(1, MIN_THREADS_PER_CTA // tpr)
    return RowTiling(hidden, vec, tpr, vpt, cluster, rows)


@cache
def forward_tiling(hidden: int, act_dtype: str) -> RowTiling:
    """Forward: x (and residual) are staged in shared memory; 128 bytes of a row per thread (eight
    128-bit vectors) keeps a CTA's tile small enough for several CTAs per SM. A row that the
    power-of-two lane count covers only raggedly (H = 7168: 896 vectors over 256 lanes) gets the
    whole number of warps nearest to it that covers the row exactly (7 warps of 4 vectors): no
    column predicates and no idle lanes in the last pass (measured on the H200: 0.8-1.3% faster at
    7168; at 5120 the nearest exact cover, 10 warps of 2, measured the same as the ragged one; see
    perf/results/2026-11-30-h200-tiling-scans/scans.log)."""
    tiling = row_tiling(hidden, DTYPE_BYTES[act_dtype], bytes_per_thread=128, target_vecs=4)
    if tiling.even or tiling.cluster_n > 1 or tiling.threads_per_row < 128:
        return tiling
    return _nearest_exact_cover(tiling, max_vpt=tiling.vecs_per_thread) or tiling


@cache
def backward_tiling(hidden: int, act_dtype: str) -> RowTiling:
    """Backward: g and h are staged in shared memory (``backward_stages``), w sits there too, and each thread
    keeps an FP32 dW accumulator per element it owns in registers, so it holds half the forward's
    share of a row. In ``wide_mode`` (512 threads per CTA, so 128 registers
    per thread) the dW accumulator lives in shared memory and g, h are re-read after the row sum
    instead of being held across it (an L2 hit: the rows a cluster has in flight are a few MB).

    A row of at least 128 vectors that one CTA holds is spread over as many whole warps as cover
    it exactly with one or two vectors each (up to 16 warps): short per-thread work and many loads
    in flight per row hide the row-sum latency best. Measured on the H200 against the
    power-of-two tiling (2 vectors per lane): 1024 -> 4 warps x 1 (3.76 -> 4.02 TB/s), 7168 -> 14
    warps x 2 (3.69 -> 3.96); perf/results/2026-11-30-h200-tiling-scans/scans.log. Cluster tilings keep
    256 lanes of 4 vectors: 512 lanes of 2 measured slower at H = 32768-131072."""
    tiling = row_tiling(hidden, DTYPE_BYTES[act_dtype], bytes_per_thread=64, target_vecs=2)
    if tiling.threads_per_cta >= MAX_THREADS_PER_CTA:
        return replace(tiling, wide_mode=True)
    if tiling.cluster_n > 1 or tiling.hidden // tiling.vec < MIN_THREADS_PER_CTA:
        return tiling
    return _most_warps_exact_cover(tiling, max_vpt=2) or tiling


def _exact_covers(tiling: RowTiling, max_vpt: int, max_warps: int) -> list[RowTiling]:
    """Single-row tilings of whole warps that cover the row with no ragged tail, at most ``max_vpt``
    vectors per lane."""
    if tiling.hidden % tiling.vec:
        return []
    vecs = tiling.hidden // tiling.vec
    return [
        replace(tiling, threads_per_row=32 * warps, vecs_per_thread=vecs // (32 * warps), rows_per_cta=1)
        for warps in range(1, max_warps + 1)
        if vecs % (32 * warps) == 0 and vecs // (32 * warps) <= max_vpt
    ]


def _nearest_exact_cover(tiling: RowTiling, max_vpt: int) -> RowTiling | None:
    covers = _exact_covers(tiling, max_vpt, MAX_THREADS_PER_CTA // 32)
    return min(covers, key=lambda c: abs(c.threads_per_row - tiling.threads_per_row), default=None)


def _most_warps_exact_cover(tiling: RowTiling, max_vpt: int) -> RowTiling | None:
    """The exact cover with the most warps; 16 warps only with one vector per lane, because a
    512-thread CTA gets 64 registers (two CTAs per SM), which two vectors per lane overflow (the
    residual variant spills at H = 8192)."""
    covers = [
        c
        for c in _exact_covers(tiling, max_vpt, MAX_THREADS_PER_CTA // 32)
        if c.threads_per_row < MAX_THREADS_PER_CTA or c.vecs_per_thread == 1
    ]
    return covers[-1] if covers else None


def forward_min_ctas_per_sm(tiling: RowTiling, arch: str) -> int:
    """The forward's ``min_blocks_per_mp`` hint, 0 for none. On sm_90a the compiler's own register
    choice is best (64 registers let four 256-thread cluster CTAs share an SM); on Blackwell it
    squeezes some cluster variants to 64 registers and spills, so they get the 128-register cap."""
    if arch == "sm_90a" or tiling.cluster_n == 1:
        return 0
    return tiling.min_ctas_per_sm


def backward_smem_bytes(tiling: RowTiling, act_dtype: str, w_dtype: str, residual: bool, stages: int) -> int:
    """Shared memory of one backward CTA (``rmsnorm_bwd``), an upper bound: reduction slots, the w tile,
    one stage of g_residual, either ``stages`` stages of g and h or, in wide mode, the FP32 dW tile, and
    the DSL's static kilobyte. w's own dtype counts: under autocast w is FP32 next to bf16 rows, and
    its tile can decide whether two CTAs fit on an SM (bf16 H = 8192, residual)."""
    tile = tiling.rows_per_cta * tiling.cols_per_cta
    reduction = 4 * 2 * tiling.rows_per_cta * (tiling.warps_per_row + 1) + 64
    act_bytes = DTYPE_BYTES[act_dtype]
    staging = (1 if residual else 0) * tile * act_bytes
    staging += 4 * tile if tiling.wide_mode else stages * 2 * tile * act_bytes
    return reduction + DTYPE_BYTES[w_dtype] * tile + staging + SMEM_STATIC_PER_CTA + 256


def backward_stages(tiling: RowTiling, act_dtype: str, residual: bool) -> int:
    """Row tiles of g and h a staged backward CTA cycles through: 4 (three in flight while one is
    reduced) for plain rows one CTA holds, else 2. Measured on the H200, plain mode, T*H = 2^27
    (perf/results/2026-11-30-h200-stages-scan): 4 stages lift bf16 H = 8192 from 3.72 to 4.13 TB/s
    (its CTA now takes a whole SM: 128 KB of staging), fp32 H = 4096 4.00 -> 4.31, fp32 2048
    4.09 -> 4.30 and bf16 1024-2048 by about 1% (bf16 5120: 3.92 -> 3.96-4.07 in the scans, 3.88 in
    the sweep, so no reliable change). Exceptions, all measured slower
    with more stages: residual mode (its g_residual group, committed behind a tile's g and h, would
    force that tile early), cluster tilings (a CTA that has the SM to itself waits out every DSMEM
    row sum: H = 16384 4.05 -> 2.99 TB/s), and 16 warps of one 2-byte vector each (H = 4096: 3.84
    -> 3.76)."""
    if residual or tiling.wide_mode or tiling.cluster_n > 1:
        return 2
    one_2byte_vector_per_lane = tiling.vecs_per_thread == 1 and DTYPE_BYTES[act_dtype] == 2
    if tiling.threads_per_cta == MAX_THREADS_PER_CTA and one_2byte_vector_per_lane:
        return 2
    return 4


def backward_register_budget(tiling: RowTiling, arch: str) -> int:
    """Registers per backward thread: 128, or a lean budget when each thread owns at most two vectors,
    needs no column predicates and shares its CTA with at most one other row, so more CTAs fit on an
    SM to hide the per-row latency: 80, or 64 for 512-thread CTAs (two per SM rather than one).
    Narrower tilings spill under 80, and so do some sm_100a variants, which keep 128 (the lean
    budgets are tuned and measured on Hopper only)."""
    lean = tiling.vecs_per_thread <= 2 and tiling.even and tiling.rows_per_cta <= 2
    if not lean or arch != "sm_90a":
        return MAX_REGISTERS_PER_THREAD
    return 64 if tiling.threads_per_cta >= MAX_THREADS_PER_CTA else 80


def backward_min_ctas_per_sm(tiling: RowTiling, arch: str) -> int:
    """The ``min_blocks_per_mp`` hint that holds the backward to its register budget."""
    budget = backward_register_budget(tiling, arch)
    return max(1, REGISTERS_PER_SM // (budget * tiling.threads_per_cta))


def backward_ctas_per_sm(tiling: RowTiling, arch: str, act_dtype: str, w_dtype: str, residual: bool) -> int:
    """CTAs of the backward resident on one SM: registers, shared memory and thread slots all bound
    it. The persistent grid launches exactly this many per SM."""
    stages = backward_stages(tiling, act_dtype, residual)
    smem = backward_smem_bytes(tiling, act_dtype, w_dtype, residual, stages)
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA)
    by_threads = MAX_THREADS_PER_SM // tiling.threads_per_cta
    by_registers = backward_min_ctas_per_sm(tiling, arch)
    return max(1, min(by_registers, by_smem, by_threads, MAX_CTAS_PER_SM))


# Block-scaled FP8 recipes of the quantizing forward: block width along H and whether the scales are
# FP32 powers of two (else E8M0 bytes).
QUANT_RECIPES = {"mxfp8": (32, False), "1x128": (128, True)}
E4M3_MAX = 448.0
FP32_NAN_BITS = 0x7FC00000
FP32_BITS_OF_2_POW_M127 = 0x400000  # 2^-127, the smallest E8M0 value, is an FP32 subnormal


@cache
def quant_tiling(hidden: int, act_dtype: str, block: int) -> RowTiling:
    """The forward's tiling when its k-slices (threads_per_row * vec columns) and the quantization
    blocks nest; else (an exact cover of a non-power-of-two warp count) the power-of-two tiling, whose
    k-slices always nest with a power-of-two block."""
    tiling = forward_tiling(hidden, act_dtype)
    span = tiling.threads_per_row * tiling.vec
    if span % block == 0 or block % span == 0:
        return tiling
    return row_tiling(hidden, DTYPE_BYTES[act_dtype], bytes_per_thread=128, target_vecs=4)
