"""The forward to rowwise block-scaled FP8 on one device: pick the compiled variant of a validated call,
launch. CUDA tensors run the quantizing kernel (or its persistent form), other devices the torch
reference, which the kernel agrees with bitwise.
"""

from __future__ import annotations

from itertools import product

import torch

from .calls import Fp8Call
from .fp8_numerics import RECIPES, rmsnorm_fp8_reference, scale_blocks
from .kernels.quant_config import QUANT_RECIPES
from .runtime import launch_plan
from .runtime.build import quant_kind
from .runtime.cache import get_kernel
from .runtime.device import on_device
from .runtime.specs import KernelSpec
from .runtime.views import aligned_vector, kernel_view


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
    """The quantizing-forward kernels for these settings, w in x's dtype: the one-tile kernel and, where
    they apply, (``persistents``) persistent programs."""
    return [
        KernelSpec(
            quant_kind(recipe, emit_y, persistent),
            arch,
            act,
            act,
            hidden,
            residual=residual,
            weight_offset=weight_offset,
        )
        for arch, act, hidden, residual, recipe, emit_y, persistent in product(
            archs, dtypes, hiddens, residuals, recipes, emit_ys, persistents
        )
        if not persistent or launch_plan.has_persistent_fp8_kernel(arch, act, hidden, residual)
    ]


def placeholder(x: torch.Tensor) -> torch.Tensor:
    """A (…, H) zero without memory: it stands for y in autograd when y is not emitted."""
    return x.new_zeros(()).expand(x.shape)


def op_outputs(x, data, scales, y, rstd, h_new) -> tuple:
    """``fp8_forward``'s results as the five outputs of ``cake_cute::rmsnorm_fp8_fwd``: y's zero-memory
    placeholder when y is not emitted, an empty h_new in plain mode."""
    return (
        data,
        scales,
        placeholder(x) if y is None else y,
        rstd,
        x.new_empty(0) if h_new is None else h_new,
    )


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output of the kernel path is allocated here (the GPU tests poison them through it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def forward_kernel(operands, rows: int, residual: bool, recipe: str, emit_y: bool, weight_offset: float):
    """``(compiled kernel, programs)`` of a forward to FP8 of ``rows`` rows: programs 0 for the one-tile
    kernel, else the persistent kernel's program count."""
    programs = launch_plan.fp8_forward_programs(rows, operands.hidden, operands.act, residual, operands.facts)
    kind = quant_kind(recipe, emit_y, persistent=programs > 0)
    return get_kernel(operands.spec(kind, residual=residual, weight_offset=weight_offset)), programs


def _forward_cuda(call: Fp8Call):
    norm, recipe, emit_y = call
    x, residual, operands = norm.x, norm.residual, norm.operands
    hidden = operands.hidden
    rows = x.numel() // hidden
    vec = launch_plan.vector_elems(hidden, operands.act)
    fp32_scales = QUANT_RECIPES[recipe][1]
    device = operands.device
    data = _empty((rows, hidden), torch.uint8, device)
    scale_dtype = torch.float32 if fp32_scales else torch.uint8
    scales = _empty((rows, scale_blocks(hidden, recipe)), scale_dtype, device)
    rstd = _empty((rows,), torch.float32, device)
    y = _empty((rows, hidden), x.dtype, device) if emit_y else None
    h_new = _empty((rows, hidden), x.dtype, device) if residual is not None else None
    if rows > 0:
        fn, programs = forward_kernel(
            operands, rows, residual is not None, recipe, emit_y, norm.weight_offset
        )
        with on_device(device):
            fn(
                kernel_view(x, vec),
                None if residual is None else kernel_view(residual, vec),
                aligned_vector(norm.w, vec),
                y,
                h_new,
                rstd,
                data,
                scales,
                norm.eps,
                *((programs,) if programs else ()),
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


def fp8_forward(call: Fp8Call):
    """``(data, compact scales, y or None, rstd, h_new or None)`` of a validated call, rstd shaped
    ``x.shape[:-1]``."""
    if call.norm.operands is not None:
        return _forward_cuda(call)
    x, w, eps, residual, weight_offset = call.norm.math_arguments
    data, scales, y, rstd, h_new = rmsnorm_fp8_reference(
        x, w, eps, residual, call.recipe, call.emit_y, weight_offset
    )
    lead = x.shape[:-1]
    return data, scales.reshape(*lead, scales.shape[-1]), y, rstd.reshape(lead), h_new
