"""The backward's dW partial rows: the row groups of a CTA fold their FP32 accumulators into one (a
fixed tree, so every addition's order is fixed by the tiling), and row group 0 writes the program's
partial row, which ``dw_reduce`` sums in a fixed order. A mixin of the backward kernels
(``rmsnorm_bwd.RMSNormBackward``, whose ``tiling`` and ``config`` it reads)."""

from __future__ import annotations

from functools import partial

import cutlass.cute as cute
from cutlass import Float32, const_expr

from .common import broadcast_rows, copy_atom, global_row
from .thread_tiles import ThreadTiles


def fold_levels(groups: int) -> list[tuple[int, int]]:
    """The tree that sums ``groups`` row groups' dW into group 0, as (adders, stride) per level: groups
    r < adders add group r + stride. Each level halves the groups still holding a share (rounding up),
    so any count works."""
    levels = []
    while groups > 1:
        stride = -(-groups // 2)
        levels.append((groups - stride, stride))
        groups = stride
    return levels


class PartialRowWriter:
    """``end_rows``, ``fold_row_groups`` and ``write_dw_partial_row`` for a row kernel with ``tiling``
    (its ``RowTiling``) and ``config`` (``dw_in_smem``)."""

    @cute.jit
    def end_rows(self, tt: ThreadTiles, sFold, tXrDW):
        """After the program's last row tile: the dW reduction may start launching (it waits for this
        grid's memory before reading), and the CTA's row groups fold their dW into row group 0's."""
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.tiling.rows_per_cta > 1):
            self.fold_row_groups(tt, sFold, tXrDW)

    @cute.jit
    def fold_row_groups(self, tt: ThreadTiles, sFold, tXrDW):
        """Sum the dW accumulators of the CTA's row groups into row group 0's registers: through shared
        memory, a tree over the groups with a fixed pairing (``fold_levels``), so the order of every
        addition is fixed by the tiling. A program then writes one partial row instead of one per row
        group (at bf16 H = 64, 32 times fewer for dw_reduce to read)."""
        cols = self.tiling.cols_per_cta
        tXsFold = tt.thr.partition_D(sFold)
        cute.autovec_copy(tXrDW, tXsFold)
        cute.arch.barrier()
        for adders, stride in fold_levels(self.tiling.rows_per_cta):
            if tt.row_in_cta < adders:
                partner = cute.make_tensor(sFold.iterator + stride * cols, sFold.layout)
                tXsFold.store(tXsFold.load() + tt.thr.partition_D(partner).load())
            cute.arch.barrier()
        cute.autovec_copy(tXsFold, tXrDW)

    @cute.jit
    def write_dw_partial_row(self, tt: ThreadTiles, bidx, mPartial, tXrDW, tXDW, pred):
        """Program b owns partial row b: its row group 0 writes it (after ``fold_row_groups``, which
        summed every row group into it)."""
        t = self.tiling
        tXgP = tt.of(broadcast_rows(global_row(mPartial, bidx, t.hidden), t.rows_per_cta), 0)
        if const_expr(self.config.dw_in_smem):
            cute.autovec_copy(tXDW, tXrDW)
        store = partial(cute.copy, copy_atom(Float32, t.vec), pred=pred)
        if tt.row_in_cta == 0:
            store(tXrDW, tXgP)
