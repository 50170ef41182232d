"""RMSNorm forward straight to rowwise block-scaled FP8 (e4m3), with the normal RMSNorm backward.

``cake_rmsnorm_fp8(x, w, eps, residual=None, recipe="mxfp8" | "1x128", ...)`` returns an
``Fp8NormOutput``: the e4m3 data and its scales (not differentiable), rstd, h_new in residual mode, and
``y``, a (…, H) tensor whose gradient is the norm output's gradient (the consuming GEMM's dgrad): the
act-dtype y itself with ``emit_y=True``, else a placeholder that holds no memory (one zero expanded to
x's shape). The backward is the plain RMSNorm backward from (x or h_new, w, rstd).

Numerics (the kernel ``kernels/rmsnorm_fwd_quant.py`` and ``quantize_rows_reference`` agree bitwise):

- The quantized value is the FP32 normalized value ``h * rstd * (w + weight_offset)`` (offset added in
  FP32), never the act-dtype y.
- amax of a block of B columns (32 for ``mxfp8``, 128 for ``1x128``) along H; columns past H (H not a
  multiple of B) count as zeros and are not stored: the last block of a row is shorter.
- Scale exponent ``e`` (biased, as in E8M0): fp32(amax / 448) rounded *up* to a power of two
  (``cvt.rp.satfinite.ue8m0x2.f32``, torchao's RCEIL), saturated to 2^127; a NaN amax gives 255.
  amax = 0 gives e = 0 (2^-127) for ``mxfp8``; ``1x128`` FP32 scales are held normal (e >= 1) and an
  all-zero block gets the scale 1.0.
- ``q = e4m3(y * 2^(127 - e))``: round to nearest even, saturated to +-448 (an infinity becomes
  +-448), NaN stays NaN. A NaN or infinity in a row's input makes that row's rstd NaN or 0, so it
  stays in that row: a NaN row is NaN throughout (``mxfp8`` scale byte 255); in a row with an
  infinity, the block holding it is NaN (inf * 0) and the other blocks are 0.

Scale layouts (``scale_layout=``):

- ``"compact"``: row-major ``(…, ceil(H / B))``; ``torch.float8_e8m0fnu`` for ``mxfp8``, FP32 for ``1x128``.
- ``"cublas"`` (``mxfp8``): cuBLAS / TransformerEngine's swizzled MXFP8 layout, a
  ``(roundup(T, 128), roundup(ceil(H / 32), 4))`` tensor whose bytes are 128x4 tiles in row-major tile
  order, each tile stored as ``offset(r, c) = (r % 32) * 16 + (r // 32) * 4 + c``; padding is byte 0.
- ``"deepgemm"`` (``1x128``): DeepGEMM's MN-major, TMA-aligned FP32 scales: shape ``(T, ceil(H / 128))``,
  strides ``(1, roundup(T, 4))`` (the storage is the transposed ``(ceil(H / 128), roundup(T, 4))``,
  padding 0), as TransformerEngine's blockwise rowwise scale_inv is stored.

``to_cublas_mx_scales`` / ``from_cublas_mx_scales`` and ``to_deepgemm_scales`` / ``from_deepgemm_scales``
convert between the compact and GEMM layouts in both directions.

On CPU tensors every function here runs the torch reference (forward and backward), so the op, its
autograd and torch.compile work without a GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import cpu, dispatch
from . import validation as v
from .build import quant_kind
from .compile_cache import kernel
from .custom_ops import check_forward_arguments
from .device import on_device
from .kernels.config import E4M3_MAX, FP32_BITS_OF_2_POW_M127, FP32_NAN_BITS, QUANT_RECIPES
from .operands import known_operands, operands
from .specs import KernelSpec
from .views import aligned_vector, kernel_view

RECIPES = tuple(QUANT_RECIPES)
SCALE_LAYOUTS = {"compact": RECIPES, "cublas": ("mxfp8",), "deepgemm": ("1x128",)}
_CUBLAS_TILE = (128, 4)
_DEEPGEMM_ROW_ALIGN = 4  # 16 bytes of FP32 scales per TMA row


class Fp8NormOutput(NamedTuple):
    """What ``cake_rmsnorm_fp8`` returns (see the module docstring for the numerics and layouts)."""

    data: torch.Tensor  # torch.float8_e4m3fn, x's shape
    scales: torch.Tensor  # in the requested scale layout
    y: torch.Tensor  # differentiable: the act-dtype y (emit_y) or a zero-memory placeholder
    rstd: torch.Tensor  # FP32, one per row
    h_new: torch.Tensor | None  # x + residual in residual mode (differentiable), else None


def block_of(recipe: str) -> int:
    """Columns per scale block of ``recipe``."""
    return QUANT_RECIPES[recipe][0]


def scale_blocks(hidden: int, recipe: str) -> int:
    """Scales per row: ceil(H / block)."""
    return -(-hidden // block_of(recipe))


# ---------------------------------------------------------------------------------------------------
# Reference numerics


def amax_bits(blocks: torch.Tensor) -> torch.Tensor:
    """Max over the last dim of the FP32 values' bit patterns with the sign cleared (int32): the
    numeric maximum of |value|, with any NaN sorting above infinity (so it propagates)."""
    return (blocks.contiguous().view(torch.int32) & 0x7FFFFFFF).amax(dim=-1)


def e8m0_round_up(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (int32) of fp32(amax / 448) rounded up to a power of two, saturated to
    254 (2^127); 255 for NaN. ``amax`` is the bit pattern from ``amax_bits`` (int32) or FP32."""
    amax = amax.view(torch.float32) if amax.dtype == torch.int32 else amax.float()
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its rounded
    # reciprocal, which is not the IEEE quotient the kernel rounds.
    quotient = amax / torch.full_like(amax, E4M3_MAX)
    bits = quotient.view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    normal = torch.clamp(exponent + (mantissa != 0).int(), max=254)
    subnormal = (mantissa > FP32_BITS_OF_2_POW_M127).int()
    e = torch.where(exponent == 0, subnormal, normal)
    return torch.where(torch.isnan(quotient), 255, e).int()


