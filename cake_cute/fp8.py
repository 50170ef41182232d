"""RMSNorm forward straight to rowwise block-scaled FP8 (e4m3), with the normal RMSNorm backward.

``cake_rmsnorm_fp8(x, w, eps, residual=None, recipe="mxfp8" | "1x128", ...)`` returns an
``Fp8NormOutput``: the e4m3 data and its scales (not differentiable), rstd, h_new in residual mode, and
``y``, a (…, H) tensor whose gradient is the norm output's gradient (the consuming GEMM's dgrad): the
act-dtype y itself with ``emit_y=True``, else a placeholder that holds no memory (one zero expanded to
x's shape). The backward is the plain RMSNorm backward from (x or h_new, w, rstd).

The numerics (rounding, saturation, NaN/Inf) and the scale layouts (``scale_layout=``: ``"compact"``,
``"cublas"``, ``"deepgemm"``) are specified in ``cake_cute.fp8_numerics``, which holds the torch
reference the kernel ``kernels/rmsnorm_fwd_quant.py`` agrees with bitwise and the layout converters.

On CPU tensors every function here runs the torch reference (forward and backward), so the op, its
autograd and torch.compile work without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import cpu, dispatch, native
from . import validation as v
from .autograd import DTensor
from .build import quant_kind
from .compile_cache import kernel
from .custom_ops import check_forward_arguments, define_op
from .device import on_device
from .fp8_numerics import RECIPES, rmsnorm_fp8_reference, scale_blocks, to_scale_layout
from .kernels.config import QUANT_RECIPES
from .operands import known_operands, operands
from .ops import _native_backward_plan
from .specs import KernelSpec
from .views import aligned_vector, kernel_view, new_output


class Fp8NormOutput(NamedTuple):
    """What ``cake_rmsnorm_fp8`` returns (``cake_cute.fp8_numerics`` states the numerics and layouts).

    Attributes
    ----------
    data : torch.Tensor
        ``torch.float8_e4m3fn`` in x's shape; not differentiable.
    scales : torch.Tensor
        The block scales in the requested scale layout; not differentiable.
    y : torch.Tensor
        Differentiable: the act-dtype y (``emit_y=True``) or a placeholder that holds no memory; its
        gradient (the consuming GEMM's dgrad) flows through the RMSNorm backward.
    rstd : torch.Tensor
        FP32, one value per row of x, in x's leading shape (``x.shape[:-1]``, as DTensor shards it).
    h_new : torch.Tensor or None
        ``x + residual`` in residual mode (differentiable), else None.
    """

    data: torch.Tensor
    scales: torch.Tensor
    y: torch.Tensor
    rstd: torch.Tensor
    h_new: torch.Tensor | None


def fp8_variant_specs(
    archs,
    dtypes,
    hiddens,
    residuals=(False, True),
    recipes=RECIPES,
    emit_ys=(False, True),
    weight_offset=0.0,
    persistents=(False, True),
):
    """The quantizing-forward kernels (``KernelSpec``) for these settings, w in x's dtype (for warmup,
    CLI reports and the compile tests): one CTA per row tile and (``persistents``) persistent
    programs, the latter where they apply (``dispatch.has_persistent_fp8_kernel``); the backward is
    the plain one (``warmup.variant_specs``)."""
    from itertools import product

    return [
        KernelSpec(quant_kind(recipe, emit_y, persistent), arch, act, act, hidden, residual, weight_offset)
        for arch, act, hidden, residual, recipe, emit_y, persistent in product(
            archs, dtypes, hiddens, residuals, recipes, emit_ys, persistents
        )
        if not persistent or dispatch.has_persistent_fp8_kernel(arch, act, hidden, residual)
    ]


# ---------------------------------------------------------------------------------------------------
# Validation


def check_arguments(x, w, eps, residual, recipe, emit_y, weight_offset, scale_layout="compact"):
    """Every argument of ``cake_rmsnorm_fp8``, before anything runs; returns (eps, weight_offset)."""
    check_forward_arguments(x, w, eps, residual)
    weight_offset = v.check_weight_offset(weight_offset)
    v.check_recipe(recipe)
    v.check_bool("emit_y", emit_y)
    v.check_scale_layout(scale_layout, recipe)
    if scale_layout != "compact" and isinstance(x, DTensor):
        raise ValueError(
            f"scale_layout={scale_layout!r} arranges the scales of all rows for one GEMM; a DTensor x "
            "takes scale_layout='compact' (convert each rank's local scales with "
            "cake_cute.fp8_numerics.to_scale_layout)"
        )
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
        programs = dispatch.fp8_forward_programs(rows, hidden, op.act, residual is not None, op.facts)
        kind = quant_kind(recipe, emit_y, persistent=programs > 0)
        fn = kernel(kind, op.arch, op.act, op.w_name, hidden, residual is not None, weight_offset)
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
                *((programs,) if programs else ()),
            )
        native.register_fp8(
            op, x, w, weight_offset, residual is not None, recipe, emit_y, programs, fn, _native_backward_plan
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
        rstd.view(lead),
        None if h_new is None else h_new.view(x.shape),
    )


def fp8_forward(x, w, eps, residual, recipe, emit_y, weight_offset):
    """``(data, compact scales, y or None, rstd, h_new or None)``: the kernel on CUDA, the reference
    elsewhere. Arguments are already checked."""
    if x.device.type == "cuda":
        return _forward_cuda(x, w, eps, residual, recipe, emit_y, weight_offset)
    data, scales, y, rstd, h_new = rmsnorm_fp8_reference(x, w, eps, residual, recipe, emit_y, weight_offset)
    lead = x.shape[:-1]
    return data, scales.reshape(*lead, scales.shape[-1]), y, rstd.reshape(lead), h_new


def _takes_the_op(x, w) -> bool:
    """Whether a call goes through the custom op ``cake_cute::rmsnorm_fp8_fwd`` rather than the
    ``autograd.Function`` below: while torch.compile traces (dynamo cannot trace the launch code), for
    DTensor inputs (the op carries the sharding rule, ``cake_cute.distributed``), and for eager calls on
    plain CUDA tensors once the native extension is loaded (its C++ kernels launch a registered
    signature's kernel and record a C++ autograd node, where the Function costs the host Python at
    every step; the op's C++ kernel hands any other call to the same Python body). The arguments are
    checked before either."""
    if torch.compiler.is_compiling() or isinstance(x, DTensor) or isinstance(w, DTensor):
        return True
    return native.fast is not None and type(x) is torch.Tensor and x.is_cuda


def _placeholder(x: torch.Tensor) -> torch.Tensor:
    """A (…, H) zero without memory: it stands for y in autograd when y is not emitted."""
    return x.new_zeros(()).expand(x.shape)


def _backward_eager(h, w, rstd, g, g_residual, weight_offset):
    from .ops import backward_from_saved

    if h.device.type == "cuda":  # the backward kernel takes rstd as one value per row, flat
        return backward_from_saved(g, h, w, rstd.reshape(-1), g_residual, weight_offset)
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


def _rmsnorm_fp8_fwd_fake(x, w, eps, residual, recipe, emit_y, weight_offset):
    check_arguments(x, w, eps, residual, recipe, emit_y, weight_offset)
    lead = x.shape[:-1]
    blocks = scale_blocks(x.shape[-1], recipe)
    scale_dtype = torch.float32 if QUANT_RECIPES[recipe][1] else torch.float8_e8m0fnu
    return (
        new_output(x, dtype=torch.float8_e4m3fn),
        new_output(x, (*lead, blocks), scale_dtype),
        new_output(x) if emit_y else _placeholder(x),
        new_output(x, lead, torch.float32),
        new_output(x) if residual is not None else x.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, w, _eps, residual, _recipe, _emit_y, weight_offset = inputs
    data, scales, _y, rstd, h_new = output
    ctx.set_materialize_grads(False)  # an unused y or h_new: None, not a zero tensor
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


define_op(
    "rmsnorm_fp8_fwd",
    _FP8_SCHEMA,
    rmsnorm_fp8_fwd,
    fake=_rmsnorm_fp8_fwd_fake,
    backward=_op_backward,
    setup_context=_setup_context,
)
native.provide_fp8_op_body(rmsnorm_fp8_fwd)


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
        (…, H) activations, bf16/fp16/fp32; or a DTensor sharded on any dimension but the last (sequence
        parallel), or replicated.
    w : torch.Tensor
        (H,) weight, x's dtype or FP32 (a ``Replicate()`` DTensor when x is a DTensor).
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
        placeholder that carries the gradient of the norm's output), ``rstd`` (FP32 per row, shaped
        ``x.shape[:-1]``), ``h_new`` (residual mode, differentiable) or None. For DTensor inputs (sharded
        on any dimension but the last, or replicated) each is a DTensor placed like x (``scales`` too;
        w's gradient ``Partial()``), and no collective runs.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, naming it, before anything runs; a scale layout other than ``"compact"``
        for a DTensor x.
    """
    eps, weight_offset = check_arguments(x, w, eps, residual, recipe, emit_y, weight_offset, scale_layout)
    if _takes_the_op(x, w):
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
