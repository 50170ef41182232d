"""Weight gradient: the fixed-order sum of the backward's FP32 partial rows.

Math: ``dw[j] = sum_p partials[p, j]`` in FP32, rounded once to the output dtype (FP32 for the
functional API, w's dtype for autograd).

Tiling (``config.reduce_config``): a CTA of 256 threads covers ``col_lanes * vec`` columns (vec = 4
FP32 = one 128-bit load when H is a multiple of 4) and splits the P partial rows over
``256 / col_lanes`` row lanes (``threads / col_lanes`` when overridden). Row lane l adds rows l,
l + lanes, ... in order, loading one row at a time (each load waits for the one before: the loop's
bounds check sits between them) or, with ``rows_in_flight`` = k > 1, k rows at once before adding
them in the same order; the lanes' sums then
meet in shared memory through a binary tree with a fixed pairing. The order of every addition
depends only on (P, H), so dw is bitwise reproducible. ``col_lanes`` shrinks for narrow rows so that
even H = 1024 spreads over a few hundred CTAs.

Launch (``ReduceConfig.after_backward``): with programmatic dependent launch, so that the grid is
set up while the backward finishes (which allows it once its row loop is done) and its launch
latency is hidden; each CTA waits at ``griddepcontrol.wait`` until the backward's grid has completed
and its partial rows are visible (measured: evidence/kernel-rules-h200-2026-12-01/backward-scans/).

Bytes moved: reads P * H * 4, writes H * out_bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .common import global_vector, sum_over_row_lanes


class DWReduce:
    """One compiled reduction per (arch, output dtype, H) and its ``config.ReduceConfig``; the number
    of partial rows is a runtime value."""

    def __init__(self, config, out_dtype):
        self.config = config
        self.hidden = config.hidden
        self.out_dtype = out_dtype
        self.vec, self.col_lanes, self.row_lanes = config.vec, config.col_lanes, config.row_lanes

    @cute.jit
    def __call__(self, mPartial: cute.Tensor, mDW: cute.Tensor, stream):
        self.kernel(mPartial, mDW).launch(
            grid=[cute.ceil_div(self.hidden, self.config.cols_per_cta), 1, 1],
            block=[self.config.threads, 1, 1],
            stream=stream,
            use_pdl=self.config.after_backward,
        )

    @cute.kernel
    def kernel(self, mPartial: cute.Tensor, mDW: cute.Tensor):
        vec, col_lanes, row_lanes = self.vec, self.col_lanes, self.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_partials = mPartial.shape[0]
        if cutlass.const_expr(self.config.after_backward):
            # Launched early behind the backward (programmatic dependent launch): wait for its grid
            # to finish and its partial rows to be visible.
            cute.arch.griddepcontrol_wait()
        col_lane = tidx % col_lanes
        row_lane = tidx // col_lanes
        col0 = (bidx * col_lanes + col_lane) * vec

        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(
            Float32, cute.make_ordered_layout((row_lanes, col_lanes * vec), order=(1, 0)), byte_alignment=16
        )
        acc = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
        acc.fill(0.0)
        loaded = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
        # The partial rows are padded to a multiple of 4 columns, so a whole vector is always readable.
        if col0 < self.hidden:
            if cutlass.const_expr(self.config.rows_in_flight == 1):
                for p in cutlass.range(row_lane, num_partials, row_lanes, unroll=4):
                    cute.autovec_copy(global_vector(mPartial, p, col0, vec), loaded)
                    acc.store(acc.load() + loaded.load())
            else:
                self.add_rows_in_batches(mPartial, acc, row_lane, col0, num_partials)
        sum_over_row_lanes(sums, acc, row_lane, col_lane, vec, row_lanes)
        if row_lane == 0:
            for v in cutlass.range_constexpr(vec):
                if col0 + v < self.hidden:
                    mDW[col0 + v] = sums[0, col_lane * vec + v].to(self.out_dtype)

    @cute.jit
    def add_rows_in_batches(self, mPartial, acc, row_lane, col0, num_partials):
        """Add this lane's partial rows (row_lane, row_lane + lanes, ...) into ``acc`` in order, loading
        ``rows_in_flight`` of them before adding them, then the rest one at a time."""
        vec, lanes, batch = self.vec, self.row_lanes, self.config.rows_in_flight
        own = (num_partials - row_lane + lanes - 1) // lanes  # row_lane < lanes: never negative
        batches = own // batch
        loaded = [cute.make_rmem_tensor(cute.make_layout(vec), Float32) for _ in range(batch)]
        for b in cutlass.range(batches, unroll=1):
            first = row_lane + b * batch * lanes
            for k in cutlass.range_constexpr(batch):
                cute.autovec_copy(global_vector(mPartial, first + k * lanes, col0, vec), loaded[k])
            for k in cutlass.range_constexpr(batch):
                acc.store(acc.load() + loaded[k].load())
        for p in cutlass.range(row_lane + batches * batch * lanes, num_partials, lanes, unroll=1):
            cute.autovec_copy(global_vector(mPartial, p, col0, vec), loaded[0])
            acc.store(acc.load() + loaded[0].load())
