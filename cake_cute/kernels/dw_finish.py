"""The backward's dW finish inside its own launch: once every CTA has written its FP32 partial row, the
CTAs meet at a grid-wide barrier and sum the partial rows in ``dw_reduce``'s fixed order, so dw is
bitwise what the separate reduction would write.

Co-residency: the persistent grid launches no more programs than are resident, and the launch is
cooperative (unless a config says otherwise), so the driver refuses a grid that could not all be
resident rather than letting it deadlock.

Barrier (``grid_barrier``): one Int32 counter in global memory, zero between launches. Every thread
fences its writes; after a CTA barrier, thread 0 of every CTA adds 1, polls until every CTA has
arrived, fences (acquire), and adds 1 again as it leaves: the CTA completing the second count stores
0, when none can still be polling. So the host never resets the counter (CUDA graph replays
included), and two concurrent launches must not share one. The counter is the only memory any atomic
touches.

After the barrier CTA c's teams sum column vectors c * teams + team, then those CTAs * teams further
on, ..., in the row loop's shared memory, free by then.

Bytes moved: reads the P partial rows (P * H * 4, from the L2), writes dw (H * out_bytes).

A mixin of the backward kernels, which provide ``tiling`` and ``finish`` (the ``ColumnSum``, or None
for the two-launch backward).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .config import largest_power_of_two


@cute.jit
def load_relaxed(counter: cute.Tensor) -> Int32:
    """The counter's value, read from the L2 (relaxed at GPU scope: never a stale cached copy)."""
    return cute.arch.inline_ptx(
        "ld.relaxed.gpu.global.s32 {$w0}, [{$r0}];",
        write_only_types=[Int32],
        read_only_args=[Int64(counter.iterator.toint())],
    )


@cute.jit
def grid_barrier(counter: cute.Tensor, num_ctas):
    """Wait for every CTA, with every write before visible after, and leave ``counter`` zero once the last
    CTA has left. Every thread calls it."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
    if cute.arch.thread_idx()[0] == 0:
        cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        arrived = load_relaxed(counter)
        while arrived < num_ctas:
            arrived = load_relaxed(counter)
        cute.arch.fence_acq_rel_gpu()
        left = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        if left == 2 * num_ctas - 1:
            counter[0] = Int32(0)
    cute.arch.barrier()


class DWFinish:
    """``finish_dw``: dw from the partial rows after the grid barrier, by teams of the CTA's threads."""

    @cute.jit
    def finish_dw(self, mPartial, mDW, mCounter, scratch: cute.Pointer, tidx, cta, num_ctas):
        """Meet at the grid barrier, then sum this CTA's column vectors into ``mDW`` in ``scratch``."""
        threads = self.tiling.threads_per_cta
        team_size = self.finish.team
        teams = largest_power_of_two(threads) // team_size
        grid_barrier(mCounter, num_ctas)
        cells = None
        if const_expr(self.finish.warps > 1):
            all_cells = cute.make_tensor(
                cute.recast_ptr(scratch, dtype=Float32), self.finish.cells_layout(-(-threads // team_size))
            )
            cells = all_cells[tidx // team_size, None, None]
        vectors = -(-self.finish.config.hidden // self.finish.config.vec)
        for first in cutlass.range(0, vectors, num_ctas * teams, unroll=1):
            self.finish_column_vector(mPartial, mDW, cells, tidx, first + cta * teams + tidx // team_size)

    @cute.jit
    def finish_column_vector(self, mPartial, mDW, cells, tidx, vector):
        """Column vector ``vector``'s dw by its team (threads beyond the teams load and store nothing)."""
        col0 = vector * self.finish.config.vec
        if tidx >= largest_power_of_two(self.tiling.threads_per_cta):
            col0 = Int32(self.finish.config.hidden)
        member = tidx % self.finish.team
        acc = self.finish.column_vector(mPartial, col0, member, cells)
        if member == 0:
            self.finish.store(mDW, col0, acc)
        if const_expr(self.finish.warps > 1):
            cute.arch.barrier()  # the cells are read before the next column vector's overwrite them
