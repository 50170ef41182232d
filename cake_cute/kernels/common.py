"""Building blocks shared by the RMSNorm kernels: tiled row copies and the fixed-order row sum.

Row sum (thread -> warp shuffle -> shared memory -> cluster DSMEM). The order of every addition is
fixed by the tiling alone, and every thread (of every CTA of a cluster) ends with the bitwise same
total, which is what makes the kernels deterministic and batch invariant:

1. each thread adds its own values in register order;
2. a butterfly (xor) shuffle over the row's lanes of a warp -- commutative pairings, so all lanes agree;
3. lane 0 of each warp stores its warp's sum in shared memory; after a CTA barrier every thread adds the
   row's warp sums in warp order;
4. with a cluster, the CTA's sum is pushed into cell [rank] of every peer's shared memory with
   ``st.async`` (by one lane per peer, or for a pair by lane 0), crediting the peer's transaction
   mbarrier; each CTA waits on its own mbarrier and adds the cells in rank order. No cluster-wide
   barrier per row, and none at exit: a CTA has received every push meant for it before it can leave.

Reduction buffers are double-buffered (``slot``), so a persistent loop needs one CTA barrier per row.
"""

from __future__ import annotations

import operator
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from .tiling import VECTOR_BYTES

COPY_BITS = 8 * VECTOR_BYTES
REDUCTION_SLOTS = 2
# Clusters of at least this many CTAs push a row's partial sum to their peers from as many lanes; pairs
# push from one lane (the A/B behind both: evidence/kernel-rules-h200-2026-12-01/cluster-push/).
PARALLEL_PUSH_CLUSTER = 4


class RowKernel:
    """What the forward and backward kernel classes share: their compile-time parameters (the config
    value from ``config``, the dtypes, the mode), the launch shape, where a thread sits in it, the
    thread's slice of a row tile and its copies, w loaded and widened to FP32 with the Gemma-style
    offset folded in, and the row sum with the kernel's tiling."""

    def __init__(self, config, act_dtype, w_dtype, residual: bool, weight_offset: float):
        self.config = config
        self.tiling = config.tiling
        self.act_dtype = act_dtype
        self.w_dtype = w_dtype
        self.residual = residual
        self.weight_offset = weight_offset

    def ctas_along_y(self) -> int:
        """CTAs of the grid along y: the cluster's, each holding a slice of the row's columns."""
        return self.tiling.cluster_n

    def launch_shape(self, ctas) -> dict:
        """Launch keywords for ``ctas`` row programs times ``ctas_along_y`` CTAs along y. The shared
        memory carveout is given explicitly so that compiling needs no GPU to look it up."""
        t = self.tiling
        return dict(
            grid=[ctas, self.ctas_along_y(), 1],
            block=[t.threads_per_cta, 1, 1],
            cluster=[1, t.cluster_n, 1] if t.cluster_n > 1 else None,
            min_blocks_per_mp=self.config.min_ctas_per_sm,
            preferred_smem_carveout=100,
        )

    @cute.jit
    def cta_position(self):
        """(the thread's index in its CTA, the CTA's row program along x, its index along y); the
        last is the constant 0 where the grid has one CTA along y (compiled in, never read)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, along_y, _ = cute.arch.block_idx()
        if const_expr(self.ctas_along_y() == 1):
            along_y = 0
        return tidx, bidx, along_y

    @cute.jit
    def thread_slice(self, shape, tidx, tile):
        """The thread's slice of the row tiled copy, its cells of the tile ``tile`` (row tile, column
        tile) of a ``shape`` tensor as coordinates (what register fragments are shaped like), the
        column predicate of its fragments (None where the tiles cover the row exactly), its row
        within the CTA and its lane in that row."""
        t = self.tiling
        thr = row_tiled_copy(self.act_dtype, t).get_slice(tidx)
        tXc = thr.partition_S(cute.local_tile(cute.make_identity_tensor(shape), tile_shape(t), tile))
        pred = None
        if const_expr(not t.covers_row_exactly):
            pred = column_predicate(tXc, t.hidden)
        return thr, tXc, pred, tidx // t.threads_per_row, tidx % t.threads_per_row

    def row_copy(self, pred):
        """Copy activation vectors between registers and memory, predicated on the columns (``pred``,
        or None). Bind it outside dynamic branches: a None captured into one would become an IR value."""
        return partial(cute.copy, copy_atom(self.act_dtype, self.tiling.vec), pred=pred)

    def staging_copy(self, pred):
        """``row_copy`` from global into shared memory (``staging_atom``)."""
        return partial(cute.copy, staging_atom(self.act_dtype, self.tiling.vec), pred=pred)

    def weight_cells(self, mW: cute.Tensor, thr, tiler, rank) -> cute.Tensor:
        """The thread's slice of w in global memory (w broadcast over the tile's rows), at cluster
        rank ``rank``."""
        w_rows = broadcast_rows(mW, self.tiling.rows_per_cta)
        return thr.partition_S(cute.local_tile(w_rows, tiler, (0, rank)))

    @cute.jit
    def load_weight(self, tXgW: cute.Tensor, pred) -> cute.Tensor:
        """The thread's slice of w (``weight_cells``) in registers, in w's dtype, zero past H."""
        tXrW = cute.make_rmem_tensor_like(tXgW)
        tXrW.fill(0)
        cute.copy(copy_atom(self.w_dtype, self.tiling.vec), tXgW, tXrW, pred=pred)
        return tXrW

    @cute.jit
    def row_total(self, val: Float32, buffers, row_in_cta, lane_in_row, slot, phase) -> Float32:
        """``row_sum`` of ``val`` over the thread's row with this kernel's tiling, ``buffers`` the
        reduction's (warp sums, CTA sums, mbarriers)."""
        t = self.tiling
        return row_sum(val, *buffers, row_in_cta, lane_in_row, slot, phase, t.threads_per_row, t.cluster_n)

    @cute.jit
    def row_rstd(self, h: cute.TensorSSA, buffers, row_in_cta, lane_in_row, slot, eps) -> Float32:
        """1 / sqrt(mean(h^2) + eps) of the thread's row (a gated kernel's: of its segment), ``buffers``
        the reduction's (warp sums, CTA sums, mbarriers) and ``slot`` the one this row uses."""
        sum_sq = self.row_total(sum_of_squares(h), buffers, row_in_cta, lane_in_row, slot, Int32(0))
        return cute.math.rsqrt(sum_sq / self.tiling.hidden + eps)

    @cute.jit
    def widen_weight(self, w: cute.TensorSSA) -> cute.TensorSSA:
        w = w.to(Float32)
        if const_expr(self.weight_offset != 0.0):
            # FP32 add, so (offset + w) is not rounded through w's dtype.
            w = w + Float32(self.weight_offset)
        return w


