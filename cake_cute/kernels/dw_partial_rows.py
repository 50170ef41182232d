"""The backward's dW partial rows: a CTA's row groups fold their FP32 accumulators into one by a fixed
tree, and row group 0 writes the program's partial row. A mixin of the backward kernels.
"""

from __future__ import annotations

from functools import partial

import cutlass.cute as cute
from cutlass import Float32, const_expr

from .common import broadcast_rows, copy_atom, global_row
from .thread_tiles import ThreadTiles


def fold_levels(groups: int) -> list[tuple[int, int]]:
    """The tree summing ``groups`` row groups into group 0, as (adders, stride) per level; any count
    works."""
    levels = []
    while groups > 1:
        stride = -(-groups // 2)
        levels.append((groups - stride, stride))
        groups = stride
    return levels


class PartialRowWriter:
    @cute.jit
    def end_rows(self, tt: ThreadTiles, sFold, tXrDW):
        """After the last row tile: let the dW reduction start launching, and fold the row groups' dW."""
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.tiling.rows_per_cta > 1):
            self.fold_row_groups(tt, sFold, tXrDW)

    @cute.jit
    def fold_row_groups(self, tt: ThreadTiles, sFold, tXrDW):
        """Sum the row groups' dW into row group 0's registers by ``fold_levels``'s fixed tree, so a program
        writes one partial row."""
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
        """Program b's row group 0 writes partial row b."""
        t = self.tiling
        tXgP = tt.of(broadcast_rows(global_row(mPartial, bidx, t.hidden), t.rows_per_cta), 0)
        if const_expr(self.config.dw_in_smem):
            cute.autovec_copy(tXDW, tXrDW)
        store = partial(cute.copy, copy_atom(Float32, t.vec), pred=pred)
        if tt.row_in_cta == 0:
            store(tXrDW, tXgP)
