"""Rowwise block-scaled FP8 (e4m3) numerics in torch, and the scale-layout converters.

``quantize_rows_reference`` is the reference ``cake_rmsnorm_fp8`` runs on CPU tensors and the kernel
agrees with bitwise:

- The quantized value is the FP32 normalized value ``h * rstd * (w + weight_offset)``, never the
  act-dtype y.
- amax of a block of B columns (32 for ``mxfp8``, 128 for ``1x128``); columns past H count as zeros and
  are not stored.
- Scale exponent ``e`` (biased, as E8M0): fp32(amax / 448) rounded *up* to a power of two (torchao's
  RCEIL), saturated to 2^127; a NaN amax gives 255. amax = 0 gives e = 0 for ``mxfp8``; ``1x128``
  FP32 scales are held normal (e >= 1) and an all-zero block gets the scale 1.0.
- ``q = e4m3(y * 2^(127 - e))``: round to nearest even, saturated to +-448, NaN stays NaN. A NaN row is
  NaN throughout (``mxfp8`` scale byte 255); in a row with an infinity, the block holding it is NaN and
  the other blocks are 0.

Scale layouts (``scale_layout=``):

- ``"compact"``: row-major ``(…, ceil(H / B))``; ``torch.float8_e8m0fnu`` for ``mxfp8``, FP32 for ``1x128``.
- ``"cublas"`` (``mxfp8``): cuBLAS / TransformerEngine's swizzled MXFP8 layout, a
  ``(roundup(T, 128), roundup(ceil(H / 32), 4))`` tensor of 128x4 tiles in row-major tile order, each
  stored as ``offset(r, c) = (r % 32) * 16 + (r // 32) * 4 + c``; padding is byte 0.
- ``"deepgemm"`` (``1x128``): DeepGEMM's MN-major, TMA-aligned FP32 scales: shape ``(T, ceil(H / 128))``,
  strides ``(1, roundup(T, 4))``, padding 0.
"""

from __future__ import annotations

import torch

from . import validation as v
from .kernels import quant_config as qc  # the kernels' constants: this file mirrors their bit steps
from .runtime.views import as_output

RECIPES = tuple(qc.QUANT_RECIPES)
_CUBLAS_TILE = (128, 4)
_DEEPGEMM_ROW_ALIGN = 4  # 16 bytes of FP32 scales per TMA row


def block_of(recipe: str) -> int:
    return qc.QUANT_RECIPES[recipe][0]


