"""Row tilings: how a row of H elements is spread over lanes, vectors and cluster CTAs, and the GPU limits
that bound it.

A tiling depends only on (dtype, H), never on T, so a row's reduction order, and therefore its bits,
cannot change with the batch (batch invariance). The vocabulary every kernel uses:

* ``vec``: elements per vector access; 16 bytes when H allows it, else the largest power of two
  dividing H (narrower, still coalesced).
* ``threads_per_row``: threads of one CTA that share a row; lane ``l`` owns vectors ``l, l +
  threads_per_row, ...`` of the CTA's columns, so every warp access is contiguous.
* ``vecs_per_thread``: vectors each thread keeps in registers (the row is read once).
* ``cluster_n``: CTAs of a cluster that split one row into column slices and combine their partial
  sums through distributed shared memory (wide rows).
* ``rows_per_cta``: rows a CTA handles at once when rows are short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from ..vocab import dtype_bytes

MAX_HIDDEN = 262144
VECTOR_BYTES = 16  # the widest global access of one thread: a 128-bit vector
MAX_CLUSTER = 16
MAX_THREADS_PER_CTA = 512
MIN_THREADS_PER_CTA = 128

REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 128
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the driver's per-CTA reserve
SMEM_STATIC_PER_CTA = 1024  # static shared memory the DSL gives every kernel (cuobjdump: SHARED 1024)
MAX_CTAS_PER_SM = 32
# Rows of at most this many vectors are short (``RowTiling.is_short_row``).
SHORT_ROW_VECTORS = 32
MAX_THREADS_PER_SM = 2048


@dataclass(frozen=True)
class RowTiling:
    """How one row is spread over lanes, vectors and cluster CTAs (see the module docstring)."""

    hidden: int
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    cluster_n: int
    rows_per_cta: int

    @property
    def threads_per_cta(self) -> int:
        return self.threads_per_row * self.rows_per_cta

    @property
    def cols_per_cta(self) -> int:
        """Columns of the tile one CTA covers (a multiple of vec, >= its share of H)."""
        return self.vec * self.threads_per_row * self.vecs_per_thread

    @property
    def min_ctas_per_sm(self) -> int:
        """Resident CTAs a kernel asks the compiler to allow, capping registers at 128 per thread."""
        return max(1, REGISTERS_PER_SM // (MAX_REGISTERS_PER_THREAD * self.threads_per_cta))

    @property
    def is_short_row(self) -> bool:
        """A row of at most ``SHORT_ROW_VECTORS`` vectors (per-head q/k norms), tiled by rules of its own."""
        return -(-self.hidden // self.vec) <= SHORT_ROW_VECTORS

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def covers_row_exactly(self) -> bool:
        """True when the tiles cover H exactly, so no column needs a bounds check."""
        return self.cols_per_cta * self.cluster_n == self.hidden

    def describe(self) -> str:
        return (
            f"vec={self.vec} tpr={self.threads_per_row} vpt={self.vecs_per_thread} "
            f"cluster={self.cluster_n} rows/cta={self.rows_per_cta}"
        )


def vector_width(hidden: int, act_bytes: int) -> int:
    """Elements per vector access: 16 bytes when H is a multiple of that, else the largest fit."""
    return math.gcd(hidden, VECTOR_BYTES // act_bytes)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_tiling(hidden: int, act_bytes: int, bytes_per_thread: int, target_vecs: int) -> RowTiling:
    """Tile a row within ``bytes_per_thread`` per thread: lanes grow to 256, then a cluster of up to 16
    CTAs, then lanes to 512 (beyond, the compiler caps registers at 32)."""
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
    """Forward: x (and residual) staged in shared memory, 128 bytes of a row per thread, so several CTAs
    share an SM. A row the power-of-two lane count covers raggedly gets the nearest whole number of
    warps that covers it exactly (H = 7168: 7 warps of 4 vectors): no column predicates, no idle lanes;
    measured faster at the training shapes."""
    tiling = row_tiling(hidden, dtype_bytes(act_dtype), bytes_per_thread=128, target_vecs=4)
    if tiling.is_short_row:
        return _short_row_forward_tiling(tiling, dtype_bytes(act_dtype))
    if tiling.covers_row_exactly or tiling.cluster_n > 1 or tiling.threads_per_row < 128:
        return tiling
    return _nearest_exact_cover(tiling, max_vpt=tiling.vecs_per_thread) or tiling


def _short_row_forward_tiling(tiling: RowTiling, act_bytes: int) -> RowTiling:
    """Short rows take two vectors per lane in twice the lanes where that covers the row exactly: twice
    the loads in flight, measured to reach the device copy's speed."""
    short = row_tiling(tiling.hidden, act_bytes, bytes_per_thread=128, target_vecs=2)
    return short if short.covers_row_exactly else tiling


@cache
def backward_tiling(hidden: int, act_dtype: str, residual: bool = False) -> RowTiling:
    """Backward: g, h and w are staged in shared memory and each thread keeps an FP32 dW accumulator per
    element, so it holds half the forward's share of a row; a 512-thread tiling is kept (dW then lives in
    shared memory).

    A row of at least 128 vectors one CTA holds is spread over as many whole warps as cover it exactly
    with one or two vectors each (up to 16): short per-thread work and many loads in flight hide the
    row-sum latency best. Cluster tilings keep 256 lanes of 4 vectors, except FP32 rows over 4 or 8 CTAs
    (H = 16384, 32768), whose lanes hold 8 vectors in half the lanes, where that measured faster; not for
    ragged covers, whose column predicates would spill. Rows of fewer than 128 vectors:
    ``_several_rows_backward_tiling``."""
    tiling = row_tiling(hidden, dtype_bytes(act_dtype), bytes_per_thread=64, target_vecs=2)
    if tiling.cluster_n == 1 and tiling.hidden // tiling.vec < MIN_THREADS_PER_CTA:
        return _several_rows_backward_tiling(tiling, act_dtype, residual)
    fp32_cluster = act_dtype == "fp32" and tiling.cluster_n in (4, 8) and tiling.vecs_per_thread == 4
    if fp32_cluster and tiling.covers_row_exactly:
        return replace(tiling, threads_per_row=tiling.threads_per_row // 2, vecs_per_thread=8)
    if tiling.threads_per_cta >= MAX_THREADS_PER_CTA or tiling.cluster_n > 1:
        return tiling
    return _most_warps_exact_cover(tiling, max_vpt=2) or tiling


def _several_rows_backward_tiling(tiling: RowTiling, act_dtype: str, residual: bool) -> RowTiling:
    """Rows of fewer than 128 vectors: 256 threads per CTA, measured faster or equal, except 2-byte rows
    in residual mode, whose ring and g_residual tile keep 128."""
    if residual and dtype_bytes(act_dtype) == 2:
        return tiling
    return replace(tiling, rows_per_cta=2 * tiling.rows_per_cta)


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
    """The exact cover with the most warps; 16 warps only with one vector per lane, since a 512-thread
    CTA gets 64 registers, which two vectors per lane overflow."""
    covers = [
        c
        for c in _exact_covers(tiling, max_vpt, MAX_THREADS_PER_CTA // 32)
        if c.threads_per_row < MAX_THREADS_PER_CTA or c.vecs_per_thread == 1
    ]
    return covers[-1] if covers else None
