"""Weight gradient: the fixed-order sum of the backward's FP32 partial rows.

Math: ``dw[j] = sum_p partials[p, j]`` in FP32, rounded once to the output dtype (FP32 for the
functional API, w's dtype for autograd).

Order (fixed by P, the number of partial rows, and R = ``ReduceConfig.row_lanes``, a power of two):
for each column, R lane sums ``s_l = ((0 + p_l) + p_{l+R}) + p_{l+2R} + ...``, then a binary tree:
for stride R/2, R/4, ..., 1, ``s_l = s_l + s_{l+stride}`` for every l < stride; dw is s_0. Nothing
else decides the order, so dw is bitwise reproducible whichever threads compute it.

Threads (``ColumnSum``): a team of min(R, threads) threads sums one column vector (4 columns, one
128-bit load per row, when H allows), each thread ``R / team`` lane sums. A lane loads
``rows_in_flight`` rows before adding them (a row past P adds 0, which changes no sum: a lane sum
starts at +0), so a batch costs one L2 round trip. The tree runs from its widest stride down: between
one thread's own lane sums in registers, then butterfly shuffles (lane l's partner l ^ stride is
l + stride), and for teams of several warps through shared memory and shuffles again.

Kernel (``DWReduce``): CTAs of ``ReduceConfig.threads`` threads, one column vector per team, launched
behind the backward with programmatic dependent launch: the grid is set up while the backward
finishes, and each CTA waits at ``griddepcontrol.wait`` until the backward's partial rows are visible.

Bytes moved: reads P * H * 4 (from the L2: the backward has just written them), writes H * out_bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .common import global_vector

WARP = 32


class ColumnSum:
    """The fixed-order sum of the partial rows' column vectors by teams of ``team`` threads."""

    def __init__(self, config, team: int, out_dtype):
        self.config = config
        self.lanes = config.row_lanes
        self.team = team
        self.lanes_per_thread = self.lanes // team
        self.warps = max(1, team // WARP)  # warps of one team
        self.out_dtype = out_dtype

    def cells_layout(self, teams: int):
        """Shared memory the teams of a CTA need: each warp's sum, (teams, warps of a team, vec) FP32."""
        return cute.make_ordered_layout((teams, self.warps, self.config.vec), order=(2, 1, 0))

    def lane_of(self, member, k: int):
        """The k-th lane sum of team member ``member``: k in the lane's top bits, then the member's lane in
        its warp, then its warp, so the tree's strides run over registers, then shuffles, then warps."""
        if const_expr(self.team <= WARP):
            return k * self.team + member
        return k * self.team + (member % WARP) * self.warps + member // WARP

    @cute.jit
    def lane_sum(self, mPartial: cute.Tensor, col0, lane) -> cute.Tensor:
        """Rows lane, lane + R, ... of the column vector at ``col0``, added in order from +0."""
        vec, batch, lanes = self.config.vec, self.config.rows_in_flight, self.lanes
        num_partials = mPartial.shape[0]
        acc = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
        acc.fill(0.0)
        loaded = [cute.make_rmem_tensor(cute.make_layout(vec), Float32) for _ in range(batch)]
        most_rows = cute.ceil_div(num_partials, lanes)
        for b in cutlass.range(cute.ceil_div(most_rows, batch), unroll=1):
            for k in cutlass.range_constexpr(batch):
                row = lane + (b * batch + k) * lanes
                loaded[k].fill(0.0)
                # The partial rows are padded to whole vectors, so a vector that starts in H is readable.
                if row < num_partials and col0 < self.config.hidden:
                    cute.autovec_copy(global_vector(mPartial, row, col0, vec), loaded[k])
            for k in cutlass.range_constexpr(batch):
                acc.store(acc.load() + loaded[k].load())
        return acc

    @cute.jit
    def butterfly(self, acc: cute.Tensor, width: cutlass.Constexpr[int]):
        """The tree's strides among ``width`` (<= 32) lanes of a warp, widest first, in place."""
        for level in cutlass.range_constexpr(width.bit_length() - 1):
            mask = width >> (level + 1)
            for v in cutlass.range_constexpr(self.config.vec):
                acc[v] = acc[v] + cute.arch.shuffle_sync_bfly(acc[v], offset=mask)

    @cute.jit
    def column_vector(self, mPartial, col0, member, cells):
        """The column vector's dw in FP32, valid in member 0; with several warps every thread of the CTA
        must call it (a CTA barrier)."""
        vec = self.config.vec
        sums = [self.lane_sum(mPartial, col0, self.lane_of(member, k)) for k in range(self.lanes_per_thread)]
        for level in cutlass.range_constexpr(self.lanes_per_thread.bit_length() - 1):
            stride = self.lanes_per_thread >> (level + 1)
            for k in cutlass.range_constexpr(stride):
                sums[k].store(sums[k].load() + sums[k + stride].load())
        acc = sums[0]
        self.butterfly(acc, min(self.team, WARP))
        if const_expr(self.warps > 1):
            lane, warp = member % WARP, member // WARP
            if lane == 0:
                for v in cutlass.range_constexpr(vec):
                    cells[warp, v] = acc[v]
            cute.arch.barrier()
            acc.fill(0.0)
            if warp == 0 and lane < self.warps:
                for v in cutlass.range_constexpr(vec):
                    acc[v] = cells[lane, v]
            self.butterfly(acc, self.warps)
        return acc

    @cute.jit
    def store(self, mDW: cute.Tensor, col0, acc: cute.Tensor):
        """dw of the column vector at ``col0`` (its columns inside H), rounded to the output dtype."""
        for v in cutlass.range_constexpr(self.config.vec):
            if col0 + v < self.config.hidden:
                mDW[col0 + v] = acc[v].to(self.out_dtype)


class DWReduce:
    """One compiled reduction per (arch, output dtype, H); the number of partial rows is a runtime value."""

    def __init__(self, config, out_dtype):
        self.config = config
        self.columns = ColumnSum(config, config.row_lanes, out_dtype)

    @cute.jit
    def __call__(self, mPartial: cute.Tensor, mDW: cute.Tensor, stream):
        self.kernel(mPartial, mDW).launch(
            grid=[cute.ceil_div(self.config.hidden, self.config.cols_per_cta), 1, 1],
            block=[self.config.threads, 1, 1],
            stream=stream,
            use_pdl=self.config.after_backward,
        )

    @cute.kernel
    def kernel(self, mPartial: cute.Tensor, mDW: cute.Tensor):
        config = self.config
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(config.after_backward):
            # Launched early behind the backward (programmatic dependent launch): wait for its grid
            # to finish and its partial rows to be visible.
            cute.arch.griddepcontrol_wait()
        team, member = tidx // config.row_lanes, tidx % config.row_lanes
        col0 = (bidx * config.col_lanes + team) * Int32(config.vec)
        cells = None
        if const_expr(self.columns.warps > 1):
            smem = cutlass.memory.SmemAllocator()
            all_cells = smem.allocate_tensor(
                Float32, self.columns.cells_layout(config.col_lanes), byte_alignment=16
            )
            cells = all_cells[team, None, None]
        acc = self.columns.column_vector(mPartial, col0, member, cells)
        if member == 0:
            self.columns.store(mDW, col0, acc)