def copy_atom(dtype, vec: int):
    """A universal (LDG/STG) copy atom moving ``vec`` elements, at most 128 bits per instruction."""
    bits = min(COPY_BITS, vec * dtype.width)
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)


def staging_atom(dtype, vec: int):
    """Global -> shared copies: cp.async (the load holds no registers while in flight, so a CTA can
    have its whole tile in flight) for 4-, 8- and 16-byte vectors; narrower ones load and store."""
    bits = min(COPY_BITS, vec * dtype.width)
    if bits >= 32:
        return cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), dtype, num_bits_per_copy=bits)
    return copy_atom(dtype, vec)


def allocate_tile(smem, dtype, tiling, slots: int = 1):
    """A (rows_per_cta, cols_per_cta, slots) shared-memory tile, row-major within a slot."""
    shape = (tiling.rows_per_cta, tiling.cols_per_cta, slots)
    return smem.allocate_tensor(dtype, cute.make_ordered_layout(shape, order=(1, 0, 2)), byte_alignment=16)


def row_tiled_copy(dtype, tiling):
    """Threads laid out (rows_per_cta, threads_per_row), row lanes fastest; each moves one vector."""
    thr_layout = cute.make_ordered_layout((tiling.rows_per_cta, tiling.threads_per_row), order=(1, 0))
    val_layout = cute.make_layout((1, tiling.vec))
    return cute.make_tiled_copy_tv(copy_atom(dtype, tiling.vec), thr_layout, val_layout)


@cute.jit
def approx_reciprocal(values: cute.TensorSSA) -> cute.TensorSSA:
    """1 / v of each FP32 value by rcp.approx: one MUFU instruction each, within one FP32 unit of the
    correctly rounded reciprocal, rather than an IEEE division's instruction sequence (whose slow-path
    call also holds registers across every use)."""
    cells = cute.make_rmem_tensor(values.shape, Float32)
    cells.store(values)
    for i in cutlass.range_constexpr(cute.size(cells)):
        cells[i] = cute.arch.rcp_approx(cells[i])
    return cells.load()