def inverse_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(127 - e) as FP32, exactly (NaN for e = 255)."""
    bits = torch.where(e == 254, FP32_BITS_OF_2_POW_M127, (254 - e) << 23)
    return torch.where(e == 255, FP32_NAN_BITS, bits).int().view(torch.float32)


def scale_exponent(amax: torch.Tensor, recipe: str) -> torch.Tensor:
    """The biased exponent of each block's scale under ``recipe`` (``amax`` as bits, int32)."""
    e = e8m0_round_up(amax)
    if QUANT_RECIPES[recipe][1]:
        e = torch.where(amax == 0, 127, torch.clamp(e, min=1)).int()
    return e


def quantize_rows_reference(y: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise block-scaled e4m3 of FP32 ``y`` (…, H): ``(data float8_e4m3fn like y, compact scales)``."""
    check_recipe(recipe)
    data, scales = quantize_rows_bytes(y, recipe)
    return data, scales if QUANT_RECIPES[recipe][1] else scales.view(torch.float8_e8m0fnu)


def quantize_rows_bytes(y: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_reference`` with E8M0 scales as their uint8 bytes (a dtype torch.compile's
    code generators all handle; the benchmark compiles this)."""
    hidden = y.shape[-1]
    block = block_of(recipe)
    blocks = scale_blocks(hidden, recipe)
    padded = torch.nn.functional.pad(y.float(), (0, blocks * block - hidden))
    padded = padded.reshape(*y.shape[:-1], blocks, block)
    e = scale_exponent(amax_bits(padded), recipe)
    scaled = padded * inverse_scale(e).unsqueeze(-1)
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    data = data.reshape(*y.shape[:-1], blocks * block)[..., :hidden]
    if QUANT_RECIPES[recipe][1]:
        scales = torch.where(e == 255, FP32_NAN_BITS, e << 23).int().view(torch.float32)
    else:
        scales = e.to(torch.uint8)
    return data.contiguous(), scales


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, recipe: str) -> torch.Tensor:
    """FP32 ``data * scale`` from e4m3 data and compact scales (for checks and examples)."""
    hidden = data.shape[-1]
    expanded = scales.float().repeat_interleave(block_of(recipe), dim=-1)[..., :hidden]
    return data.float() * expanded


