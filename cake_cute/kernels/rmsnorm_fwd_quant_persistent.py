"""The forward to block-scaled FP8 as a persistent kernel that stages its next row tile.

Math: ``rmsnorm_fwd_quant``'s, row for row through the same methods, so every output is bitwise the
one-tile kernel's.

Tiling: the quantizing forward's, in plain mode and for rows one CTA holds. min(programs, row tiles)
CTAs run; program p normalizes row tiles p, p + P, ... x is staged in two shared-memory slots: the
cp.async of the next tile is issued into the other slot before this tile's row sum, so it loads while
this tile is reduced, normalized, quantized and stored. A CTA barrier closes every tile, so no slot
is reused while a lane still reads it. w is loaded once per program.

Why: a grid of one-tile CTAs waits out each tile's load before computing, and at the training shapes
its few waves end in a partial one; persistent programs overlap the two and spread the tiles evenly.
At large T the one-tile grid keeps more bytes in flight, so ``launch_plan`` runs this kernel only up
to a size per call.

Bytes moved: the one-tile kernel's, w read once per program.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import allocate_reduction_buffers, allocate_tile, tile_shape
from .rmsnorm_fwd import NormalizedTile
from .rmsnorm_fwd_quant import RMSNormForwardQuant


class RMSNormForwardQuantPersistent(RMSNormForwardQuant):
    """``RMSNormForwardQuant`` run by persistent programs, plain mode only; T and the number of programs
    are runtime values."""

    def __init__(self, config, act_dtype, w_dtype, residual, weight_offset, emit_y):
        super().__init__(config, act_dtype, w_dtype, residual, weight_offset, emit_y)
        if config.tiling.cluster_n > 1 or residual:
            raise ValueError("the persistent forward to FP8 covers plain rows one CTA holds")

    @cute.jit
    def __call__(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps: Float32, programs: Int32, stream):
        """The one-tile kernel's arguments plus ``programs``, the most CTAs to run."""
        tiles = cute.ceil_div(mX.shape[0], self.tiling.rows_per_cta)
        self.kernel(mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps).launch(
            **self.launch_shape(cutlass.min(tiles, programs)), stream=stream
        )

    @cute.jit
    def stage(self, mX, sX, thr, tiler, async_copy, tile, slot, row_in_cta):
        """Issue the cp.async of row tile ``tile`` into ``slot`` (nothing for rows past the last)."""
        if tile * self.tiling.rows_per_cta + row_in_cta < mX.shape[0]:
            tXgX = thr.partition_S(cute.local_tile(mX, tiler, (tile, 0)))
            async_copy(tXgX, thr.partition_D(sX[None, None, slot]))

    @cute.kernel
    def kernel(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps: Float32):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        first, _, _ = cute.arch.block_idx()
        programs, _, _ = cute.arch.grid_dim()
        rows = mX.shape[0]
        tiles = cute.ceil_div(rows, t.rows_per_cta)
        smem = cutlass.memory.SmemAllocator()
        buffers = allocate_reduction_buffers(smem, t)
        sX = allocate_tile(smem, self.act_dtype, t, slots=2)
        # The column predicate depends on the columns only: one for every tile of the program.
        tiler = tile_shape(t)
        thr, _, pred, row_in_cta, lane_in_row = self.thread_slice(mX.shape, tidx, (first, 0))
        # Bound outside the dynamic loop: a None captured into it would become an IR value.
        copy_act, async_copy = self.row_copy(pred), self.staging_copy(pred)

        self.stage(mX, sX, thr, tiler, async_copy, first, 0, row_in_cta)
        cute.arch.cp_async_commit_group()
        tXrW = self.load_weight(self.weight_cells(mW, thr, tiler, 0), pred)

        for i in cutlass.range((tiles - first + programs - 1) // programs, unroll=1):
            tile = first + i * programs
            slot = i % 2
            self.stage(mX, sX, thr, tiler, async_copy, tile + programs, 1 - slot, row_in_cta)
            cute.arch.cp_async_commit_group()  # empty past the last tile: the group count stays uniform
            cute.arch.cp_async_wait_group(1)
            row = tile * t.rows_per_cta + row_in_cta
            tXgX = thr.partition_S(cute.local_tile(mX, tiler, (tile, 0)))
            tXsX = thr.partition_D(sX[None, None, slot])
            # Columns past H stay zero in registers (they were never staged).
            tXrX = cute.make_rmem_tensor_like(tXgX)
            tXrX.fill(0)
            copy_act(tXsX, tXrX)
            rstd = self.row_rstd(self.widen(tXrX), buffers, row_in_cta, lane_in_row, slot, eps)
            if row < rows and lane_in_row == 0:
                mRstd[row] = rstd
            # Re-read x from shared memory rather than holding it in registers across the reduction.
            tXrX.fill(0)
            copy_act(tXsX, tXrX)
            y = self.widen(tXrX) * rstd * self.widen_weight(self.widen(tXrW))
            normalized = NormalizedTile(
                y, tXgX, thr, tiler, tile, Int32(0), row, rows, pred, row_in_cta, lane_in_row
            )
            self.epilogue(smem, normalized, mY, mQ, mScale)
            cute.arch.barrier()