@cute.jit
def sum_of_squares(h: cute.TensorSSA) -> Float32:
    """sum_j h_j^2 of the thread's values as one chain of FMAs in element order (h_0^2 rounded, then
    each product added unrounded). Spelled out rather than a reduce of h * h: whether the compiler fuses
    such products into the sum depends on the rest of the kernel (in FP32 the statistics kernel, which
    has no other use of h, got its products rounded apart from the forward's), and every kernel that
    computes a row's rstd must round it the same way for the rstd to be bitwise one value."""
    cells = cute.make_rmem_tensor(h.shape, Float32)
    cells.store(h)
    total = Float32(0.0)
    for i in cutlass.range_constexpr(cute.size(cells)):
        total = cute.math.fma(cells[i], cells[i], total)
    return total


def tile_shape(tiling):
    return (tiling.rows_per_cta, tiling.cols_per_cta)


def broadcast_rows(vector: cute.Tensor, rows: int) -> cute.Tensor:
    """View a length-H vector as (rows, H) with a zero row stride, so it tiles like a row block."""
    layout = cute.make_layout((rows, cute.size(vector.shape[0])), stride=(0, 1))
    return cute.make_tensor(vector.iterator, layout)


def global_row(m: cute.Tensor, row, hidden: int) -> cute.Tensor:
    """Row ``row`` of a row-major global tensor whose rows all start ``VECTOR_BYTES``-aligned (the
    padded FP32 partial rows of dW) as a length-``hidden`` vector."""
    start = (m.iterator + cute.crd2idx((row, 0), m.layout)).toint()
    pointer = cute.make_ptr(m.element_type, start, cute.AddressSpace.gmem, assumed_align=VECTOR_BYTES)
    return cute.make_tensor(pointer, cute.make_layout((hidden,)))


def global_vector(m: cute.Tensor, row, col, width: int) -> cute.Tensor:
    """Cells (row, col .. col + width - 1) of a row-major global tensor as a tensor of their own,
    aligned to its whole width (the caller guarantees the alignment and that the cells exist)."""
    dtype = m.element_type
    start = (m.iterator + cute.crd2idx((row, col), m.layout)).toint()
    pointer = cute.make_ptr(dtype, start, cute.AddressSpace.gmem, assumed_align=width * dtype.width // 8)
    return cute.make_tensor(pointer, cute.make_layout(width))


@cute.jit
def prefetch_to_l2(m: cute.Tensor, row, col, count: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int]):
    """Ask the L2 for ``count`` elements of row ``row`` of ``m`` from column ``col`` on (clipped to H),
    with one bulk prefetch (no registers held, nothing to wait for)."""
    if col < hidden:
        elems = cutlass.min(Int32(count), Int32(hidden) - col)
        start = (m.iterator + cute.crd2idx((row, col), m.layout)).toint()
        cute.arch.inline_ptx(
            "cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
            read_only_args=[cutlass.Int64(start), elems * (m.element_type.width // 8)],
        )


@cute.jit
def column_predicate(coords: cute.Tensor, hidden: Int32) -> cute.Tensor:
    """One flag per vector of a thread's fragment: does the vector start inside the row?

    H is a multiple of the vector width, so a vector is either wholly inside or wholly outside."""
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(coords, mode=[0, 1]), cute.size(coords, mode=[1]), cute.size(coords, mode=[2])),
            stride=(cute.size(coords, mode=[2]), 0, 1),
        ),
        cutlass.Boolean,
    )
    for v in cutlass.range_constexpr(pred.shape[0]):
        for k in cutlass.range_constexpr(pred.shape[2]):
            pred[v, 0, k] = cute.elem_less(coords[(0, v), 0, k][1], hidden)
    return pred


