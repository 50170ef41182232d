"""RMSNorm forward straight to rowwise block-scaled FP8 (e4m3), with the plain RMSNorm backward.

``y`` of the result carries the gradient of the norm's output (the consuming GEMM's dgrad): the
act-dtype y itself with ``emit_y=True``, else a placeholder that holds no memory. The numerics and the
scale layouts are specified in ``cake_cute.fp8_numerics``. The layers follow the plain norm's: launch in
``launch_fp8``, op in ``library_ops``, Function in ``autograd``; on CPU tensors the op runs the torch
reference, so autograd and torch.compile work without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import validation as v
from .autograd import CakeRMSNormFp8Function
from .calls import fp8_call
from .fp8_numerics import to_scale_layout
from .launch_fp8 import fp8_forward, fp8_variant_specs
from .library_ops import rmsnorm_fp8_fwd
from .routing import MATH, PYTHON, DTensor, route

__all__ = [
    "CakeRMSNormFp8Function",
    "Fp8NormOutput",
    "cake_rmsnorm_fp8",
    "fp8_forward",
    "fp8_variant_specs",
    "rmsnorm_fp8_fwd",
]


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
        FP32, one value per row of x, shaped ``x.shape[:-1]``.
    h_new : torch.Tensor or None
        ``x + residual`` in residual mode (differentiable), else None.
    """

    data: torch.Tensor
    scales: torch.Tensor
    y: torch.Tensor
    rstd: torch.Tensor
    h_new: torch.Tensor | None


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
    memory_efficient=False,
) -> Fp8NormOutput:
    """RMSNorm (optionally ``h = x + residual`` first) written as rowwise block-scaled e4m3.

    Parameters
    ----------
    x : torch.Tensor
        (…, H) bf16/fp16/fp32; or a DTensor sharded on any dimension but the last, or replicated.
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
        The weight is ``w + weight_offset``, added in FP32.
    scale_layout : {"compact", "cublas", "deepgemm"}
        Compact row-major scales, cuBLAS's swizzled MXFP8 layout or DeepGEMM's MN-major FP32 layout.
    memory_efficient : bool
        Only False (xhat cannot be recomputed from e4m3 data within the mode's error bound).

    Returns
    -------
    Fp8NormOutput
        For DTensor inputs each field is placed like x (w's gradient ``Partial()``); no collective runs.

    Raises
    ------
    TypeError, ValueError
        A bad argument, named, before anything runs; a non-compact scale layout for a DTensor x;
        ``memory_efficient=True``.
    RuntimeError
        Inside a ``torch.func`` transform.
    """
    v.refuse_memory_efficient_fp8(memory_efficient)
    v.check_tensor_kinds(x, w, residual)
    path = route(x, w)
    norm = fp8_call(
        x, w, eps, residual, recipe, emit_y, weight_offset, scale_layout, on_gpu=path is PYTHON
    ).norm
    if path is MATH:  # FP64 was refused above: a torch.func transform is active
        raise RuntimeError(
            "cake_rmsnorm_fp8 does not support torch.func transforms (grad, vjp, jvp, jacrev, jacfwd, "
            "vmap): its e4m3 outputs have no derivative; call cake_rmsnorm inside the transform"
        )
    if scale_layout != "compact" and isinstance(x, DTensor):
        raise ValueError(
            f"scale_layout={scale_layout!r} arranges the scales of all rows for one GEMM; a DTensor x "
            "takes scale_layout='compact' (convert each rank's local scales with "
            "cake_cute.fp8_numerics.to_scale_layout)"
        )
    forward = CakeRMSNormFp8Function.apply if path is PYTHON else torch.ops.cake_cute.rmsnorm_fp8_fwd
    data, scales, y, rstd, h_new = forward(x, w, norm.eps, residual, recipe, emit_y, norm.weight_offset)
    return Fp8NormOutput(
        data, to_scale_layout(scales, scale_layout), y, rstd, h_new if residual is not None else None
    )
