"""The SPEC's math on CPU tensors, as the CPU kernels of the ``cake_cute::`` custom ops, so a model
holding ``CakeRMSNorm`` runs without a GPU and the distributed plumbing can be tested anywhere.

Rounding points are the kernels'. Within FP32 the operations are those of torch's CPU ``rms_norm`` and
its autograd, in the same order, so a CPU model whose norms are swapped computes bitwise what the stock
model computes (the fused residual and ``weight_offset`` aside). The reductions split over output
elements, so the thread count does not change them, except where a single output is reduced (a lone
row of at least 32768 elements, or dw at H = 1).
"""

from __future__ import annotations

import torch

from .kernels.config import SCALE_FLOOR
from .reference import forward_reference
from .runtime.views import as_output


def forward(x, w, eps, residual, weight_offset):
    """``(y, rstd, h_new)``, rstd shaped ``x.shape[:-1]``, h_new None in plain mode."""
    y, rstd, h = forward_reference(x, w, eps, residual, weight_offset, compute_dtype=torch.float32)
    rstd = as_output(rstd, x, x.shape[:-1], torch.float32)
    return as_output(y, x), rstd, (None if residual is None else as_output(h, x))


def backward(g, h, w, rstd, g_residual, weight_offset):
    """``(dx, dw)`` for the saved ``h`` in the FP32 expression of autograd through torch's ``rms_norm``, so
    they round the same values torch's do."""
    hidden = h.shape[-1]
    gf, hf = g.float(), h.float()
    r = rstd.reshape(*h.shape[:-1], 1)
    a = gf * (w.float() + weight_offset)
    dw = _summed_over_rows(gf * (hf * r))
    d_mean_square = ((a * hf).sum(dim=-1, keepdim=True) * -0.5) * r.pow(3)
    dx = a * r + (d_mean_square.expand(h.shape) / hidden) * (hf * 2.0)
    if g_residual is not None:
        dx = dx + g_residual.float()
    return as_output(dx, h), as_output(dw, w)


def backward_from_output(g, y, w, rstd, g_residual, weight_offset):
    """``(dx, dw)`` from the saved output ``y`` (the memory-efficient mode) in the kernels' FP32 math."""
    hidden = y.shape[-1]
    gf = g.float()
    r = rstd.reshape(*y.shape[:-1], 1)
    a = gf * (w.float() + weight_offset)
    xhat = xhat_from_output(y, w, weight_offset)
    c = (a * xhat).sum(dim=-1, keepdim=True) / hidden
    dx = r * (a - xhat * c)
    if g_residual is not None:
        dx = dx + g_residual.float()
    return as_output(dx, y), as_output(_summed_over_rows(gf * xhat), w)


def xhat_from_output(y, w, weight_offset, compute_dtype=torch.float32) -> torch.Tensor:
    """xhat = y / s as the memory-efficient backward kernel recomputes it (|s| floored at ``SCALE_FLOOR``)."""
    s = w.to(compute_dtype) + weight_offset
    clamped = torch.where(s >= 0, s.clamp(min=SCALE_FLOOR), s.clamp(max=-SCALE_FLOOR))
    return y.to(compute_dtype) * clamped.reciprocal()


def _summed_over_rows(products: torch.Tensor) -> torch.Tensor:
    """dw's FP32 sum of the per-row products over every leading dimension (an [H] input is one row)."""
    return products.sum(dim=tuple(range(products.dim() - 1))) if products.dim() > 1 else products