@dsl_user_op
def push_to_peer(val: Float32, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, rank, *, loc=None, ip=None):
    """Store ``val`` at ``smem_ptr``'s offset in cluster CTA ``rank`` and credit its 4 bytes to that
    CTA's mbarrier at ``mbar_ptr``'s offset (st.async: no round trip, no cluster-wide barrier)."""
    remote_val = cute.arch.map_dsmem_ptr(smem_ptr, rank, loc=loc, ip=ip)
    remote_bar = cute.arch.map_dsmem_ptr(mbar_ptr, rank, loc=loc, ip=ip)
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
        read_only_args=[
            Int32(remote_val.toint(loc=loc, ip=ip)),
            Float32(val),
            Int32(remote_bar.toint(loc=loc, ip=ip)),
        ],
        loc=loc,
        ip=ip,
    )


def allocate_reduction_buffers(smem, tiling):
    """Per-slot warp sums; for clusters, per-slot (row, rank) CTA sums pushed by every peer and one
    transaction mbarrier per slot (allocated, unused, without a cluster: a dynamic loop cannot carry
    a None)."""
    warp_sums = smem.allocate_tensor(
        Float32,
        cute.make_layout((REDUCTION_SLOTS, tiling.rows_per_cta, tiling.warps_per_row)),
        byte_alignment=16,
    )
    cta_sums = smem.allocate_tensor(
        Float32,
        cute.make_layout((REDUCTION_SLOTS, tiling.rows_per_cta, tiling.cluster_n)),
        byte_alignment=16,
    )
    mbars = smem.allocate_array(cutlass.Int64, num_elems=REDUCTION_SLOTS)
    return warp_sums, cta_sums, mbars


@cute.jit
def init_cluster_reduction(mbars: cute.Pointer, cluster_n: cutlass.Constexpr[int]):
    """Initialise the slots' mbarriers and make sure every peer's are initialised before anyone pushes
    (one cluster barrier per kernel, at the start)."""
    if const_expr(cluster_n > 1):
        if cute.arch.thread_idx()[0] == 0:
            for slot in cutlass.range_constexpr(REDUCTION_SLOTS):
                cute.arch.mbarrier_init(mbars + slot, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()


@cute.jit
def row_sum(
    val: Float32,
    warp_sums: cute.Tensor,
    cta_sums: cute.Tensor,
    mbars: cute.Pointer,
    row_in_cta: Int32,
    lane_in_row: Int32,
    slot: Int32,
    phase: Int32,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
) -> Float32:
    """The sum of ``val`` over a row's lanes (and cluster CTAs), bitwise equal in every thread.

    ``slot`` alternates between consecutive calls; ``phase`` is the parity of the slot's use count.
    A slot's cells are pushed again only after every CTA has read them: a peer's next push to a slot
    needs this CTA's push of the following row, which comes after this CTA's read."""
    warps_per_row = max(1, threads_per_row // cute.arch.WARP_SIZE)
    val = cute.arch.warp_reduction(
        val, operator.add, threads_in_group=min(threads_per_row, cute.arch.WARP_SIZE)
    )
    if const_expr(warps_per_row > 1):
        if cute.arch.lane_idx() == 0:
            warp_sums[slot, row_in_cta, lane_in_row // cute.arch.WARP_SIZE] = val
        cute.arch.barrier()
        val = warp_sums[slot, row_in_cta, 0]
        for w in cutlass.range_constexpr(1, warps_per_row):
            val = val + warp_sums[slot, row_in_cta, w]
    if const_expr(cluster_n > 1):
        rank = cute.arch.block_idx_in_cluster()
        mbar = mbars + slot
        if cute.arch.thread_idx()[0] == 0:
            rows_per_cta = cute.size(cta_sums, mode=[1])
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, rows_per_cta * cluster_n * 4)
        # From PARALLEL_PUSH_CLUSTER CTAs on, lane p of the row pushes to peer p, so the remote stores
        # leave at once; in a pair, lane 0 pushes both (each measured faster in its range).
        pushers = cluster_n if const_expr(cluster_n >= PARALLEL_PUSH_CLUSTER) else 1
        if lane_in_row < pushers:
            cell = cta_sums.iterator + cute.crd2idx((slot, row_in_cta, rank), cta_sums.layout)
            for peer in cutlass.range_constexpr(cluster_n // pushers):
                push_to_peer(val, cell, mbar, peer if const_expr(pushers == 1) else lane_in_row)
        cute.arch.mbarrier_wait(mbar, phase)
        val = cta_sums[slot, row_in_cta, 0]
        for peer in cutlass.range_constexpr(1, cluster_n):
            val = val + cta_sums[slot, row_in_cta, peer]
    return val
