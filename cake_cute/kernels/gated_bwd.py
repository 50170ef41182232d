"""Gated RMSNorm backward: dx and dz in one pass, and per-program FP32 partial rows of dW.

Math, per row t and segment k (the row, or one group of L columns), FP32 arithmetic, one rounding of
each output; the gate and the statistics' products are recomputed from x, z, w and rstd (s = act(z),
s' = act'(z), w' = w + weight_offset, g = dL/dy):

    norm then gate:  n = x * rstd      a = g * w' * s     dW_partial += g * n * s
    gate then norm:  n = x * s * rstd  a = g * w'         dW_partial += g * n
    c  = sum_{j in k} a_j * n_j / L
    dn = rstd * (a - n * c)                             (the gradient of the normalized input)
    norm then gate:  dx = round(dn)                     dz = round(g * n * w' * s')
    gate then norm:  dx = round(dn * s)                 dz = round(dn * x * s')

Persistent grid (P, H / L, times a cluster's C CTAs along y for segments wider than 4096 columns):
program (b, k) visits row tiles b, b + P, ... of group k, a fixed partition for a given (T, P). Its
lanes keep one FP32 dW accumulator per column they own; at the end the CTA's segment rows fold them
by the plain backward's fixed tree and the CTA writes its columns of partial row b, which
``dw_reduce`` (behind this kernel) or the finish in the launch (``dw_finish``) sums in a fixed order.
No atomics on data: dx, dz and dW are bitwise reproducible, and a row's dx and dz do not depend on T.

Tiling (``gated_config.gated_backward_config``): a segment as in the forward, at most 8 elements of
each operand per lane, short segments 256 threads to a CTA. g, x and z are loaded straight into
registers; the FP32 terms of dx and dz are formed before the row sum, the only synchronisation per
row, and held across it; 2-byte rows are held to ``HELD_REGISTER_BUDGET`` registers so three CTAs
share an SM. A segment wider than 512 such lanes is split over a cluster of 128-thread CTAs whose
partial sums meet in distributed shared memory. Wide segments (at most two to a CTA) prefetch a later
tile's rows into the L2, two tiles ahead, so every tile after the first was asked for an iteration
before it is loaded.

Bytes moved: reads g, x, z and writes dx, dz once: 5 * T*H*act_bytes, plus 4*T*H/L of rstd, plus the
partial rows (P * H * 4, written, read back from the L2) and dw (H * dw_bytes).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .common import (
    COPY_BITS,
    allocate_reduction_buffers,
    broadcast_rows,
    copy_atom,
    global_row,
    init_cluster_reduction,
    prefetch_to_l2,
    tile_shape,
)
from .config import finish_cells_bytes
from .dw_finish import DWFinish
from .gated_fwd import GatedKernel, segment_columns
from .rmsnorm_bwd import RMSNormBackward
from .thread_tiles import ThreadTiles


class GatedRMSNormBackward(DWFinish, GatedKernel):
    """One compiled backward per (arch, dtypes, H, group size, form, weight_offset, activation, dW
    finish); T and the number of programs are runtime values."""

    # The plain backward's fixed-order fold of a CTA's row groups' dW, and its end of the rows (they
    # read only the tiling).
    end_rows = RMSNormBackward.end_rows
    fold_row_groups = RMSNormBackward.fold_row_groups

    def __init__(self, config, act_dtype, w_dtype, weight_offset: float, groups: int, norm_before_gate: bool,
                 activation: str, finish=None):  # fmt: skip
        super().__init__(config, act_dtype, w_dtype, weight_offset, groups, norm_before_gate, activation)
        self.finish = finish

    def entry_point(self):
        """What ``cute.compile`` traces: ``__call__``, or with the dW finish ``launch_with_dw``."""
        return self if self.finish is None else self.launch_with_dw

    @cute.jit
    def __call__(
        self,
        mG: cute.Tensor,
        mX: cute.Tensor,
        mZ: cute.Tensor,
        mW: cute.Tensor,
        mRstd: cute.Tensor,
        mDX: cute.Tensor,
        mDZ: cute.Tensor,
        mPartial: cute.Tensor,
        num_programs: Int32,
        stream,
    ):
        self.kernel(mG, mX, mZ, mW, mRstd, mDX, mDZ, mPartial, None, None).launch(
            **self.launch_shape(num_programs), stream=stream
        )

    @cute.jit
    def launch_with_dw(
        self, mG, mX, mZ, mW, mRstd, mDX, mDZ, mPartial, mDW, mCounter, num_programs: Int32, stream
    ):
        """The launch with the dW finish, cooperative unless the config says otherwise."""
        self.kernel(mG, mX, mZ, mW, mRstd, mDX, mDZ, mPartial, mDW, mCounter).launch(
            **self.launch_shape(num_programs), cooperative=self.config.cooperative, stream=stream
        )

    @cute.kernel
    def kernel(self, mG, mX, mZ, mW, mRstd, mDX, mDZ, mPartial, mDW, mCounter):
        t = self.tiling
        tidx, bidx, along_y = self.cta_position()
        group, rank = self.group_and_rank(along_y)
        num_programs, _, _ = cute.arch.grid_dim()
        rows = mG.shape[0]
        num_tiles = cute.ceil_div(rows, t.rows_per_cta)
        smem = cutlass.memory.SmemAllocator()
        buffers = allocate_reduction_buffers(smem, t)
        sCells = None  # the dW finish's cells (``gated_config.backward_smem_bytes`` counts them)
        if const_expr(self.finish is not None):
            cells_bytes = finish_cells_bytes(self.finish.config, t.threads_per_cta)
            sCells = smem.allocate_tensor(Float32, cute.make_layout(cells_bytes // 4), byte_alignment=16)
        sFold = None  # the segment rows' dW accumulators, summed at the end
        if const_expr(t.rows_per_cta > 1):
            sFold = smem.allocate_tensor(
                Float32,
                cute.make_ordered_layout((t.rows_per_cta, t.cols_per_cta), order=(1, 0)),
                byte_alignment=16,
            )

        mG, mX, mZ, mDX, mDZ, mW = [self.group_view(m, group) for m in (mG, mX, mZ, mDX, mDZ, mW)]
        thr, tXc0, pred, row_in_cta, lane_in_row = self.thread_slice(mG.shape, tidx, (0, rank))
        copy_act = self.row_copy(pred)
        tt = ThreadTiles(thr, tile_shape(t), rank, row_in_cta, copy_act, None)
        # w stays in its own dtype, widened at each use: half the registers held for 2-byte w.
        tXrW = self.load_weight(self.weight_cells(mW, thr, tile_shape(t), rank), pred)
        # Fragments shaped like the coordinates (a static layout), so they stay in registers.
        tXrG, tXrX, tXrZ, tXrDX, tXrDZ = [cute.make_rmem_tensor_like(tXc0, self.act_dtype) for _ in range(5)]
        tXrDW = cute.make_rmem_tensor_like(tXc0, Float32)
        tXrDW.fill(0.0)

        step = num_programs * t.rows_per_cta  # rows between this program's consecutive row tiles
        if const_expr(self.config.prefetch):
            self.prefetch_row(
                bidx * t.rows_per_cta + row_in_cta + step, rows, lane_in_row, rank, (mG, mX, mZ)
            )
        init_cluster_reduction(buffers[2], t.cluster_n)
        visit = Int32(0)  # row tiles this program has visited
        for tile in cutlass.range(bidx, num_tiles, num_programs, unroll=1):
            row = tile * t.rows_per_cta + row_in_cta
            # Rows past T contribute zeros, never stale values.
            for frag in (tXrG, tXrX, tXrZ):
                frag.fill(0)
            rstd = Float32(0.0)
            if row < rows:
                tt.read((tt.of(mG, tile), tt.of(mX, tile), tt.of(mZ, tile)), (tXrG, tXrX, tXrZ))
                rstd = mRstd[row, group]
            terms = self.row_terms(tXrG, tXrX, tXrZ, tXrW, rstd)
            c = self.reduce_row(terms, tXrDW, buffers, row_in_cta, lane_in_row, visit)
            self.write_dx_dz(terms, tXrDX, tXrDZ, rstd, c)
            if row < rows:
                copy_act(tXrDX, tt.of(mDX, tile))
                copy_act(tXrDZ, tt.of(mDZ, tile))
            if const_expr(self.config.prefetch):
                # Two tiles ahead: the next one was asked for an iteration ago. Here, after the stores,
                # the tile's registers are free for the addresses (at the top, 80-register lanes spill).
                self.prefetch_row(row + 2 * step, rows, lane_in_row, rank, (mG, mX, mZ))
            visit = visit + 1

        self.end_rows(tt, sFold, tXrDW)
        self.write_dw_partial(tt, bidx, group, mPartial, tXrDW, pred)
        if const_expr(self.finish is not None):
            along = self.ctas_along_y()
            cta, num_ctas = bidx * along + along_y, num_programs * along
            self.finish_dw(mPartial, mDW, mCounter, sCells.iterator, tidx, cta, num_ctas)

    @cute.jit
    def prefetch_row(self, row, rows, lane_in_row, rank, sources):
        """Bring g, x and z of a later tile's rows into the L2 (one bulk prefetch per segment row and tensor);
        only 128-bit vector tilings meet its alignment, others skip it."""
        t = self.tiling
        if const_expr(t.vec * self.act_dtype.width == COPY_BITS):
            if lane_in_row == 0 and row < rows:
                for m in sources:
                    if const_expr(t.cluster_n == 1):
                        prefetch_to_l2(m, row, 0, t.hidden, t.hidden)
                    else:
                        prefetch_to_l2(m, row, rank * t.cols_per_cta, t.cols_per_cta, t.hidden)

    @cute.jit
    def row_terms(self, tXrG, tXrX, tXrZ, tXrW, rstd):
        """The FP32 terms of the form's dx, dz and dW from the thread's raw fragments."""
        g = tXrG.load().to(Float32)
        x = tXrX.load().to(Float32)
        w = self.widen_weight(tXrW.load())
        s, ds = self.gate(tXrZ.load().to(Float32))
        if const_expr(self.norm_before_gate):
            n = x * rstd
            return g * w * s, n, g * n * s, g * n * w * ds
        n = x * s * rstd
        return g * w, n, g * n, s, x * ds

    @cute.jit
    def reduce_row(self, terms, tXrDW, buffers, row_in_cta, lane_in_row, visit) -> Float32:
        """Add this row's dW terms into the accumulator and return c = sum(a * n) / L."""
        a, n, dw_term = terms[0], terms[1], terms[2]
        tXrDW.store(tXrDW.load() + dw_term)
        own_dot = (a * n).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        phase = Int32(0)
        if const_expr(self.tiling.cluster_n > 1):
            phase = (visit >> 1) & 1
        dot = self.row_total(own_dot, buffers, row_in_cta, lane_in_row, visit & 1, phase)
        return dot / self.tiling.hidden

    @cute.jit
    def write_dx_dz(self, terms, tXrDX, tXrDZ, rstd, c):
        """dx and dz of the thread's cells from ``row_terms``, rounded into their register fragments."""
        dn = (terms[0] - terms[1] * c) * rstd
        if const_expr(self.norm_before_gate):
            tXrDX.store(dn.to(self.act_dtype))
            tXrDZ.store(terms[3].to(self.act_dtype))
        else:
            tXrDX.store((dn * terms[3]).to(self.act_dtype))
            tXrDZ.store((dn * terms[4]).to(self.act_dtype))

    @cute.jit
    def write_dw_partial(self, tt: ThreadTiles, bidx, group, mPartial, tXrDW, pred):
        """CTA (b, k) writes its group's columns of partial row b from segment row 0, after the fold."""
        t = self.tiling
        partial_row = global_row(mPartial, bidx, self.groups * t.hidden)
        if const_expr(self.groups > 1):
            partial_row = segment_columns(partial_row, group * t.hidden, t.hidden, t.vec)
        tXgP = tt.of(broadcast_rows(partial_row, t.rows_per_cta), 0)
        # Bound outside the dynamic branch: a None captured into a branch would become an IR value.
        store = partial(cute.copy, copy_atom(Float32, t.vec), pred=pred)
        if tt.row_in_cta == 0:
            store(tXrDW, tXgP)
