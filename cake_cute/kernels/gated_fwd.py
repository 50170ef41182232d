"""Gated RMSNorm forward: the output norms of the linear-attention and Mamba-2 hybrid layers, in one pass.

Math, per row t, FP32 arithmetic, one rounding of y (w' = w + weight_offset; act is ``silu(z) = z *
sigmoid(z)`` or ``sigmoid(z)``, compiled in):

    norm then gate:                rstd   = 1 / sqrt(sum_j x_j^2 / H + eps)                  (FP32 [T])
                                   y_j    = round(x_j * rstd * w'_j * act(z_j))
    gate then norm, per group k    h_j    = x_j * act(z_j) of L = group_size columns:     rstd_k = 1 /
    sqrt(sum_{j in k} h_j^2 / L + eps)           (FP32 [T, H/L])
                                   y_j    = round(h_j * rstd_k * w'_j)

Norm then gate is the one-group case (L = H) with the gate applied after the statistics.

Tiling (``gated_config``): the unit is a *segment* of L columns, tiled like a plain row, at most 16
elements per lane, several segments per CTA when they are short. The grid is (ceil(T / rows_per_cta),
H / L): CTA (b, k) takes rows of group k, so its rows share one slice of w and its tile is a rectangle
of the (T, L) view of the group's columns. x and z are loaded straight into registers, the gate is
computed once, and the sum of squares goes through the plain kernels' fixed-order row sum, so y and
rstd of a row are bitwise independent of T and of the other rows.

Bytes moved: reads x and z once and w once per CTA, writes y and 4 bytes of rstd per segment:
3 * T*H*act_bytes + 4*T*H/L.

The statistics alone (``GatedRMSNormStatistics``, for a backward whose caller kept no rstd) are this
kernel without w and y, and without z in the norm-then-gate form, so rstd is bitwise the forward's;
T*H*act_bytes (twice that with the gate) + 4*T*H/L.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..vocab import SIGMOID
from .common import RowKernel, allocate_reduction_buffers, approx_reciprocal, tile_shape
from .tiling import VECTOR_BYTES


def segment_columns(m: cute.Tensor, first, width: int, align_elems: int) -> cute.Tensor:
    """Columns ``first`` .. ``first + width - 1`` of a row-major tensor or vector as a tensor of their own."""
    dtype = m.element_type
    start = (m.iterator + first).toint()
    align = min(VECTOR_BYTES, align_elems * dtype.width // 8)
    pointer = cute.make_ptr(dtype, start, cute.AddressSpace.gmem, assumed_align=align)
    if const_expr(cute.rank(m) == 1):
        return cute.make_tensor(pointer, cute.make_layout((width,)))
    return cute.make_tensor(pointer, cute.make_layout((m.shape[0], width), stride=(m.stride[0], 1)))


class GatedKernel(RowKernel):
    """What the gated forward and backward share: the form, the groups, a group's views and the gate; a
    segment is tiled like a row of ``common.RowKernel``."""

    def __init__(
        self,
        config,
        act_dtype,
        w_dtype,
        weight_offset: float,
        groups: int,
        norm_before_gate: bool,
        activation: str,
    ):
        super().__init__(config, act_dtype, w_dtype, False, weight_offset)
        self.groups = groups
        self.norm_before_gate = norm_before_gate
        self.activation = activation

    def ctas_along_y(self) -> int:
        """One CTA per group along y, or one cluster per group (a backward's wide segments)."""
        return self.groups * self.tiling.cluster_n

    @cute.jit
    def group_and_rank(self, along_y):
        """(the CTA's group, its rank in the group's cluster: a constant 0 without one)."""
        group, rank = along_y, 0
        if const_expr(self.tiling.cluster_n > 1):
            group, rank = along_y // self.tiling.cluster_n, cute.arch.block_idx_in_cluster()
        return group, rank

    @cute.jit
    def group_view(self, m: cute.Tensor, group) -> cute.Tensor:
        """Group ``group``'s columns of a (rows, H) tensor or of w (the whole of it for one group)."""
        if const_expr(self.groups == 1):
            return m
        t = self.tiling
        return segment_columns(m, group * t.hidden, t.hidden, t.vec)

    @cute.jit
    def gate(self, z: cute.TensorSSA) -> tuple:
        """(act(z), act'(z)) in FP32 from s = sigmoid(z), as torch's sigmoid backward forms it (a form
        through exp(-z) would overflow); sigmoid by ex2.approx and rcp.approx."""
        s = approx_reciprocal(cute.math.exp(-z, fastmath=True) + 1.0)
        if const_expr(self.activation == SIGMOID):
            value, slope = s, s * (1.0 - s)
        else:
            value, slope = z * s, s * (1.0 + z * (1.0 - s))
        return value, slope


class GatedRMSNormForward(GatedKernel):
    """One compiled forward per (arch, dtypes, H, group size, form, weight_offset, activation); T is a
    runtime value."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mZ: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mRstd: cute.Tensor,
        eps: Float32,
        stream,
    ):
        ctas = cute.ceil_div(mX.shape[0], self.tiling.rows_per_cta)
        self.kernel(mX, mZ, mW, mY, mRstd, eps).launch(**self.launch_shape(ctas), stream=stream)

    @cute.kernel
    def kernel(self, mX, mZ, mW, mY, mRstd, eps: Float32):
        """mW and mY are None in the statistics kernel, which writes only rstd."""
        t = self.tiling
        tidx, bidx, group = self.cta_position()
        rows = mX.shape[0]
        smem = cutlass.memory.SmemAllocator()
        buffers = allocate_reduction_buffers(smem, t)
        writes_y = const_expr(mY is not None)
        reads_z = const_expr(writes_y or not self.norm_before_gate)

        operands = (mX, mZ, mY, mW) if writes_y else (mX, mZ)
        mX, mZ, *written = [self.group_view(m, group) for m in operands]
        thr, _, pred, row_in_cta, lane_in_row = self.thread_slice(mX.shape, tidx, (0, 0))
        row = bidx * t.rows_per_cta + row_in_cta
        copy_act = self.row_copy(pred)
        tXgX, tXgZ, *tXgY = [
            thr.partition_S(cute.local_tile(m, tile_shape(t), (bidx, 0))) for m in (mX, mZ, *written[:1])
        ]
        # Rows past T and columns past the segment stay zero in registers.
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrZ = cute.make_rmem_tensor_like(tXgZ)
        tXrX.fill(0)
        tXrZ.fill(0)
        if row < rows:
            copy_act(tXgX, tXrX)
            if const_expr(reads_z):
                copy_act(tXgZ, tXrZ)
        if const_expr(writes_y):
            tXrW = self.load_weight(self.weight_cells(written[1], thr, tile_shape(t), 0), pred)

        gate = None
        if const_expr(reads_z):
            gate, _ = self.gate(tXrZ.load().to(Float32))
        h = tXrX.load().to(Float32)
        if const_expr(not self.norm_before_gate):
            h = h * gate
        rstd = self.row_rstd(h, buffers, row_in_cta, lane_in_row, Int32(0), eps)
        if row < rows and lane_in_row == 0:
            mRstd[row, group] = rstd

        if const_expr(writes_y):
            y = h * rstd * self.widen_weight(tXrW.load())
            if const_expr(self.norm_before_gate):
                y = y * gate
            tXrY = cute.make_rmem_tensor_like(tXgY[0])
            tXrY.store(y.to(self.act_dtype))
            if row < rows:
                copy_act(tXrY, tXgY[0])


class GatedRMSNormStatistics(GatedRMSNormForward):
    """rstd alone, bitwise the forward's, with the forward's config."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mZ: cute.Tensor, mRstd: cute.Tensor, eps: Float32, stream):
        ctas = cute.ceil_div(mX.shape[0], self.tiling.rows_per_cta)
        self.kernel(mX, mZ, None, None, mRstd, eps).launch(**self.launch_shape(ctas), stream=stream)
