"""RMSNorm forward, optionally fused with the residual add, in one pass over HBM.

Math, per row t of H elements (FP32 arithmetic, one rounding per output):

    h    = round(x + residual)                 (residual mode; h_new = h is written out)
    rstd = 1 / sqrt(sum_j h_j^2 / H + eps)     (written as FP32 [T])
    y    = round(h * rstd * (w + weight_offset))

Tiling (``config.forward_config``): a CTA holds ``rows_per_cta`` rows; ``threads_per_row`` lanes
share a row, each owning ``vecs_per_thread`` vectors of ``vec`` elements (128-bit accesses when H
allows), up to 128 bytes of row per thread. x (and residual) are staged in shared memory with
cp.async, so the whole tile is in flight without holding registers; each thread reads back only the
cells it staged, so no barrier is needed. Rows too wide for one CTA are split over a cluster of up to
16 CTAs that add their partial sums through distributed shared memory. The grid is
(ceil(T / rows_per_cta), cluster_n). ``normalize`` ends with the FP32 normalized tile in registers;
the epilogue rounds and stores it, or ``rmsnorm_fwd_quant``'s quantizes it.

Bytes moved: reads x (+ residual) once and w once per CTA (an L2 hit after the first), writes y
(+ h_new) once and 4 bytes of rstd per row: T*H*(2 or 4)*act_bytes + 4*T from HBM.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .common import (
    RowKernel,
    allocate_reduction_buffers,
    allocate_tile,
    copy_atom,
    init_cluster_reduction,
    tile_shape,
)


class NormalizedTile(NamedTuple):
    """What ``normalize`` leaves for an epilogue: the FP32 values, their shape, a store and the place."""

    y: cute.TensorSSA  # FP32 values
    like: cute.Tensor  # the thread's slice of x in global memory (its fragment layout)
    thr: object  # the thread's slice of the tiled copy
    tiler: tuple
    bidx: Int32
    rank: Int32
    row: Int32
    rows: Int32
    pred: object  # column predicate per vector, or None when the tiles cover H exactly
    row_in_cta: Int32
    lane_in_row: Int32


class RMSNormForward(RowKernel):
    """One compiled forward per (arch, dtypes, H, residual, weight_offset); T is a runtime value.
    Quantizing epilogues override ``epilogue`` and ``__call__``."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mRes: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mHOut: cute.Tensor,
        mRstd: cute.Tensor,
        eps: Float32,
        stream,
    ):
        self.launch(mX, mRes, mW, mY, mHOut, mRstd, None, None, eps, stream)

    @cute.jit
    def launch(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps, stream):
        ctas = cute.ceil_div(mX.shape[0], self.tiling.rows_per_cta)
        self.kernel(mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps).launch(
            **self.launch_shape(ctas), stream=stream
        )

    @cute.kernel
    def kernel(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps: Float32):
        smem = cutlass.memory.SmemAllocator()
        tile = self.normalize(smem, mX, mRes, mW, mHOut, mRstd, eps)
        self.epilogue(smem, tile, mY, mQ, mScale)

    @cute.jit
    def epilogue(self, smem, tile: NormalizedTile, mY: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor):
        self.store_rows(tile, tile.y.to(self.act_dtype), mY)

    @cute.jit
    def store_rows(self, tile: NormalizedTile, values: cute.TensorSSA, mOut: cute.Tensor):
        """Store a fragment shaped like the tile's (``values``, in ``mOut``'s dtype) into its rows."""
        tXgO = tile.thr.partition_S(cute.local_tile(mOut, tile.tiler, (tile.bidx, tile.rank)))
        tXrO = cute.make_rmem_tensor_like(tXgO)
        tXrO.store(values)
        if tile.row < tile.rows:
            cute.copy(copy_atom(mOut.element_type, self.tiling.vec), tXrO, tXgO, pred=tile.pred)

    @cute.jit
    def widen(self, frag: cute.Tensor) -> cute.TensorSSA:
        """A register fragment of x, residual, h or w as FP32 values."""
        return frag.load().to(Float32)

    @cute.jit
    def normalize(
        self,
        smem,
        mX: cute.Tensor,
        mRes: cute.Tensor,
        mW: cute.Tensor,
        mHOut: cute.Tensor,
        mRstd: cute.Tensor,
        eps: Float32,
    ) -> NormalizedTile:
        """Stage the tile, write h_new and rstd, and return the FP32 normalized values."""
        t = self.tiling
        tidx, bidx, rank = self.cta_position()
        rows = mX.shape[0]

        warp_sums, cta_sums, mbars = allocate_reduction_buffers(smem, t)
        sX = allocate_tile(smem, self.act_dtype, t)[None, None, 0]

        tiler = tile_shape(t)
        thr, tXc, pred, row_in_cta, lane_in_row = self.thread_slice(mX.shape, tidx, (bidx, rank))
        row = tXc[0][0]
        copy_act, async_copy = self.row_copy(pred), self.staging_copy(pred)

        tXgX = thr.partition_S(cute.local_tile(mX, tiler, (bidx, rank)))
        tXsX = thr.partition_D(sX)
        if const_expr(self.residual):
            sR = allocate_tile(smem, self.act_dtype, t)[None, None, 0]
            tXsR = thr.partition_D(sR)
            tXgR, tXgH = [thr.partition_S(cute.local_tile(m, tiler, (bidx, rank))) for m in (mRes, mHOut)]
        if row < rows:
            async_copy(tXgX, tXsX)
            if const_expr(self.residual):
                async_copy(tXgR, tXsR)
        cute.arch.cp_async_commit_group()
        init_cluster_reduction(mbars, t.cluster_n)

        # w's load overlaps the staging copies.
        tXrW = self.load_weight(self.weight_cells(mW, thr, tiler, rank), pred)

        cute.arch.cp_async_wait_group(0)
        # Columns past H stay zero in registers (they were never staged).
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrX.fill(0)
        copy_act(tXsX, tXrX)
        if const_expr(self.residual):
            tXrR = cute.make_rmem_tensor_like(tXgR)
            tXrR.fill(0)
            copy_act(tXsR, tXrR)
            # h is rounded to the activation dtype: the rounded h is both h_new and what is normalized.
            tXrX.store((self.widen(tXrX) + self.widen(tXrR)).to(self.act_dtype))
            copy_act(tXrX, tXsX)
            if row < rows:
                copy_act(tXrX, tXgH)
        buffers = (warp_sums, cta_sums, mbars)
        rstd = self.row_rstd(self.widen(tXrX), buffers, row_in_cta, lane_in_row, Int32(0), eps)
        if row < rows and lane_in_row == 0 and rank == 0:
            mRstd[row] = rstd

        # Re-read h from shared memory rather than holding it in registers across the reduction.
        tXrX.fill(0)
        copy_act(tXsX, tXrX)
        w = self.widen_weight(self.widen(tXrW))
        y = self.widen(tXrX) * rstd * w
        return NormalizedTile(y, tXgX, thr, tiler, bidx, rank, row, rows, pred, row_in_cta, lane_in_row)
