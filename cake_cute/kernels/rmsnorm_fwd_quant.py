"""RMSNorm forward fused with rowwise block-scaled FP8 (e4m3) quantization of its output.

Math, per row t (FP32; normalization and tiling are the plain forward's, so h_new and rstd are
bitwise the same):

    y     = h * rstd * (w + weight_offset)                 (FP32, never rounded to the act dtype)
    amax  = max |y_j| over a block of B columns along H   (B = 32 or 128; columns past H count as 0;
                                                           a NaN in the block makes amax NaN)
    e     = E8M0 byte of fp32(amax / 448) rounded up to a power of two:
            2^(e - 127) >= amax / 448, saturated to 254 (2^127), 255 for NaN
    q_j   = e4m3 of y_j * 2^(127 - e), round to nearest even, saturated to +-448 (NaN stays NaN)

``recipe="mxfp8"`` (B = 32) writes e as a byte; ``recipe="1x128"`` (B = 128) the FP32 scale
2^(e - 127), e held to >= 1 and amax = 0 giving 1.0. e comes from amax's bits by integer operations
(exactly ``cvt.rp.satfinite.ue8m0x2.f32``'s rounding, which sm_90a lacks, so both architectures run
the same code). amax is a NaN-propagating maximum; across lanes it travels as its bit pattern, whose
integer order is the numeric order of non-negative floats with NaN above infinity.

Tiling: lane l of a row owns vectors l, l + threads_per_row, ...; a k-slice (``threads_per_row * vec``
columns) and a block nest (``quant_config.blocks_nest``), so a lane's vectors fall in G blocks
(groups), each shared by L lanes. Each lane takes the maximum over its own vectors of each group;
then, with ``amax_scatter`` and L <= 32, the L lanes reduce-scatter the G maxima
(``quant_config.scatter_steps``), each lane computes and stores only the scales of the groups it owns,
and the inverse scales travel back with the steps undone: fewer shuffles and scale computations per
lane than a butterfly over every group. Otherwise every lane reduces every group over the block's
lanes (through shared memory and one barrier where L > 32), and the block's first lane writes each
scale.

Bytes moved: reads x (+ residual) and w; writes T*H e4m3 bytes, T*ceil(H/B) scales (1 or 4 bytes),
4*T bytes of rstd, and (optionally) y and h_new in the activation dtype.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .quant_config import (
    AMAX_BITS_E8M0_ZERO,
    E8M0_EXPONENT_OFFSET,
    E8M0_MAX_FINITE,
    E8M0_NAN,
    E8M0_ONE,
    E8M0_SIGNIFICAND_CARRY,
    FP32_BITS_OF_2_POW_M127,
    FP32_INF_BITS,
    FP32_NAN_BITS,
    blocks_nest,
    scatter_steps,
)
from .rmsnorm_fwd import NormalizedTile, RMSNormForward

BF16_HIGH_HALF = -65536  # 0xFFFF0000 as an Int32


@dsl_user_op
def float_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_float(x: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def e8m0_round_up(amax_bits: Int32) -> Int32:
    """The biased E8M0 exponent of fp32(amax / 448) rounded up, from amax's bits, without a division."""
    finite = cutlass.min(amax_bits, FP32_INF_BITS)  # keeps the carry below from overflowing for NaN
    e = ((finite + E8M0_SIGNIFICAND_CARRY) >> 23) - E8M0_EXPONENT_OFFSET
    e = cutlass.select_(amax_bits <= AMAX_BITS_E8M0_ZERO, Int32(0), e)
    e = cutlass.select_(amax_bits == FP32_INF_BITS, Int32(E8M0_MAX_FINITE), e)
    return cutlass.select_(amax_bits > FP32_INF_BITS, Int32(E8M0_NAN), e)


@cute.jit
def inverse_scale(e: Int32) -> Float32:
    """2^(127 - e) exactly (2^-127 is an FP32 subnormal), NaN for the NaN exponent."""
    bits = cutlass.select_(e == E8M0_MAX_FINITE, Int32(FP32_BITS_OF_2_POW_M127), (E8M0_MAX_FINITE - e) << 23)
    return bits_float(cutlass.select_(e == E8M0_NAN, Int32(FP32_NAN_BITS), bits))