def normalized_reference(x, w, eps, residual=None, weight_offset=0.0, rstd=None):
    """``(y FP32, rstd, h)`` with the kernel's rounding points: h rounded to x's dtype in residual
    mode, ``y = h * rstd * (w + offset)`` in FP32 in that order. rstd is computed in FP32 unless given
    (the GPU tests pass the kernel's rstd, whose row sum order a torch sum does not reproduce)."""
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
    y = y32.to(x.dtype) if emit_y else None
    return data, scales, y, rstd, (h if residual is not None else None)


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
    """Compact (T, blocks) FP32 scales -> DeepGEMM's MN-major view: shape (T, blocks), strides
    (1, roundup(T, 4)), over a zero-padded (blocks, roundup(T, 4)) buffer."""
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


def fp8_variant_specs(
    archs, dtypes, hiddens, residuals=(False, True), recipes=RECIPES, emit_ys=(False, True)
):
    """The quantizing-forward kernels (``KernelSpec``) for these settings, w in x's dtype (for warmup,
    CLI reports and the compile tests); the backward is the plain one (``warmup.variant_specs``)."""
    from itertools import product

    return [
        KernelSpec(quant_kind(recipe, emit_y), arch, act, act, hidden, residual)
        for arch, act, hidden, residual, recipe, emit_y in product(
            archs, dtypes, hiddens, residuals, recipes, emit_ys
        )
    ]


# ---------------------------------------------------------------------------------------------------
# Validation


def check_recipe(recipe) -> str:
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a str, one of {RECIPES}; got {type(recipe).__name__}")
    if recipe not in QUANT_RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return recipe


def check_scale_layout(scale_layout, recipe: str) -> str:
    if not isinstance(scale_layout, str):
        raise TypeError(
            f"scale_layout must be a str, one of {tuple(SCALE_LAYOUTS)}; got {type(scale_layout).__name__}"
        )
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {tuple(SCALE_LAYOUTS)}, got {scale_layout!r}")
    if recipe not in SCALE_LAYOUTS[scale_layout]:
        raise ValueError(
            f"scale_layout={scale_layout!r} is for recipe {SCALE_LAYOUTS[scale_layout][0]!r}, not {recipe!r}"
        )
    return scale_layout


def check_arguments(x, w, eps, residual, recipe, emit_y, weight_offset, scale_layout="compact"):
    """Every argument of ``cake_rmsnorm_fp8``, before anything runs; returns (eps, weight_offset)."""
    check_forward_arguments(x, w, eps, residual)
    weight_offset = v.check_weight_offset(weight_offset)
    check_recipe(recipe)
    v.check_bool("emit_y", emit_y)
    check_scale_layout(scale_layout, recipe)
    return v.check_eps(eps), weight_offset


