"""RMSNorm backward: dx in one pass, and per-CTA FP32 partial rows of the weight gradient.

Math, per row t (FP32 arithmetic, one rounding at the end):

    g    = g0, or with g_parts = n > 1 summands (the q/k/v or gate/up dgrads under torch.compile):
    g    = round(((g0 + g1) [+ g2]) in FP32, from the left)   (one rounding to the activation dtype)
    a    = g * (w + weight_offset)
    xhat = h * rstd                        (h: the saved x, or h_new in residual mode)
    xhat = y * inv_s                       (``from_output``: the memory-efficient mode, see below)
    c    = sum_j a_j * xhat_j / H
    dx   = round(rstd * (a - xhat * c) [+ g_residual])
    dW_partial[b] += g * xhat              (FP32, over the rows that program b visits)

Persistent grid: ``num_programs`` CTAs (times ``cluster_n`` along y), as many as are resident at once
(``cake_cute.runtime.device.resident_clusters``); program b visits the row tiles b, b + num_programs, ... -- a
fixed partition for a given (T, num_programs). Each CTA copies w once into its own cells of shared
memory and keeps one FP32 dW accumulator per element it owns; at the end the CTA's row groups (short
rows: several per CTA) fold their accumulators in shared memory by a fixed tree (``fold_row_groups``)
and the program writes one FP32 row of the workspace ``partials[num_programs, H_pad]``. dW is their
fixed-order sum (``dw_reduce``'s order), either by ``dw_reduce`` launched behind this kernel with
programmatic dependent launch (allowed once a program's row loop is done), or, in a variant with the
finish in the launch (``finish``: ``dw_finish``), by this kernel's own CTAs after a grid barrier, bitwise
the same. No atomics on data: the grid barrier's counter is the only memory an atomic touches.

Memory-efficient mode (``from_output``, a compile-time flag of the variant): the tensor read in h's
place is the forward's output y, and xhat = y * inv_s with inv_s = 1 / clamp(s), s = w + weight_offset
in FP32, |s| raised to at least ``config.SCALE_FLOOR`` with its sign kept (s = 0 counts as positive),
as Apex's memory-efficient norm clamps. inv_s is recomputed at each use from the cells of w the thread
reads anyway (``normalized``, by rcp.approx): a reciprocal per element costs less than the FP32 tile
of 1 / s it replaces, which took shared-memory bandwidth on every row and, at some H, a resident CTA
per SM. rstd still scales dx. The rest -- a, c, dx, dW, the ring, the partial rows, the config
(registers aside: ``config.backward_config``) and the launch -- is the default's, and the default
variant's code is unchanged (every difference is behind ``const_expr``). y = round(xhat * s) carries
one rounding to the activation dtype, so the recomputed xhat has y's relative error where h * rstd
had h's; a column whose |s| is below the floor gets a wrong xhat (dW and dx of that column) by
construction.

Parts of g: the sum is what torch inductor's fused elementwise add of the parts stores, so dx and dW
are bitwise those of the unfused compiled graph, without its add kernel. Runtime arguments (TVM-FFI;
the stream is the environment's): g, h, w, rstd, g_residual or None, dx, partials, num_programs, then
g1 [, g2] (``RMSNormBackward.entry_point``); each part is (T, H) in the activation dtype, with g's
layout. One g compiles to the same machine code as before the parts existed.

Pipeline: g (each of its parts) and h of the program's next row tiles stream with cp.async into a
ring of ``ring_depth`` slots of shared-memory row tiles, one commit group per slot
(``config.backward_ring_depth``: 4 for plain rows one CTA holds, so three tiles are in flight while
one is reduced; otherwise 2; ``config.parts_ring_depth`` cuts it for parts), and rstd of the next tile
into a register; g_residual, needed only after the row sum, is issued at the top of its own
iteration. The row sum (``common.row_sum``) is the only synchronisation per row: a CTA barrier, plus
for clusters an ``st.async`` push of each CTA's partial into every peer's shared memory.

Tiling (``config.backward_config``, ``tiling.backward_tiling``): ``threads_per_row`` lanes per row,
``vecs_per_thread`` vectors of ``vec`` elements (128-bit accesses when H allows), at most 64 bytes of
each of g and h per thread; a row one CTA holds goes to as many whole warps as cover it exactly with
one or two vectors each (H = 1024: 4 warps x 1, 7168: 14 warps x 2); wide rows are split over a
cluster of up to 16 CTAs. Registers are held to a budget (``config.backward_register_budget``)
through ``min_blocks_per_mp``. For the widest rows (512-thread CTAs of several vectors per lane,
``BackwardConfig.dw_in_smem``) there is no ring: g's parts and h are loaded straight into registers
and re-read from global memory (an L2 hit) after the row sum, and the dW accumulator lives in shared
memory, so 128 registers suffice.

The kernel body reads as its steps: ``fill_ring`` (the first row tiles), ``prologue`` (w and the dW
accumulator, after the ring's copies are issued so that the round trips overlap), then per row tile
``issue_g_residual``, ``load_rstd``, ``prefetch_next_row`` (without a ring: the next row into the L2),
``refill_ring``, ``reduce_row`` (dW and the row sum) and ``write_dx``; at the end
``fold_row_groups`` (several row groups per CTA) and ``write_dw_partial_row`` (both in ``dw_partial_rows``),
then, with the finish in the launch, ``finish_dw`` (``dw_finish``; its shared memory is h's ring or the
dW tile, done with by then).

Bytes moved: reads g's n parts, h (+ g_residual) and writes dx once: T*H*(n + 2 [+ 1])*act_bytes, plus 4*T
of rstd, plus the partial rows (num_programs * H * 4, written here, read back from the L2 by dw_reduce or
by the finish, which then writes dw: H * dw_bytes). The
memory-efficient mode moves the same bytes: it reads y instead of h. With n parts that
is (n - 1)*T*H*act_bytes more than one g, and 2*T*H*act_bytes less than an add kernel (reads n, writes g)
in front of a one-g backward.
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
    """One compiled backward per (arch, dtypes, H, residual, weight_offset, g_parts, from_output, the
    dW finish) and its ``config.BackwardConfig``; T and the number of programs are runtime values.
    ``from_output``: the tensor in h's place is the forward's output y (the memory-efficient mode).
    ``finish``: the ``dw_reduce.ColumnSum`` with which the kernel sums its partial rows into dw itself
    (``dw_finish``), or None for a ``dw_reduce`` launch behind it."""

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
        """What ``cute.compile`` traces: ``__call__`` for one g, else the launcher of ``g_parts`` parts,
        or with the dW finish in the launch (``finish``) their ``_with_dw`` versions. Their runtime
        arguments: (g, h, w, rstd, g_residual or None, dx, partials, [dw, counter,] num_programs), then
        g's other parts (g1, g2) in summation order; the stream is TVM-FFI's environment stream."""
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
        """Launch the kernel on g's parts ``mGs`` (the parts a launcher does not take are None, and so
        are dw and the counter without the dW finish). The finish's grid barrier needs every CTA
        resident: its launch is cooperative unless the config says otherwise."""
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
        """w once per CTA into this thread's own cells of shared memory (no barrier needed: no other
        thread touches them), widened to FP32 at each use; keeping it out of registers is what lets
        128 registers per thread suffice. The FP32 dW accumulator starts at zero, in registers or
        (``dw_in_smem``) in shared memory. Returns (w cells, dW registers, dW accumulator, and the
        accumulator's shared-memory tile or None)."""
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
        """1 / s with |s| raised to at least ``SCALE_FLOOR``, its sign kept (0 counts as positive), by
        ``approx_reciprocal`` (the mode's stated bound holds with twice its error: docs/memory.md; an
        IEEE division spilled the wide tilings)."""
        floor = Float32(SCALE_FLOOR)
        clamped = cute.where(s >= 0.0, cute.where(s < floor, floor, s), cute.where(s > -floor, -floor, s))
        return approx_reciprocal(clamped)

    @cute.jit
    def reduce_row(
        self, tt: ThreadTiles, row, rows, rstd, reduction_slot, phase, lane_in_row, tXsrcGs, tXsrcH,
        tXrGs, tXrH, tXDW, tXsW, buffers,
    ) -> Float32:  # fmt: skip
        """Add this row's g * xhat into the dW accumulator and return c = sum(a * xhat) / H.

        Everything before the row sum is folded into the dot product and the accumulator; a and xhat
        are recomputed from g and h afterwards (``write_dx``), so nothing of the row is held in
        registers across the barrier; ``buffers`` are the row sum's (warp sums, CTA sums, mbarriers)."""
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
        """Re-read g's parts and h (from the ring, or from global memory), compute dx (+ g_residual),
        store it."""
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
        """xhat in FP32 from this thread's registers of h (h * rstd), or, ``from_output``, of y
        (y * (1 / s), s = w + offset widened to FP32 from the thread's cells of w)."""
        if const_expr(self.from_output):
            return tXrH.load().to(Float32) * self.inverse_scale(self.widen_weight(tXsW.load()))
        return tXrH.load().to(Float32) * rstd

    @cute.jit
    def gradient(self, tXrGs) -> cute.TensorSSA:
        """g in FP32 from this thread's registers of its parts: one part is g, widened. Several are
        summed in FP32 from the left and rounded once to the activation dtype -- what torch
        inductor's fused add of the parts stores, so dx and dW are bitwise those of the unfused
        compiled graph -- then widened again (a no-op rounding for FP32 rows)."""
        g = tXrGs[0].load().to(Float32)
        for tXrG in tXrGs[1:]:
            g = g + tXrG.load().to(Float32)
        if const_expr(len(tXrGs) > 1):
            g = g.to(self.act_dtype).to(Float32)
        return g
