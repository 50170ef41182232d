"""RMSNorm backward: dx in one pass, and per-CTA FP32 partial rows of the weight gradient.

Math, per row t (FP32 arithmetic, one rounding at the end):

    a    = g * (w + weight_offset)
    xhat = h * rstd                        (h: the saved x, or h_new in residual mode)
    c    = sum_j a_j * xhat_j / H
    dx   = round(rstd * (a - xhat * c) [+ g_residual])
    dW_partial[p] += g * xhat              (FP32 registers, over the rows that CTA row-group p visits)

Persistent grid: ``num_programs`` CTAs (times ``cluster_n`` along y), as many as are resident at once
(``cake_cute.occupancy``); program b visits the row tiles b, b + num_programs, ... -- a fixed partition
for a given (T, num_programs). Each CTA copies w once into its own cells of shared memory and keeps one
FP32 dW accumulator per element it owns; at the end every row group writes its accumulator as one FP32
row of the workspace ``partials[num_programs * rows_per_cta, H_pad]``, which ``dw_reduce`` sums in a
fixed order. No atomics anywhere.

Pipeline: g and h of the program's next row tiles stream with cp.async into a ring of ``stages``
shared-memory tiles (``config.backward_stages``: 4 for plain rows one CTA holds, so three tiles are in
flight while one is reduced; otherwise 2), and rstd of the next tile into a register; g_residual,
needed only after the row sum, is staged at the top of its own iteration. The row sum
(``common.row_sum``) is the only synchronisation per row: a CTA barrier, plus for clusters an
``st.async`` push of each CTA's partial into every peer's shared memory.

Tiling (``config.backward_tiling``): ``threads_per_row`` lanes per row, ``vecs_per_thread`` vectors of
``vec`` elements (128-bit accesses when H allows), at most 64 bytes of each of g and h per thread; a row
one CTA holds goes to as many whole warps as cover it exactly with one or two vectors each (H = 1024:
4 warps x 1, 7168: 14 warps x 2); wide rows are split over a cluster of up to 16 CTAs. Registers are held to a budget
(``config.backward_register_budget``) through ``min_blocks_per_mp``. For the widest rows (512-thread
CTAs, ``wide_mode``) g and h are loaded straight into registers and re-read from global memory (an L2
hit) after the row sum, and the dW accumulator lives in shared memory, so 128 registers suffice.

Bytes moved: reads g, h (+ g_residual) and writes dx once: T*H*(3 or 4)*act_bytes, plus 4*T of rstd,
plus the partial rows (num_programs * rows_per_cta * H * 4, written here, read by dw_reduce).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .common import (
    RowKernel,
    allocate_reduction_buffers,
    allocate_tile,
    broadcast_rows,
    column_predicate,
    copy_atom,
    init_cluster_reduction,
    row_sum,
    row_tiled_copy,
    staging_atom,
    tile_shape,
)


@cute.jit
def stage_tile(stage, thr, tiler, rank, tile, slot, mG, mH, sG, sH):
    """Issue the cp.async copies of row tile ``tile`` of g and h into stage ``slot``."""
    for m, sT in ((mG, sG), (mH, sH)):
        stage(thr.partition_S(cute.local_tile(m, tiler, (tile, rank))), thr.partition_D(sT[None, None, slot]))


class RMSNormBackward(RowKernel):
    """One compiled backward per (arch, dtypes, H, residual, weight_offset); T and the number of
    programs are runtime values. ``stages``: row tiles of g and h in the shared-memory ring of staged
    mode (``config.backward_stages``)."""

    def __init__(self, config, act_dtype, w_dtype, residual: bool, weight_offset: float):
        super().__init__(config, act_dtype, w_dtype, residual, weight_offset)
        self.stages = config.ring_depth

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
        self.kernel(mG, mH, mW, mRstd, mGRes, mDX, mPartial).launch(
            **self.launch_shape(num_programs), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mG: cute.Tensor,
        mH: cute.Tensor,
        mW: cute.Tensor,
        mRstd: cute.Tensor,
        mGRes: cute.Tensor,
        mDX: cute.Tensor,
        mPartial: cute.Tensor,
    ):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        bidx, rank, _ = cute.arch.block_idx()
        num_programs, _, _ = cute.arch.grid_dim()
        if const_expr(t.cluster_n == 1):
            rank = 0
        rows = mG.shape[0]
        num_tiles = cute.ceil_div(rows, t.rows_per_cta)

        smem = cutlass.memory.SmemAllocator()
        warp_sums, cta_sums, mbars = allocate_reduction_buffers(smem, t)

        tiler = tile_shape(t)
        thr = row_tiled_copy(self.act_dtype, t).get_slice(tidx)
        row_in_cta = tidx // t.threads_per_row
        lane_in_row = tidx % t.threads_per_row
        identity = cute.make_identity_tensor(mG.shape)
        tXc0 = thr.partition_S(cute.local_tile(identity, tiler, (0, rank)))
        pred = None
        if const_expr(not t.covers_row_exactly):
            pred = column_predicate(tXc0, t.hidden)
        copy_act = partial(cute.copy, copy_atom(self.act_dtype, t.vec), pred=pred)

        # w once per CTA into this thread's own cells of shared memory (no barrier needed: no other
        # thread touches them), widened to FP32 at each use; keeping it out of registers is what lets
        # 128 registers per thread suffice. In wide mode the FP32 dW accumulator lives there too.
        cta_tile = cute.make_ordered_layout(tiler, order=(1, 0))
        tXgW = thr.partition_S(cute.local_tile(broadcast_rows(mW, t.rows_per_cta), tiler, (0, rank)))
        tXsW = thr.partition_D(smem.allocate_tensor(self.w_dtype, cta_tile, byte_alignment=16))
        tXrW = cute.make_rmem_tensor_like(tXgW)
        tXrW.fill(0)
        cute.copy(copy_atom(self.w_dtype, t.vec), tXgW, tXrW, pred=pred)
        cute.autovec_copy(tXrW, tXsW)
        tXrDW = cute.make_rmem_tensor_like(tXc0, Float32)
        tXrDW.fill(0.0)
        tXDW = tXrDW
        if const_expr(self.config.dw_in_smem):
            tXDW = thr.partition_S(smem.allocate_tensor(Float32, cta_tile, byte_alignment=16))
            cute.autovec_copy(tXrDW, tXDW)

        tXrG = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrH = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrDX = cute.make_rmem_tensor_like(tXc0, self.act_dtype)
        tXrGR = cute.make_rmem_tensor_like(tXc0, self.act_dtype)

        # Staged mode: g and h of the next stages - 1 row tiles stream into a ring of shared-memory
        # tiles with cp.async while this one is reduced, so a CTA always has loads in flight. Each
        # thread reads back only the cells it staged itself.
        staged = not self.config.dw_in_smem
        stages = self.stages
        stage = partial(cute.copy, staging_atom(self.act_dtype, t.vec), pred=pred)
        # g_residual is needed only after the row sum: one stage, issued at the top of its iteration.
        sGR = allocate_tile(smem, self.act_dtype, t) if const_expr(self.residual) else None
        if const_expr(staged):
            sG = allocate_tile(smem, self.act_dtype, t, stages)
            sH = allocate_tile(smem, self.act_dtype, t, stages)
            # The first stages - 1 tiles of this program, one cp.async group each.
            for ahead in cutlass.range_constexpr(stages - 1):
                if (bidx + ahead * num_programs) * t.rows_per_cta + row_in_cta < rows:
                    stage_tile(stage, thr, tiler, rank, bidx + ahead * num_programs, ahead, mG, mH, sG, sH)
                cute.arch.cp_async_commit_group()

        init_cluster_reduction(mbars, t.cluster_n)
        # rstd is loaded one tile ahead too, so its latency never sits on a row's critical path.
        rstd_next = Float32(0.0)
        if bidx * t.rows_per_cta + row_in_cta < rows:
            rstd_next = mRstd[bidx * t.rows_per_cta + row_in_cta]
        step = Int32(0)
        for tile in cutlass.range(bidx, num_tiles, num_programs, unroll=1):
            row = tile * t.rows_per_cta + row_in_cta
            # Reduction buffers alternate per row (an mbarrier's phase per two rows); staging buffers
            # cycle through the stages.
            slot = step & 1
            phase = (step >> 1) & 1
            if const_expr(staged):
                stage_slot = step % stages
            tXgG, tXgH, tXgDX = [
                thr.partition_S(cute.local_tile(m, tiler, (tile, rank))) for m in (mG, mH, mDX)
            ]
            if const_expr(self.residual):
                tXgGR = thr.partition_S(cute.local_tile(mGRes, tiler, (tile, rank)))
            if const_expr(self.residual):
                tXsGR = thr.partition_D(sGR[None, None, 0])
                if row < rows:
                    stage(tXgGR, tXsGR)
                cute.arch.cp_async_commit_group()
            rstd = rstd_next
            next_row = (tile + num_programs) * t.rows_per_cta + row_in_cta
            rstd_next = Float32(0.0)
            if next_row < rows:
                rstd_next = mRstd[next_row]
            if const_expr(staged):
                last_tile = tile + (stages - 1) * num_programs
                if last_tile * t.rows_per_cta + row_in_cta < rows:
                    stage_tile(
                        stage, thr, tiler, rank, last_tile, (step + stages - 1) % stages, mG, mH, sG, sH
                    )
                cute.arch.cp_async_commit_group()
                # Pending, oldest first: this tile's g and h, the next stages - 2 tiles' (each one group),
                # this tile's g_residual, the g and h of the tile just issued.
                cute.arch.cp_async_wait_group(stages - 1 + (1 if const_expr(self.residual) else 0))
            # g and h come from the staged tiles, or in wide mode straight from global memory.
            tXsrcG, tXsrcH = tXgG, tXgH
            if const_expr(staged):
                tXsrcG, tXsrcH = [thr.partition_D(sT[None, None, stage_slot]) for sT in (sG, sH)]
            # Rows past T contribute zeros, never stale values.
            tXrG.fill(0)
            tXrH.fill(0)
            if row < rows:
                copy_act(tXsrcG, tXrG)
                copy_act(tXsrcH, tXrH)
            # Everything before the row sum is folded into the dot product and the dW accumulator;
            # a and xhat are recomputed from g and h afterwards (re-read from shared memory, or in
            # wide mode from global memory), so nothing of the row is held across the barrier.
            g = tXrG.load().to(Float32)
            xhat = tXrH.load().to(Float32) * rstd
            tXDW.store(tXDW.load() + g * xhat)
            dot = row_sum(
                (g * self.widen_weight(tXsW.load()) * xhat).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                warp_sums,
                cta_sums,
                mbars,
                row_in_cta,
                lane_in_row,
                slot,
                phase,
                t.threads_per_row,
                t.cluster_n,
            )
            c = dot / t.hidden
            tXrGR.fill(0)
            if const_expr(self.residual):
                cute.arch.cp_async_wait_group(1 if const_expr(staged) else 0)
            if row < rows:
                copy_act(tXsrcG, tXrG)
                copy_act(tXsrcH, tXrH)
                if const_expr(self.residual):
                    copy_act(tXsGR, tXrGR)
            xhat = tXrH.load().to(Float32) * rstd
            dx = (tXrG.load().to(Float32) * self.widen_weight(tXsW.load()) - xhat * c) * rstd
            if const_expr(self.residual):
                dx = dx + tXrGR.load().to(Float32)
            tXrDX.store(dx.to(self.act_dtype))
            if row < rows:
                copy_act(tXrDX, tXgDX)
            step = step + 1

        # Row group r of program b owns partial row b * rows_per_cta + r.
        tXgP = thr.partition_S(cute.local_tile(mPartial, tiler, (bidx, rank)))
        if const_expr(self.config.dw_in_smem):
            cute.autovec_copy(tXDW, tXrDW)
        cute.copy(copy_atom(Float32, t.vec), tXrDW, tXgP, pred=pred)