# ---------------------------------------------------------------------------------------------------
# Forward and backward on one device


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output of the kernel path is allocated here (the GPU tests poison them through it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _forward_cuda(x, w, eps, residual, recipe, emit_y, weight_offset):
    op = known_operands(x, w) or operands(x, w)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    vec = dispatch.vector_elems(hidden, op.act)
    fp32_scales = QUANT_RECIPES[recipe][1]
    data = _empty((rows, hidden), torch.uint8, op.device)
    scale_dtype = torch.float32 if fp32_scales else torch.uint8
    scales = _empty((rows, scale_blocks(hidden, recipe)), scale_dtype, op.device)
    rstd = _empty((rows,), torch.float32, op.device)
    y = _empty((rows, hidden), x.dtype, op.device) if emit_y else None
    h_new = _empty((rows, hidden), x.dtype, op.device) if residual is not None else None
    if rows > 0:
        fn = kernel(
            quant_kind(recipe, emit_y),
            op.arch,
            op.act,
            op.w_name,
            hidden,
            residual is not None,
            weight_offset,
        )
        with on_device(op.device):
            fn(
                kernel_view(x, vec),
                None if residual is None else kernel_view(residual, vec),
                aligned_vector(w, vec),
                y,
                h_new,
                rstd,
                data,
                scales,
                eps,
            )
    lead = x.shape[:-1]
    data = data.view(torch.float8_e4m3fn).view(x.shape)
    scales = scales.view(*lead, scales.shape[-1])
    if not fp32_scales:
        scales = scales.view(torch.float8_e8m0fnu)
    return (
        data,
        scales,
        None if y is None else y.view(x.shape),
        rstd,
        None if h_new is None else h_new.view(x.shape),
    )


def fp8_forward(x, w, eps, residual, recipe, emit_y, weight_offset):
    """``(data, compact scales, y or None, rstd, h_new or None)``: the kernel on CUDA, the reference
    elsewhere. Arguments are already checked."""
    if x.device.type == "cuda":
        return _forward_cuda(x, w, eps, residual, recipe, emit_y, weight_offset)
    data, scales, y, rstd, h_new = rmsnorm_fp8_reference(x, w, eps, residual, recipe, emit_y, weight_offset)
    return data, scales.reshape(*x.shape[:-1], scales.shape[-1]), y, rstd, h_new


def _placeholder(x: torch.Tensor) -> torch.Tensor:
    """A (…, H) zero without memory: it stands for y in autograd when y is not emitted."""
    return x.new_zeros(()).expand(x.shape)


def _backward_eager(h, w, rstd, g, g_residual, weight_offset):
    from .ops import backward_from_saved

    if h.device.type == "cuda":
        return backward_from_saved(g, h, w, rstd, g_residual, weight_offset)
    return cpu.backward(g, h, w, rstd, g_residual, weight_offset)


class CakeRMSNormFp8Function(torch.autograd.Function):
    """``forward(ctx, x, w, eps, residual, recipe, emit_y, weight_offset)`` ->
    ``(data, compact scales, y or placeholder, rstd, h_new or empty)``; saves (x or h_new, w, rstd)."""

    @staticmethod
    def forward(ctx, x, w, eps, residual, recipe, emit_y, weight_offset):
        data, scales, y, rstd, h_new = fp8_forward(x, w, eps, residual, recipe, emit_y, weight_offset)
        ctx.save_for_backward(x if residual is None else h_new, w, rstd)
        ctx.mark_non_differentiable(data, scales, rstd)
        ctx.set_materialize_grads(False)
        ctx.residual = residual is not None
        ctx.weight_offset = weight_offset
        return (
            data,
            scales,
            (y if emit_y else _placeholder(x)),
            rstd,
            (x.new_empty(0) if h_new is None else h_new),
        )

    @staticmethod
    def backward(ctx, _g_data, _g_scales, g, _g_rstd, g_h_new):
        h, w, rstd = ctx.saved_tensors
        g_residual = g_h_new if ctx.residual else None
        if g is None:
            return g_residual, None, None, g_residual, None, None, None
        dx, dw = _backward_eager(h, w, rstd, g.contiguous(), g_residual, ctx.weight_offset)
        return dx, dw, None, (dx if ctx.residual else None), None, None, None


# ---------------------------------------------------------------------------------------------------
# The custom op (torch.compile) and the public function

_FP8_SCHEMA = (
    "(Tensor x, Tensor w, float eps, Tensor? residual, str recipe, bool emit_y, float weight_offset) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("cake_cute::rmsnorm_fp8_fwd", mutates_args=(), schema=_FP8_SCHEMA)
def rmsnorm_fp8_fwd(x, w, eps, residual, recipe, emit_y, weight_offset):
    """``(data, compact scales, y, rstd, h_new)``: y is the act-dtype output (emit_y) or the
    zero-memory placeholder, h_new an empty tensor in plain mode (a schema has a fixed number of
    outputs)."""
    data, scales, y, rstd, h_new = fp8_forward(x, w, eps, residual, recipe, emit_y, weight_offset)
    return (
        data,
        scales,
        _placeholder(x) if y is None else y,
        rstd,
        x.new_empty(0) if h_new is None else h_new,
    )


@rmsnorm_fp8_fwd.register_fake
def _rmsnorm_fp8_fwd_fake(x, w, eps, residual, recipe, emit_y, weight_offset):
    check_arguments(x, w, eps, residual, recipe, emit_y, weight_offset)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    blocks = scale_blocks(x.shape[-1], recipe)
    scale_dtype = torch.float32 if QUANT_RECIPES[recipe][1] else torch.float8_e8m0fnu
    return (
        x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
        x.new_empty((*lead, blocks), dtype=scale_dtype),
        x.new_empty(x.shape) if emit_y else _placeholder(x),
        x.new_empty((rows,), dtype=torch.float32),
        x.new_empty(x.shape) if residual is not None else x.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, w, _eps, residual, _recipe, _emit_y, weight_offset = inputs
    data, scales, _y, rstd, h_new = output
    ctx.mark_non_differentiable(data, scales, rstd)
    ctx.save_for_backward(x if residual is None else h_new, w, rstd)
    ctx.residual = residual is not None
    ctx.weight_offset = weight_offset


def _op_backward(ctx, _g_data, _g_scales, g, _g_rstd, g_h_new):
    h, w, rstd = ctx.saved_tensors
    g_residual = g_h_new if ctx.residual else None
    if g is None:
        return g_residual, None, None, g_residual, None, None, None
    dx, dw = torch.ops.cake_cute.rmsnorm_bwd(g, h, w, rstd, g_residual, ctx.weight_offset, True)
    return dx, dw, None, (dx if ctx.residual else None), None, None, None


rmsnorm_fp8_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def cake_rmsnorm_fp8(
    x,
    w,
    eps=1e-6,
    residual=None,
    *,
    recipe="mxfp8",
    emit_y=False,
    weight_offset=0.0,
    scale_layout="compact",
) -> Fp8NormOutput:
    """RMSNorm (optionally ``h = x + residual`` first) written as rowwise block-scaled e4m3.

    Parameters
    ----------
    x : torch.Tensor
        (…, H) activations, bf16/fp16/fp32.
    w : torch.Tensor
        (H,) weight, x's dtype or FP32.
    eps : float
        Added to the mean square.
    residual : torch.Tensor, optional
        Added to x first (rounded to x's dtype); h_new is returned.
    recipe : {"mxfp8", "1x128"}
        1x32 blocks with E8M0 scales, or 1x128 blocks with FP32 power-of-two scales.
    emit_y : bool
        Also write the act-dtype y (returned as ``y``).
    weight_offset : float
        Gemma-style offset: the weight is ``w + weight_offset``, added in FP32.
    scale_layout : {"compact", "cublas", "deepgemm"}
        Compact row-major scales, cuBLAS's swizzled MXFP8 layout or DeepGEMM's MN-major FP32 layout.

    Returns
    -------
    Fp8NormOutput
        ``data`` (float8_e4m3fn, x's shape), ``scales``, ``y`` (differentiable: y or a zero-memory
        placeholder that carries the gradient of the norm's output), ``rstd`` (FP32 per row), ``h_new``
        (residual mode, differentiable) or None.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it, before anything runs.
    """
    eps, weight_offset = check_arguments(x, w, eps, residual, recipe, emit_y, weight_offset, scale_layout)
    if torch.compiler.is_compiling():
        data, scales, y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fp8_fwd(
            x, w, eps, residual, recipe, emit_y, weight_offset
        )
    else:
        data, scales, y, rstd, h_new = CakeRMSNormFp8Function.apply(
            x, w, eps, residual, recipe, emit_y, weight_offset
        )
    return Fp8NormOutput(
        data, to_scale_layout(scales, scale_layout), y, rstd, h_new if residual is not None else None
    )
