"""RMSNorm backward: dx in one pass, and per-CTA FP32 partial rows of the weight gradient.

Math, per row t (FP32 arithmetic, one rounding at the end):

    a    = g * (w + weight_offset)
    xhat = h * rstd                        (h: the saved x, or h_new in residual mode)
    c    = sum_j a_j * xhat_j / H
    dx   = round(rstd * (a - xhat * c) [+ g_residual])
    dW_partial[p] += g * xhat              (FP32 registers, over the rows that CTA row-group p visits)

Persistent grid: ``num_programs`` CTAs (times ``cluster_n`` along y); program b visits the row tiles
b, b + num_programs, ... -- a fixed partition for a given (T, num_programs). Each CTA loads w once into
registers and keeps one FP32 dW accumulator per element it owns; at the end every row group writes its
accumulator as one FP32 row of the workspace ``partials[num_programs * rows_per_cta, H_pad]``, which
``dw_reduce`` sums in a fixed order. No atomics anywhere.

Tiling (``config.backward_tiling``): ``threads_per_row`` lanes per row, ``vecs_per_thread`` vectors of
``vec`` elements (128-bit accesses when H allows), at most 64 bytes of each of g and h per thread so g,
h, w and the accumulator fit in registers; wide rows are split over a cluster of ``cluster_n`` CTAs whose
partial dot products meet in distributed shared memory (one cluster barrier per row, double-buffered).

Bytes moved: reads g, h (+ g_residual) and writes dx once: T*H*(3 or 4)*act_bytes, plus 4*T of rstd,
plus the partial rows (num_programs * rows_per_cta * H * 4, written here, read by dw_reduce).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .common import (
    allocate_reduction_buffers,
    broadcast_rows,
    column_predicate,
    copy_atom,
    leave_cluster,
    row_sum,
    row_tiled_copy,
    tile_shape,
)


class RMSNormBackward:
    """One compiled backward per (arch, dtypes, H, residual, weight_offset); T and the number of
    programs are runtime values."""

    def __init__(self, tiling, act_dtype, w_dtype, residual: bool, weight_offset: float):
        self.tiling = tiling
        self.act_dtype = act_dtype
        self.w_dtype = w_dtype
        self.residual = residual
        self.weight_offset = weight_offset

    @cute.jit
    def __call__(
        self,
        mG: cute.Tensor,
        mH: cute.Tensor,
        mW: cute.Tensor,
        mRstd: cute.Tensor,
        mGRes: cute.Tensor,
        mDX: cute.Tensor,
        mPartial: cute.Tensor,
        num_programs: Int32,
        stream,
    ):
        t = self.tiling
        self.kernel(mG, mH, mW, mRstd, mGRes, mDX, mPartial).launch(
            grid=[num_programs, t.cluster_n, 1],
            block=[t.threads_per_cta, 1, 1],
            cluster=[1, t.cluster_n, 1] if const_expr(t.cluster_n > 1) else None,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mG: cute.Tensor,
        mH: cute.Tensor,
        mW: cute.Tensor,
        mRstd: cute.Tensor,
        mGRes: cute.Tensor,
        mDX: cute.Tensor,
        mPartial: cute.Tensor,
    ):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        num_programs, _, _ = cute.arch.grid_dim()
        if const_expr(t.cluster_n == 1):
            rank = 0
        rows = mG.shape[0]
        num_tiles = cute.ceil_div(rows, t.rows_per_cta)

        smem = cutlass.utils.SmemAllocator()
        warp_sums, cta_sums = allocate_reduction_buffers(smem, t)

        tiler = tile_shape(t)
        thr = row_tiled_copy(self.act_dtype, t).get_slice(tidx)
        row_in_cta = tidx // t.threads_per_row
        lane_in_row = tidx % t.threads_per_row
        identity = cute.make_identity_tensor(mG.shape)
        tXc0 = thr.partition_S(cute.local_tile(identity, tiler, (0, rank)))
        pred = None
        if const_expr(not t.even):
            pred = column_predicate(tXc0, t.hidden)
        copy_act = partial(cute.copy, copy_atom(self.act_dtype, t.vec), pred=pred)

        # w once per CTA, widened to FP32 with the offset folded in. In wide_mode both w and the dW
        # accumulator live in this thread's own cells of shared memory (no barrier needed: no other
        # thread touches them), which keeps 128 registers per thread enough for 512-thread CTAs.
        tXgW = thr.partition_S(cute.local_tile(broadcast_rows(mW, t.rows_per_cta), tiler, (0, rank)))
        tXrWin = cute.make_rmem_tensor_like(tXgW)
        tXrWin.fill(0)
        cute.copy(copy_atom(self.w_dtype, t.vec), tXgW, tXrWin, pred=pred)
        tXrW = cute.make_rmem_tensor_like(tXc0, Float32)
        w = tXrWin.load().to(Float32)
        if const_expr(self.weight_offset != 0.0):
            w = w + Float32(self.weight_offset)
        tXrW.store(w)
        tXrDW = cute.make_rmem_tensor_like(tXc0, Float32)
        tXrDW.fill(0.0)
        tXW, tXDW = tXrW, tXrDW
        if const_expr(t.wide_mode):
            cta_tile = cute.make_ordered_layout(tiler, order=(1, 0))
            tXW = thr.partition_S(smem.allocate_tensor(Float32, cta_tile, byte_alignment=16))
            tXDW = thr.partition_S(smem.allocate_tensor(Float32, cta_tile, byte_alignment=16))
            cute.autovec_copy(tXrW, tXW)
            cute.autovec_copy(tXrDW, tXDW)

        tXrG = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrH = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrDX = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrGR = cute.make_rmem_tensor_like(tXc0, self.act_dtype)

        slot = Int32(0)
        for tile in cutlass.range(bidx, num_tiles, num_programs, unroll=1):
            row = tile * t.rows_per_cta + row_in_cta
            tXgG, tXgH, tXgDX = [
                thr.partition_S(cute.local_tile(m, tiler, (tile, rank))) for m in (mG, mH, mDX)
            ]
            # Rows past T contribute zeros, never stale registers.
            tXrG.fill(0)
            tXrH.fill(0)
            rstd = Float32(0.0)
            if row < rows:
                copy_act(tXgG, tXrG)
                copy_act(tXgH, tXrH)
                rstd = mRstd[row]
            if const_expr(self.residual):
                tXgGR = thr.partition_S(cute.local_tile(mGRes, tiler, (tile, rank)))
            if const_expr(self.residual and not t.wide_mode):
                # Issued with g and h so its latency overlaps the row sum.
                if row < rows:
                    copy_act(tXgGR, tXrGR)
            # Everything before the row sum is folded into the dot product and the dW accumulator,
            # and a, xhat are recomputed from the packed inputs afterwards: only the packed g, h, w and
            # the accumulator stay live across the barrier, which keeps wide rows out of local memory.
            g = tXrG.load().to(Float32)
            xhat = tXrH.load().to(Float32) * rstd
            tXDW.store(tXDW.load() + g * xhat)
            dot = row_sum(
                (g * tXW.load() * xhat).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                warp_sums, cta_sums, row_in_cta, lane_in_row, slot, t.threads_per_row, t.cluster_n,
            )
            c = dot / t.hidden
            if const_expr(t.wide_mode):
                if row < rows:
                    copy_act(tXgG, tXrG)
                    copy_act(tXgH, tXrH)
                    if const_expr(self.residual):
                        copy_act(tXgGR, tXrGR)
            xhat = tXrH.load().to(Float32) * rstd
            dx = (tXrG.load().to(Float32) * tXW.load() - xhat * c) * rstd
            if const_expr(self.residual):
                dx = dx + tXrGR.load().to(Float32)
            tXrDX.store(dx.to(self.act_dtype))
            if row < rows:
                copy_act(tXrDX, tXgDX)
            slot = slot ^ 1

        # Row group r of program b owns partial row b * rows_per_cta + r.
        tXgP = thr.partition_S(cute.local_tile(mPartial, tiler, (bidx, rank)))
        if const_expr(t.wide_mode):
            cute.autovec_copy(tXDW, tXrDW)
        cute.copy(copy_atom(Float32, t.vec), tXrDW, tXgP, pred=pred)
        leave_cluster(t.cluster_n)
