"""Building blocks shared by the RMSNorm kernels: tiled row copies and the fixed-order row sum.

Row sum (thread -> warp shuffle -> shared memory -> cluster DSMEM). The order of every addition is
fixed by the tiling alone, and every thread (of every CTA of a cluster) ends with the bitwise same
total, which is what makes the kernels deterministic and batch invariant:

1. each thread adds its own values in register order;
2. a butterfly (xor) shuffle over the row's lanes of a warp -- commutative pairings, so all lanes agree;
3. lane 0 of each warp stores its warp's sum in shared memory; after a CTA barrier every thread adds the
   row's warp sums in warp order;
4. with a cluster, thread 0 of each row publishes the CTA's sum, a cluster barrier (release/acquire)
   follows, and every thread adds the peers' sums in CTA-rank order through DSMEM loads.

Reduction buffers are double-buffered (``slot``), so a persistent loop needs one barrier per row: a
slot is written again only after the next barrier, which every reader of it has passed.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

COPY_BITS = 128
REDUCTION_SLOTS = 2


def copy_atom(dtype, vec: int):
    """A universal (LDG/STG) copy atom moving ``vec`` elements, at most 128 bits per instruction."""
    bits = min(COPY_BITS, vec * dtype.width)
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)


def row_tiled_copy(dtype, tiling):
    """Threads laid out (rows_per_cta, threads_per_row), row lanes fastest; each moves one vector."""
    thr_layout = cute.make_ordered_layout((tiling.rows_per_cta, tiling.threads_per_row), order=(1, 0))
    val_layout = cute.make_layout((1, tiling.vec))
    return cute.make_tiled_copy_tv(copy_atom(dtype, tiling.vec), thr_layout, val_layout)


def tile_shape(tiling):
    return (tiling.rows_per_cta, tiling.cols_per_cta)


def broadcast_rows(vector: cute.Tensor, rows: int) -> cute.Tensor:
    """View a length-H vector as (rows, H) with a zero row stride, so it tiles like a row block."""
    layout = cute.make_layout((rows, cute.size(vector.shape[0])), stride=(0, 1))
    return cute.make_tensor(vector.iterator, layout)


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
def load_from_peer(smem_ptr: cute.Pointer, rank, *, loc=None, ip=None) -> Float32:
    """Read an FP32 word at ``smem_ptr``'s offset in the shared memory of cluster CTA ``rank``."""
    remote = cute.arch.map_dsmem_ptr(smem_ptr, rank, loc=loc, ip=ip)
    address = Int32(remote.toint(loc=loc, ip=ip))
    return cute.arch.inline_ptx(
        "ld.shared::cluster.f32 {$w0}, [{$r0}];",
        write_only_types=[Float32],
        read_only_args=[address],
        loc=loc,
        ip=ip,
    )


def allocate_reduction_buffers(smem, tiling):
    """Per-slot warp sums and (for clusters) per-slot CTA sums read by the peers."""
    warp_sums = smem.allocate_tensor(
        Float32,
        cute.make_layout((REDUCTION_SLOTS, tiling.rows_per_cta, tiling.warps_per_row)),
        byte_alignment=16,
    )
    # Allocated even without a cluster: a None cannot be carried through a dynamic loop.
    cta_sums = smem.allocate_tensor(
        Float32, cute.make_layout((REDUCTION_SLOTS, tiling.rows_per_cta)), byte_alignment=16
    )
    return warp_sums, cta_sums


@cute.jit
def row_sum(
    val: Float32,
    warp_sums: cute.Tensor,
    cta_sums: cute.Tensor,
    row_in_cta: Int32,
    lane_in_row: Int32,
    slot: Int32,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
) -> Float32:
    """The sum of ``val`` over a row's lanes (and cluster CTAs), bitwise equal in every thread."""
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
        if lane_in_row == 0:
            cta_sums[slot, row_in_cta] = val
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        local = cta_sums.iterator + cute.crd2idx((slot, row_in_cta), cta_sums.layout)
        val = load_from_peer(local, 0)
        for rank in cutlass.range_constexpr(1, cluster_n):
            val = val + load_from_peer(local, rank)
    return val


@cute.jit
def leave_cluster(cluster_n: cutlass.Constexpr[int]):
    """A CTA may exit only after its cluster peers have read its shared memory."""
    if const_expr(cluster_n > 1):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