def scale_blocks(hidden: int, recipe: str) -> int:
    return -(-hidden // block_of(recipe))


# ---------------------------------------------------------------------------------------------------
# Reference numerics


def amax_bits(blocks: torch.Tensor) -> torch.Tensor:
    """Max of |value| over the last dim as int32 bits, NaN sorting above infinity so it propagates."""
    return (blocks.contiguous().view(torch.int32) & 0x7FFFFFFF).amax(dim=-1)


def e8m0_round_up(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (int32) of fp32(amax / 448) rounded up to a power of two, saturated to 254;
    255 for NaN. ``amax`` as bits (int32) or FP32."""
    amax = amax.view(torch.float32) if amax.dtype == torch.int32 else amax.float()
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its rounded
    # reciprocal, which is not the IEEE quotient the kernel rounds.
    quotient = amax / torch.full_like(amax, qc.E4M3_MAX)
    bits = quotient.view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    normal = torch.clamp(exponent + (mantissa != 0).int(), max=qc.E8M0_MAX_FINITE)
    subnormal = (mantissa > qc.FP32_BITS_OF_2_POW_M127).int()
    e = torch.where(exponent == 0, subnormal, normal)
    return torch.where(torch.isnan(quotient), qc.E8M0_NAN, e).int()


def e8m0_round_up_from_bits(amax_bits: torch.Tensor) -> torch.Tensor:
    """``e8m0_round_up`` without the division, from the int32 bits of a non-negative FP32 amax: the
    kernel's form.

    With amax = m * 2^E (1 <= m < 2) and 448 = 1.75 * 2^8, fp32(amax / 448) stays at or below 2^(E-8)
    exactly when m <= 1.75, so e = E + 119, plus one when the fraction bits exceed 0x600000 (adding
    0x1FFFFF carries into the exponent). Where the quotient is an FP32 subnormal its coarser grid gives
    e = 0 up to amax = (1.75 + 2^-23) * 2^-119 (``quant_config.AMAX_BITS_E8M0_ZERO``) and e = 1 past it.
    Infinity gives 254, NaN 255."""
    finite = torch.clamp(amax_bits, max=qc.FP32_INF_BITS)
    e = ((finite + qc.E8M0_SIGNIFICAND_CARRY) >> 23) - qc.E8M0_EXPONENT_OFFSET
    e = torch.where(amax_bits <= qc.AMAX_BITS_E8M0_ZERO, 0, e)
    e = torch.where(amax_bits == qc.FP32_INF_BITS, qc.E8M0_MAX_FINITE, e)
    return torch.where(amax_bits > qc.FP32_INF_BITS, qc.E8M0_NAN, e).int()


def inverse_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(127 - e) as FP32, exactly (NaN for e = 255)."""
    bits = torch.where(e == qc.E8M0_MAX_FINITE, qc.FP32_BITS_OF_2_POW_M127, (qc.E8M0_MAX_FINITE - e) << 23)
    return torch.where(e == qc.E8M0_NAN, qc.FP32_NAN_BITS, bits).int().view(torch.float32)


def scale_exponent(amax: torch.Tensor, recipe: str) -> torch.Tensor:
    """The biased exponent of each block's scale under ``recipe`` (``amax`` as bits, int32)."""
    e = e8m0_round_up(amax)
    if qc.QUANT_RECIPES[recipe][1]:
        e = torch.where(amax == 0, qc.E8M0_ONE, torch.clamp(e, min=1)).int()
    return e


def quantize_rows_reference(y: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise block-scaled e4m3 of FP32 ``y`` (…, H): ``(data float8_e4m3fn like y, compact scales)``."""
    v.check_recipe(recipe)
    data, scales = quantize_rows_bytes(y, recipe)
    return data, scales if qc.QUANT_RECIPES[recipe][1] else scales.view(torch.float8_e8m0fnu)


def quantize_rows_bytes(y: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_reference`` with E8M0 scales as uint8 bytes, which every compile backend handles."""
    hidden = y.shape[-1]
    block = block_of(recipe)
    blocks = scale_blocks(hidden, recipe)
    padded = torch.nn.functional.pad(y.float(), (0, blocks * block - hidden))
    padded = padded.reshape(*y.shape[:-1], blocks, block)
    e = scale_exponent(amax_bits(padded), recipe)
    scaled = padded * inverse_scale(e).unsqueeze(-1)
    data = scaled.clamp(-qc.E4M3_MAX, qc.E4M3_MAX).to(torch.float8_e4m3fn)
    data = data.reshape(*y.shape[:-1], blocks * block)[..., :hidden]
    if qc.QUANT_RECIPES[recipe][1]:
        scales = torch.where(e == qc.E8M0_NAN, qc.FP32_NAN_BITS, e << 23).int().view(torch.float32)
    else:
        scales = e.to(torch.uint8)
    return data.contiguous(), scales


def canonical_nan_bytes(data: torch.Tensor) -> torch.Tensor:
    """e4m3 ``data``'s bytes with both NaN encodings as 0x7F (CPU and GPU NaNs differ in sign)."""
    b = data.view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b)


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, recipe: str) -> torch.Tensor:
    """FP32 ``data * scale`` from e4m3 data and compact scales (for checks and examples)."""
    hidden = data.shape[-1]
    expanded = scales.float().repeat_interleave(block_of(recipe), dim=-1)[..., :hidden]
    return data.float() * expanded


def normalized_reference(x, w, eps, residual=None, weight_offset=0.0, rstd=None):
    """``(y FP32, rstd, h)`` at the kernel's rounding points; rstd computed in FP32 unless given (a kernel's
    row sum order is not a torch sum's)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    if rstd is None:
        rstd = torch.rsqrt(hf.square().mean(dim=-1) + eps).reshape(-1)
    w32 = w.float() + weight_offset if weight_offset != 0.0 else w.float()
    y = hf * rstd.reshape(*h.shape[:-1], 1) * w32
    return y, rstd, h


def rmsnorm_fp8_reference(
    x, w, eps, residual=None, recipe="mxfp8", emit_y=False, weight_offset=0.0, rstd=None
):
    """``(data, compact scales, y or None, rstd, h_new or None)`` in torch (any device)."""
    y32, rstd, h = normalized_reference(x, w, eps, residual, weight_offset, rstd)
    data, scales = quantize_rows_reference(y32, recipe)
    y = as_output(y32, x) if emit_y else None
    return data, scales, y, rstd, (as_output(h, x) if residual is not None else None)


# ---------------------------------------------------------------------------------------------------
# Scale layouts


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def to_cublas_mx_scales(scales: torch.Tensor) -> torch.Tensor:
    """Compact (T, blocks) E8M0 scales -> cuBLAS's swizzled (roundup(T, 128), roundup(blocks, 4))."""
    _check_scales("scales", scales, torch.float8_e8m0fnu, 2)
    rows, blocks = scales.shape
    tr, tc = _CUBLAS_TILE
    prows, pcols = _roundup(rows, tr), _roundup(blocks, tc)
    padded = scales.new_zeros((prows, pcols), dtype=torch.uint8)
    padded[:rows, :blocks] = scales.view(torch.uint8)
    # (row tile, 4 row groups of 32, 32, col tile, 4) -> (row tile, col tile, 32, 4 row groups, 4)
    tiles = padded.view(prows // tr, 4, 32, pcols // tc, tc).permute(0, 3, 2, 1, 4)
    return tiles.reshape(prows, pcols).view(torch.float8_e8m0fnu)


def from_cublas_mx_scales(swizzled: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """cuBLAS's swizzled MXFP8 scales -> compact (rows, blocks)."""
    _check_scales("swizzled", swizzled, torch.float8_e8m0fnu, 2)
    tr, tc = _CUBLAS_TILE
    prows, pcols = _roundup(rows, tr), _roundup(blocks, tc)
    if tuple(swizzled.shape) != (prows, pcols):
        raise ValueError(f"swizzled must have shape ({prows}, {pcols}), got {tuple(swizzled.shape)}")
    tiles = swizzled.contiguous().view(torch.uint8).view(prows // tr, pcols // tc, 32, 4, tc)
    compact = tiles.permute(0, 3, 2, 1, 4).reshape(prows, pcols)
    return compact[:rows, :blocks].contiguous().view(torch.float8_e8m0fnu)


def to_deepgemm_scales(scales: torch.Tensor) -> torch.Tensor:
    """Compact (T, blocks) FP32 scales -> DeepGEMM's MN-major view over a zero-padded buffer."""
    _check_scales("scales", scales, torch.float32, 2)
    rows, blocks = scales.shape
    buffer = scales.new_zeros((blocks, _roundup(rows, _DEEPGEMM_ROW_ALIGN)))
    buffer[:, :rows] = scales.t()
    return buffer[:, :rows].t()


def from_deepgemm_scales(scales: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's MN-major FP32 scales (any strides) -> compact contiguous (T, blocks)."""
    _check_scales("scales", scales, torch.float32, 2)
    return scales.contiguous()


def _check_scales(name, t, dtype, dims) -> None:
    v.check_tensor(name, t, dtypes=(dtype,))
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def to_scale_layout(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """Compact scales (…, blocks) -> ``layout`` (the GEMM layouts take the leading dims as T)."""
    if layout == "compact":
        return scales
    rows_2d = scales.reshape(-1, scales.shape[-1])
    return to_cublas_mx_scales(rows_2d) if layout == "cublas" else to_deepgemm_scales(rows_2d)