class RMSNormForwardQuant(RMSNormForward):
    """The forward with a block-scaled e4m3 epilogue: one compiled kernel per (arch, dtypes, H, residual,
    weight_offset, recipe, emit_y)."""

    def __init__(self, config, act_dtype, w_dtype, residual, weight_offset, emit_y):
        super().__init__(config, act_dtype, w_dtype, residual, weight_offset)
        tiling = config.tiling
        self.block = config.block
        self.fp32_scales = config.fp32_scales
        self.emit_y = emit_y
        if not blocks_nest(tiling, self.block):
            raise ValueError(f"{tiling.describe()}: its k-slices and blocks of {self.block} do not nest")
        if tiling.cluster_n > 1 and tiling.cols_per_cta % self.block:
            raise ValueError("a cluster CTA's column slice must hold whole blocks")
        self.lanes_per_block = min(self.block // tiling.vec, tiling.threads_per_row)
        self.slices_per_block = max(1, self.block // (tiling.threads_per_row * tiling.vec))
        self.groups = -(-tiling.vecs_per_thread // self.slices_per_block)
        self.scatter_steps = scatter_steps(config.amax_scatter, self.groups, self.lanes_per_block)
        self.owned = self.groups >> self.scatter_steps

    def group_vectors(self, g: int) -> tuple[int, int]:
        """The range of the thread's vectors (k) that lie in its g-th block."""
        first = g * self.slices_per_block
        return first, min(first + self.slices_per_block, self.tiling.vecs_per_thread)

    @cute.jit
    def widen(self, frag: cute.Tensor) -> cute.TensorSSA:
        """bf16 widened from its 32-bit words, one integer op per value where the compiler spends two;
        other dtypes convert as the forward does."""
        if const_expr(frag.element_type != cutlass.BFloat16 or self.tiling.vec % 2):
            return frag.load().to(Float32)
        words = cute.recast_tensor(frag, Int32)
        out = cute.make_rmem_tensor_like(frag, Float32)
        for i in cutlass.range_constexpr(cute.size(words)):
            out[2 * i] = bits_float(words[i] << 16)
            out[2 * i + 1] = bits_float(words[i] & BF16_HIGH_HALF)
        return out.load()

    @cute.jit
    def __call__(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps: Float32, stream):
        """The forward's arguments plus ``mQ`` (T, H) e4m3 bytes and ``mScale`` (T, blocks) scales."""
        self.launch(mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps, stream)

    @cute.jit
    def epilogue(self, smem, tile: NormalizedTile, mY: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor):
        """y (with ``emit_y``), the owned blocks' maxima and scales, the gathered inverse scales, the data."""
        if const_expr(self.emit_y):
            self.store_rows(tile, tile.y.to(self.act_dtype), mY)
        y = cute.make_rmem_tensor_like(tile.like, Float32)
        y.store(tile.y)
        owned_inv = []
        for i, amax in enumerate(self.block_amax(smem, tile, y)):
            e = self.scale_exponent(amax)
            self.store_scale(tile, mScale, self.owned_group(tile, i), e)
            owned_inv.append(float_bits(inverse_scale(e)))
        inv = self.gather_groups(tile, owned_inv)
        q = cute.make_rmem_tensor_like(tile.like, cutlass.Float8E4M3FN)
        for g in cutlass.range_constexpr(self.groups):
            for k in cutlass.range_constexpr(*self.group_vectors(g)):
                q[None, 0, k].store((y[None, 0, k].load() * bits_float(inv[g])).to(cutlass.Float8E4M3FN))
        self.store_rows(tile, cute.recast_tensor(q, Uint8).load(), mQ)

    @cute.jit
    def lane_max(self, y: cute.Tensor, g: int) -> Int32:
        """max |y| over the thread's vectors of its g-th group, as bits."""
        first, end = self.group_vectors(g)
        m = cute.math.absf(y[0, 0, first])
        for k in cutlass.range_constexpr(first, end):
            for i in cutlass.range_constexpr(1 if k == first else 0, self.tiling.vec):
                m = cute.arch.fmax(m, cute.math.absf(y[i, 0, k]), nan=True)
        return float_bits(m)

    @cute.jit
    def block_amax(self, smem, tile: NormalizedTile, y: cute.Tensor) -> list:
        """The maxima (bits) of the blocks this lane owns: each scatter step keeps half the list (the upper
        for the lane with bit m set), then a butterfly over the owned maxima."""
        amax = [self.lane_max(y, g) for g in range(self.groups)]
        mask = self.lanes_per_block // 2
        for _ in cutlass.range_constexpr(self.scatter_steps):
            half = len(amax) // 2
            upper = tile.lane_in_row & mask != 0
            kept = []
            for lo, hi in zip(amax[:half], amax[half:]):
                sent = cutlass.select_(upper, lo, hi)
                received = cute.arch.shuffle_sync_bfly(sent, offset=mask)
                kept.append(cutlass.max(cutlass.select_(upper, hi, lo), received))
            amax = kept
            mask //= 2
        lanes = min(mask * 2, 32)
        amax = [cute.arch.warp_reduction_max(m, threads_in_group=lanes) for m in amax]
        if const_expr(self.lanes_per_block > 32):
            amax = self.combine_warps(smem, tile, amax)
        return amax

    @cute.jit
    def owned_group(self, tile: NormalizedTile, i: int):
        """The group of the lane's i-th owned maximum, read from the lane's high bits within its block."""
        if const_expr(self.scatter_steps == 0):
            return i
        shift = self.lanes_per_block.bit_length() - 1 - self.scatter_steps
        return i + self.owned * ((tile.lane_in_row % self.lanes_per_block) >> shift)

    @cute.jit
    def gather_groups(self, tile: NormalizedTile, owned: list) -> list:
        """Every group's value from the lanes' owned ones: the scatter steps undone, lower half first."""
        values = list(owned)
        mask = self.lanes_per_block >> self.scatter_steps
        for _ in cutlass.range_constexpr(self.scatter_steps):
            upper = tile.lane_in_row & mask != 0
            other = [cute.arch.shuffle_sync_bfly(v, offset=mask) for v in values]
            lower = [cutlass.select_(upper, o, v) for v, o in zip(values, other)]
            values = lower + [cutlass.select_(upper, v, o) for v, o in zip(values, other)]
            mask *= 2
        return values

    @cute.jit
    def combine_warps(self, smem, tile: NormalizedTile, amax: list) -> list:
        """Blocks wider than a warp: each warp's maximum goes through shared memory (one barrier)."""
        t = self.tiling
        warps = smem.allocate_tensor(
            Int32, cute.make_layout((t.rows_per_cta, self.groups, t.warps_per_row)), byte_alignment=16
        )
        warp = tile.lane_in_row // 32
        if cute.arch.lane_idx() == 0:
            for g in cutlass.range_constexpr(self.groups):
                warps[tile.row_in_cta, g, warp] = amax[g]
        cute.arch.barrier()
        warps_per_block = self.lanes_per_block // 32
        first = warp // warps_per_block * warps_per_block
        for g in cutlass.range_constexpr(self.groups):
            m = warps[tile.row_in_cta, g, first]
            for j in cutlass.range_constexpr(1, warps_per_block):
                m = cutlass.max(m, warps[tile.row_in_cta, g, first + j])
            amax[g] = m
        return amax

    @cute.jit
    def scale_exponent(self, amax_bits: Int32) -> Int32:
        """The block scale's biased exponent: E8M0's, or a normal FP32 scale's (2^0 for an all-zero block)."""
        e = e8m0_round_up(amax_bits)
        if const_expr(self.fp32_scales):
            e = cutlass.select_(amax_bits == 0, Int32(E8M0_ONE), cutlass.max(e, Int32(1)))
        return e

    @cute.jit
    def store_scale(self, tile: NormalizedTile, mScale: cute.Tensor, g, e: Int32):
        """The first lane owning the block's g-th group writes its scale; the bound is on the block, since a
        ragged row's last block may hold no column of this lane."""
        t = self.tiling
        vector = g * self.slices_per_block * t.threads_per_row + tile.lane_in_row
        block = (tile.rank * t.cols_per_cta + vector * t.vec) // self.block
        owner = tile.lane_in_row % (self.lanes_per_block >> self.scatter_steps) == 0
        if tile.row < tile.rows and owner and block < -(-t.hidden // self.block):
            if const_expr(self.fp32_scales):
                bits = cutlass.select_(e == E8M0_NAN, Int32(FP32_NAN_BITS), e << 23)
                mScale[tile.row, block] = bits_float(bits)
            else:
                mScale[tile.row, block] = Uint8(e)
