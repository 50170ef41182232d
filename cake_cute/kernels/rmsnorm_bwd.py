"""RMSNorm backward: dx in one pass, and per-program FP32 partial rows of the weight gradient.

Math, per row t (FP32 arithmetic, one rounding at the end):

    g    = g0, or with g_parts = n > 1 summands (the q/k/v or gate/up dgrads under torch.compile):
    g    = round(((g0 + g1) [+ g2]) in FP32, from the left)   (one rounding to the activation dtype)
    a    = g * (w + weight_offset)
    xhat = h * rstd                        (h: the saved x, or h_new in residual mode)
    xhat = y * inv_s                       (``from_output``: the memory-efficient mode, see below)
    c    = sum_j a_j * xhat_j / H
    dx   = round(rstd * (a - xhat * c) [+ g_residual])
    dW_partial[b] += g * xhat              (FP32, over the rows that program b visits)

The sum of g's parts is what inductor's fused add of them stores, so dx and dW are bitwise those of
the unfused compiled graph, without its add kernel.

Persistent grid: ``num_programs`` CTAs (times ``cluster_n`` along y), as many as are resident;
program b visits row tiles b, b + num_programs, ..., a fixed partition for a given (T,
num_programs). Each CTA copies w once into its own shared-memory cells and keeps one FP32 dW
accumulator per element it owns; at the end its row groups fold their accumulators by a fixed tree
and the program writes one FP32 row of ``partials[num_programs, H_pad]``. dW is their fixed-order
sum, by ``dw_reduce`` launched behind this kernel (programmatic dependent launch) or, with the finish
in the launch (``dw_finish``), by this kernel's CTAs after a grid barrier, bitwise the same. No
atomics on data.

Memory-efficient mode (``from_output``): the tensor read in h's place is y, and xhat = y * inv_s,
inv_s = 1 / s, s = w + weight_offset in FP32 with |s| raised to at least ``config.SCALE_FLOOR``, its
sign kept. inv_s is recomputed at each use from the thread's cells of w (cheaper than a shared tile
of 1 / s). Everything else is the default's, and the default variant's code is unchanged (every
difference is behind ``const_expr``). y carries one rounding, so the recomputed xhat has y's relative
error; a column with |s| below the floor gets a wrong xhat by construction.

Pipeline: g's parts and h of the next row tiles stream with cp.async into a ring of ``ring_depth``
shared-memory slots, one commit group per slot, and rstd of the next tile into a register;
g_residual, needed only after the row sum, is issued at the top of its iteration. The row sum is the
only synchronisation per row.

Tiling (``config.backward_config``): ``threads_per_row`` lanes of ``vecs_per_thread`` vectors, at
most 64 bytes of each of g and h per thread; a row one CTA holds goes to as many whole warps as cover
it exactly with one or two vectors each; wide rows split over a cluster of up to 16 CTAs. Registers
are held to a budget through ``min_blocks_per_mp``. For the widest rows (``dw_in_smem``) there is no
ring: g and h are loaded into registers and re-read from the L2 after the row sum, and the dW
accumulator lives in shared memory.

Bytes moved: reads g's n parts, h (+ g_residual) and writes dx once: T*H*(n + 2 [+ 1])*act_bytes,
plus 4*T of rstd, plus the partial rows (num_programs * H * 4, written, read back from the L2) and dw
(H * dw_bytes). The memory-efficient mode moves the same bytes. n parts cost (n - 1)*T*H*act_bytes
more than one g, and 2*T*H*act_bytes less than an add kernel in front of a one-g backward.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .backward_staging import RowStaging
from .common import (
    RowKernel,
    allocate_reduction_buffers,
    allocate_tile,
    approx_reciprocal,
    init_cluster_reduction,
    tile_shape,
)
from .config import SCALE_FLOOR, finish_cells_bytes
from .dw_finish import DWFinish
from .dw_partial_rows import PartialRowWriter
from .thread_tiles import ThreadTiles


class RMSNormBackward(RowStaging, PartialRowWriter, DWFinish, RowKernel):
    """One compiled backward per (arch, dtypes, H, residual, weight_offset, g_parts, from_output, dW
    finish); T and the number of programs are runtime values."""

    def __init__(
        self,
        config,
        act_dtype,
        w_dtype,
        residual: bool,
        weight_offset: float,
        g_parts: int = 1,
        from_output: bool = False,
        finish=None,
    ):
        super().__init__(config, act_dtype, w_dtype, residual, weight_offset)
        self.g_parts = g_parts
        self.from_output = from_output
        self.finish = finish

    def entry_point(self):
        """What ``cute.compile`` traces: ``__call__`` or the launcher of ``g_parts`` parts, ``_with_dw`` with
        the finish; g's other parts come last, in summation order."""
        if self.finish is not None:
            return (self.launch_with_dw, self.launch_two_parts_with_dw, self.launch_three_parts_with_dw)[
                self.g_parts - 1
            ]
        return (self, self.launch_two_parts, self.launch_three_parts)[self.g_parts - 1]

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
        self.launch(num_programs, stream, (mG,), mH, mW, mRstd, mGRes, mDX, mPartial)

    # The launchers of g in parts take the same arguments as ``__call__`` and then the other parts; those
    # with the dW finish take dw and the counter after the partial rows.
    @cute.jit
    def launch_two_parts(self, mG, mH, mW, mRstd, mGRes, mDX, mPartial, num_programs: Int32, mG1, stream):
        self.launch(num_programs, stream, (mG, mG1), mH, mW, mRstd, mGRes, mDX, mPartial)

    @cute.jit
    def launch_three_parts(
        self, mG, mH, mW, mRstd, mGRes, mDX, mPartial, num_programs: Int32, mG1, mG2, stream
    ):
        self.launch(num_programs, stream, (mG, mG1, mG2), mH, mW, mRstd, mGRes, mDX, mPartial)

    @cute.jit
    def launch_with_dw(
        self, mG, mH, mW, mRstd, mGRes, mDX, mPartial, mDW, mCounter, num_programs: Int32, stream
    ):
        self.launch(num_programs, stream, (mG,), mH, mW, mRstd, mGRes, mDX, mPartial, mDW, mCounter)

    @cute.jit
    def launch_two_parts_with_dw(
        self, mG, mH, mW, mRstd, mGRes, mDX, mPartial, mDW, mCounter, num_programs: Int32, mG1, stream
    ):
        self.launch(num_programs, stream, (mG, mG1), mH, mW, mRstd, mGRes, mDX, mPartial, mDW, mCounter)

    @cute.jit
    def launch_three_parts_with_dw(
        self, mG, mH, mW, mRstd, mGRes, mDX, mPartial, mDW, mCounter, num_programs: Int32, mG1, mG2, stream
    ):
        self.launch(num_programs, stream, (mG, mG1, mG2), mH, mW, mRstd, mGRes, mDX, mPartial, mDW, mCounter)

    def launch(self, num_programs, stream, mGs, mH, mW, mRstd, mGRes, mDX, mPartial, mDW=None, mCounter=None):
        """Launch on g's parts ``mGs``; with the finish the launch is cooperative unless the config says
        otherwise."""
        mG1, mG2 = (*mGs[1:], None, None)[:2]
        self.kernel(mGs[0], mH, mW, mRstd, mGRes, mDX, mPartial, mG1, mG2, mDW, mCounter).launch(
            **self.launch_shape(num_programs),
            cooperative=self.finish is not None and self.config.cooperative,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mG, mH, mW, mRstd, mGRes, mDX, mPartial, mG1, mG2, mDW, mCounter):
        t = self.tiling
        mGs = (mG, mG1, mG2)[: self.g_parts]  # g's parts, in summation order
        uses_ring = not self.config.dw_in_smem
        ring_depth = self.config.ring_depth
        tidx, bidx, rank = self.cta_position()
        num_programs, _, _ = cute.arch.grid_dim()
        rows = mG.shape[0]
        num_tiles = cute.ceil_div(rows, t.rows_per_cta)

        smem = cutlass.memory.SmemAllocator()
        warp_sums, cta_sums, mbars = allocate_reduction_buffers(smem, t)

        tiler = tile_shape(t)
        thr, tXc0, pred, row_in_cta, lane_in_row = self.thread_slice(mG.shape, tidx, (0, rank))
        copy_act = self.row_copy(pred)

        tXrGs = [cute.make_rmem_tensor_like(tXc0, self.act_dtype) for _ in mGs]
        tXrH = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrDX = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrGR = cute.make_rmem_tensor_like(tXc0, self.act_dtype)

        tt = ThreadTiles(thr, tiler, rank, row_in_cta, copy_act, self.staging_copy(pred))
        # g_residual is needed only after the row sum: one tile, issued at the top of its iteration.
        sGR = allocate_tile(smem, self.act_dtype, t) if const_expr(self.residual) else None
        if const_expr(uses_ring):
            sGs = [allocate_tile(smem, self.act_dtype, t, ring_depth) for _ in mGs]
            sH = allocate_tile(smem, self.act_dtype, t, ring_depth)
            self.fill_ring(tt, bidx, num_programs, rows, (*mGs, mH), (*sGs, sH))
        # After the first row tiles are issued, so that w's round trip overlaps theirs.
        tXsW, tXrDW, tXDW, sDW = self.prologue(smem, thr, tiler, rank, tXc0, mW, pred)
        sFold = None  # the row groups' dW accumulators, summed at the end
        if const_expr(t.rows_per_cta > 1):
            sFold = smem.allocate_tensor(
                Float32, cute.make_ordered_layout(tiler, order=(1, 0)), byte_alignment=16
            )

        init_cluster_reduction(mbars, t.cluster_n)
        # rstd is loaded one tile ahead too, so its latency never sits on a row's critical path.
        rstd_next = self.load_rstd(mRstd, bidx * t.rows_per_cta + row_in_cta, rows)
        visit = Int32(0)  # row tiles this program has visited
        for tile in cutlass.range(bidx, num_tiles, num_programs, unroll=1):
            row = tile * t.rows_per_cta + row_in_cta
            # Reduction buffers alternate per row (an mbarrier's phase per two rows); the ring's
            # slots are used in turn.
            reduction_slot = visit & 1
            phase = (visit >> 1) & 1
            if const_expr(uses_ring):
                ring_slot = visit % ring_depth
            tXgGs = [tt.of(m, tile) for m in mGs]
            tXgH, tXgDX = [tt.of(m, tile) for m in (mH, mDX)]
            tXsGR = None  # this tile's g_residual cells, in residual mode
            if const_expr(self.residual):
                tXsGR = self.issue_g_residual(tt, tile, row, rows, mGRes, sGR)
            rstd = rstd_next
            rstd_next = self.load_rstd(mRstd, (tile + num_programs) * t.rows_per_cta + row_in_cta, rows)
            # g's parts and h come from the ring, or with dW in shared memory straight from global memory.
            tXsrcGs, tXsrcH = tXgGs, tXgH
            if const_expr(not uses_ring):
                self.prefetch_next_row(tt, tile + num_programs, rank, lane_in_row, rows, mGs, mH, mGRes)
            if const_expr(uses_ring):
                self.refill_ring(tt, tile, visit, num_programs, rows, (*mGs, mH), (*sGs, sH))
                tXsrcGs = [tt.in_smem(sT, ring_slot) for sT in sGs]
                tXsrcH = tt.in_smem(sH, ring_slot)
            c = self.reduce_row(
                tt, row, rows, rstd, reduction_slot, phase, lane_in_row, tXsrcGs, tXsrcH, tXrGs, tXrH, tXDW,
                tXsW, (warp_sums, cta_sums, mbars),
            )  # fmt: skip
            self.write_dx(
                tt, row, rows, rstd, c, tXsrcGs, tXsrcH, tXsGR, tXrGs, tXrH, tXrGR, tXrDX, tXsW, tXgDX,
            )  # fmt: skip
            visit = visit + 1

        self.end_rows(tt, sFold, tXrDW)
        self.write_dw_partial_row(tt, bidx, mPartial, tXrDW, tXDW, pred)
        if const_expr(self.finish is not None):
            # The finish's cells take h's ring (its copies all waited for) or the dW tile, both done with.
            cute.arch.cp_async_wait_group(0)
            scratch = sH if const_expr(uses_ring) else sDW
            assert cute.cosize(scratch.layout) * scratch.element_type.width // 8 >= finish_cells_bytes(
                self.finish.config, t.threads_per_cta
            )
            cta, num_ctas = bidx * t.cluster_n + rank, num_programs * t.cluster_n
            self.finish_dw(mPartial, mDW, mCounter, scratch.iterator, tidx, cta, num_ctas)

    @cute.jit
    def prologue(self, smem, thr, tiler, rank, tXc0, mW, pred):
        """w into this thread's own shared cells (no barrier needed), which lets 128 registers suffice, and
        the dW accumulator zeroed."""
        cta_tile = cute.make_ordered_layout(tiler, order=(1, 0))
        # w's global slice, its shared cells, then the load: allocating the cells first, or after the
        # load, changed the schedule ptxas picks (fp32 H = 131072).
        tXgW = self.weight_cells(mW, thr, tiler, rank)
        tXsW = thr.partition_D(smem.allocate_tensor(self.w_dtype, cta_tile, byte_alignment=16))
        tXrW = self.load_weight(tXgW, pred)
        cute.autovec_copy(tXrW, tXsW)
        tXrDW = cute.make_rmem_tensor_like(tXc0, Float32)
        tXrDW.fill(0.0)
        tXDW, sDW = tXrDW, None
        if const_expr(self.config.dw_in_smem):
            sDW = smem.allocate_tensor(Float32, cta_tile, byte_alignment=16)
            tXDW = thr.partition_S(sDW)
            cute.autovec_copy(tXrDW, tXDW)
        return tXsW, tXrDW, tXDW, sDW

    @cute.jit
    def inverse_scale(self, s: cute.TensorSSA) -> cute.TensorSSA:
        """1 / s, |s| floored at ``SCALE_FLOOR`` with its sign kept, by ``approx_reciprocal`` (an IEEE
        division spilled the wide tilings)."""
        floor = Float32(SCALE_FLOOR)
        clamped = cute.where(s >= 0.0, cute.where(s < floor, floor, s), cute.where(s > -floor, -floor, s))
        return approx_reciprocal(clamped)

    @cute.jit
    def reduce_row(
        self, tt: ThreadTiles, row, rows, rstd, reduction_slot, phase, lane_in_row, tXsrcGs, tXsrcH,
        tXrGs, tXrH, tXDW, tXsW, buffers,
    ) -> Float32:  # fmt: skip
        """Add this row's g * xhat into dW and return c = sum(a * xhat) / H; nothing of the row is held in
        registers across the barrier."""
        # Rows past T contribute zeros, never stale values.
        for tXrG in tXrGs:
            tXrG.fill(0)
        tXrH.fill(0)
        if row < rows:
            tt.read((*tXsrcGs, tXsrcH), (*tXrGs, tXrH))
        g = self.gradient(tXrGs)
        xhat = self.normalized(tXrH, rstd, tXsW)
        tXDW.store(tXDW.load() + g * xhat)
        own_dot = (g * self.widen_weight(tXsW.load()) * xhat).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dot = self.row_total(own_dot, buffers, tt.row_in_cta, lane_in_row, reduction_slot, phase)
        return dot / self.tiling.hidden

    @cute.jit
    def write_dx(
        self,
        tt: ThreadTiles,
        row,
        rows,
        rstd,
        c,
        tXsrcGs,
        tXsrcH,
        tXsGR,
        tXrGs,
        tXrH,
        tXrGR,
        tXrDX,
        tXsW,
        tXgDX,
    ):
        """Re-read g's parts and h, compute dx (+ g_residual), store it."""
        tXrGR.fill(0)
        if const_expr(self.residual):
            # This tile's g_residual; the tile issued by refill_ring may stay in flight.
            cute.arch.cp_async_wait_group(1 if const_expr(not self.config.dw_in_smem) else 0)
        if row < rows:
            tt.read((*tXsrcGs, tXsrcH), (*tXrGs, tXrH))
            if const_expr(self.residual):
                tt.copy_act(tXsGR, tXrGR)
        xhat = self.normalized(tXrH, rstd, tXsW)
        dx = (self.gradient(tXrGs) * self.widen_weight(tXsW.load()) - xhat * c) * rstd
        if const_expr(self.residual):
            dx = dx + tXrGR.load().to(Float32)
        tXrDX.store(dx.to(self.act_dtype))
        if row < rows:
            tt.copy_act(tXrDX, tXgDX)

    @cute.jit
    def normalized(self, tXrH, rstd, tXsW) -> cute.TensorSSA:
        """xhat in FP32 from this thread's registers of h (h * rstd) or, ``from_output``, of y (y / s)."""
        if const_expr(self.from_output):
            return tXrH.load().to(Float32) * self.inverse_scale(self.widen_weight(tXsW.load()))
        return tXrH.load().to(Float32) * rstd

    @cute.jit
    def gradient(self, tXrGs) -> cute.TensorSSA:
        """g in FP32 from this thread's registers of its parts, several summed from the left and rounded
        once to the activation dtype."""
        g = tXrGs[0].load().to(Float32)
        for tXrG in tXrGs[1:]:
            g = g + tXrG.load().to(Float32)
        if const_expr(len(tXrGs) > 1):
            g = g.to(self.act_dtype).to(Float32)
        return g
