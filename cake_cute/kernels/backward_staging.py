"""The backward's row staging: the ring of shared-memory row tiles g's parts and h stream through,
g_residual's tile, the L2 prefetch of the next row where there is no ring, and rstd one tile ahead. A
mixin of ``rmsnorm_bwd.RMSNormBackward``, whose docstring describes the pipeline.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .common import COPY_BITS, prefetch_to_l2
from .thread_tiles import ThreadTiles, issue_row_tile


class RowStaging:
    @cute.jit
    def fill_ring(self, tt: ThreadTiles, bidx, num_programs, rows, sources, ring_tiles):
        """Issue the program's first ``ring_depth - 1`` row tiles, one cp.async group each."""
        for ahead in cutlass.range_constexpr(self.config.ring_depth - 1):
            if (bidx + ahead * num_programs) * self.tiling.rows_per_cta + tt.row_in_cta < rows:
                issue_row_tile(tt, bidx + ahead * num_programs, ahead, sources, ring_tiles)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def issue_g_residual(self, tt: ThreadTiles, tile, row, rows, mGRes, sGR):
        """Issue this tile's g_residual into its shared-memory tile (its own cp.async group)."""
        tXgGR = tt.of(mGRes, tile)
        tXsGR = tt.in_smem(sGR, 0)
        if row < rows:
            tt.async_copy(tXgGR, tXsGR)
        cute.arch.cp_async_commit_group()
        return tXsGR

    @cute.jit
    def prefetch_next_row(self, tt: ThreadTiles, tile, rank, lane_in_row, rows, mGs, mH, mGRes):
        """Without a ring, bring the next row's g, h (and g_residual) into the L2 now; only 128-bit vector
        tilings meet the bulk prefetch's 16-byte alignment, others skip it."""
        t = self.tiling
        if const_expr(t.vec * self.act_dtype.width == COPY_BITS):
            row = tile * t.rows_per_cta + tt.row_in_cta
            if lane_in_row == 0 and row < rows:
                for m in (*mGs, mH, mGRes) if const_expr(self.residual) else (*mGs, mH):
                    prefetch_to_l2(m, row, rank * t.cols_per_cta, t.cols_per_cta, t.hidden)

    @cute.jit
    def load_rstd(self, mRstd, row, rows) -> Float32:
        """rstd of ``row``, or 0 past the last row."""
        rstd = Float32(0.0)
        if row < rows:
            rstd = mRstd[row]
        return rstd

    @cute.jit
    def refill_ring(self, tt: ThreadTiles, tile, visit, num_programs, rows, sources, ring_tiles):
        """Issue the tile ``ring_depth - 1`` visits ahead into the freed slot, then wait for this tile's."""
        ring_depth = self.config.ring_depth
        last_tile = tile + (ring_depth - 1) * num_programs
        if last_tile * self.tiling.rows_per_cta + tt.row_in_cta < rows:
            issue_row_tile(tt, last_tile, (visit + ring_depth - 1) % ring_depth, sources, ring_tiles)
        cute.arch.cp_async_commit_group()
        # Pending, oldest first: this tile's g (all parts) and h, the next ring_depth - 2 tiles' (each
        # one group), this tile's g_residual, the g and h of the tile just issued.
        cute.arch.cp_async_wait_group(ring_depth - 1 + (1 if const_expr(self.residual) else 0))
