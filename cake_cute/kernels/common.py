"""Building blocks shared by the RMSNorm kernels: tiled row copies and the fixed-order row sum.

Row sum (thread -> warp shuffle -> shared memory -> cluster DSMEM). The order of every addition is
fixed by the tiling alone, and every thread ends with the bitwise same total, which makes the kernels
deterministic and batch invariant:

1. each thread adds its own values in register order;
2. a butterfly (xor) shuffle over the row's lanes of a warp, so all lanes agree;
3. lane 0 of each warp stores its warp's sum in shared memory; after a CTA barrier every thread adds
   the warp sums in warp order;
4. with a cluster, the CTA's sum is pushed into cell [rank] of every peer's shared memory with
   ``st.async``, crediting the peer's transaction mbarrier; each CTA waits on its own mbarrier and adds
   the cells in rank order. No cluster-wide barrier per row, nor at exit.

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
# push from one lane (each measured faster in its range).
PARALLEL_PUSH_CLUSTER = 4


class RowKernel:
    """What the forward and backward kernels share: parameters, launch shape, a thread's slice of a row
    tile, w widened with the offset folded in, and the row sum."""

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
        """Launch keywords for ``ctas`` row programs; the explicit carveout lets compiles run without a
        GPU."""
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
        """(thread index in its CTA, row program along x, index along y: 0 without a cluster)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, along_y, _ = cute.arch.block_idx()
        if const_expr(self.ctas_along_y() == 1):
            along_y = 0
        return tidx, bidx, along_y

    @cute.jit
    def thread_slice(self, shape, tidx, tile):
        """The thread's slice of the row copy, its cells of tile ``tile`` as coordinates, the column predicate
        (None for exact covers), its row in the CTA and its lane in the row."""
        t = self.tiling
        thr = row_tiled_copy(self.act_dtype, t).get_slice(tidx)
        tXc = thr.partition_S(cute.local_tile(cute.make_identity_tensor(shape), tile_shape(t), tile))
        pred = None
        if const_expr(not t.covers_row_exactly):
            pred = column_predicate(tXc, t.hidden)
        return thr, tXc, pred, tidx // t.threads_per_row, tidx % t.threads_per_row

    def row_copy(self, pred):
        """Copy activation vectors between registers and memory, predicated on ``pred``; bind it outside
        dynamic branches, where a captured None would become an IR value."""
        return partial(cute.copy, copy_atom(self.act_dtype, self.tiling.vec), pred=pred)

    def staging_copy(self, pred):
        return partial(cute.copy, staging_atom(self.act_dtype, self.tiling.vec), pred=pred)

    def weight_cells(self, mW: cute.Tensor, thr, tiler, rank) -> cute.Tensor:
        """The thread's slice of w in global memory (broadcast over rows), at cluster rank ``rank``."""
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
        """``row_sum`` of ``val`` over the thread's row with this kernel's tiling."""
        t = self.tiling
        return row_sum(val, *buffers, row_in_cta, lane_in_row, slot, phase, t.threads_per_row, t.cluster_n)

    @cute.jit
    def row_rstd(self, h: cute.TensorSSA, buffers, row_in_cta, lane_in_row, slot, eps) -> Float32:
        """1 / sqrt(mean(h^2) + eps) of the thread's row (or segment)."""
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
    """Global -> shared copies: cp.async for 4-, 8- and 16-byte vectors, else load and store."""
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
    """1 / v of each FP32 value by rcp.approx (one MUFU op, within one FP32 unit), where an IEEE
    division's slow path holds registers across every use."""
    cells = cute.make_rmem_tensor(values.shape, Float32)
    cells.store(values)
    for i in cutlass.range_constexpr(cute.size(cells)):
        cells[i] = cute.arch.rcp_approx(cells[i])
    return cells.load()


@cute.jit
def sum_of_squares(h: cute.TensorSSA) -> Float32:
    """sum_j h_j^2 as one chain of FMAs in element order, spelled out so every kernel rounds a row's
    rstd alike whatever the compiler would fuse."""
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
    """Row ``row`` of a global tensor whose rows start vector-aligned, as a length-``hidden`` vector."""
    start = (m.iterator + cute.crd2idx((row, 0), m.layout)).toint()
    pointer = cute.make_ptr(m.element_type, start, cute.AddressSpace.gmem, assumed_align=VECTOR_BYTES)
    return cute.make_tensor(pointer, cute.make_layout((hidden,)))


def global_vector(m: cute.Tensor, row, col, width: int) -> cute.Tensor:
    """Cells (row, col .. col + width - 1) of a global tensor as a tensor aligned to its width."""
    dtype = m.element_type
    start = (m.iterator + cute.crd2idx((row, col), m.layout)).toint()
    pointer = cute.make_ptr(dtype, start, cute.AddressSpace.gmem, assumed_align=width * dtype.width // 8)
    return cute.make_tensor(pointer, cute.make_layout(width))


@cute.jit
def prefetch_to_l2(m: cute.Tensor, row, col, count: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int]):
    """One bulk L2 prefetch of ``count`` elements of row ``row`` from column ``col`` (clipped to H)."""
    if col < hidden:
        elems = cutlass.min(Int32(count), Int32(hidden) - col)
        start = (m.iterator + cute.crd2idx((row, col), m.layout)).toint()
        cute.arch.inline_ptx(
            "cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
            read_only_args=[cutlass.Int64(start), elems * (m.element_type.width // 8)],
        )


@cute.jit
def column_predicate(coords: cute.Tensor, hidden: Int32) -> cute.Tensor:
    """One flag per vector of a thread's fragment: does it start inside the row?"""
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
    """Store ``val`` in cluster CTA ``rank``'s shared memory and credit its 4 bytes to that CTA's mbarrier
    (st.async)."""
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
    """Per-slot warp sums and, for clusters, per-slot CTA sums and mbarriers (allocated without one too:
    a dynamic loop cannot carry a None)."""
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
    """Initialise the slots' mbarriers, and make every peer's initialised before anyone pushes."""
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
    """The sum of ``val`` over a row's lanes and cluster CTAs, bitwise equal in every thread; ``slot``
    alternates between calls, ``phase`` is its use parity."""
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
        # leave at once; in a pair, lane 0 pushes both.
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
