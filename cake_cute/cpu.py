"""The SPEC's math on CPU tensors, registered as the CPU kernels of the ``cake_cute::`` custom ops, so
that a model holding ``CakeRMSNorm`` runs (slowly) without a GPU and the distributed plumbing (DTensor,
FSDP2, DDP over gloo) can be tested on any machine.

Rounding points are the kernels': FP32 compute, h rounded to the activation dtype before it is
normalized, y and dx rounded once at the end, dw summed in FP32. Within FP32 the operations are those of
torch's own CPU ``rms_norm`` and its autograd, in the same order and on the same layouts, so that a CPU
model whose norms are swapped computes bitwise what the stock model computes (residual mode and
``weight_offset`` aside: torch has no such fused forms). Like torch's, the reductions split their work
over output elements, so the thread count does not change them, except where a single output is reduced
(a lone row of at least 32768 elements, or dw at H = 1 over as many rows).
"""

from __future__ import annotations

import torch

from .kernels.config import SCALE_FLOOR
from .reference import forward_reference
from .runtime.views import as_output


def forward(x, w, eps, residual, weight_offset):
    """``(y, rstd, h_new)`` with rstd shaped ``x.shape[:-1]``; h_new is None in plain mode. The outputs
    are laid out as the CUDA kernels' (``views.new_output``), whatever x's layout."""
    y, rstd, h = forward_reference(x, w, eps, residual, weight_offset, compute_dtype=torch.float32)
    rstd = as_output(rstd, x, x.shape[:-1], torch.float32)
    return as_output(y, x), rstd, (None if residual is None else as_output(h, x))


def backward(g, h, w, rstd, g_residual, weight_offset):
    """``(dx, dw)`` for the saved ``h`` (x, or h_new in residual mode); dw in w's dtype.

    The FP32 expression is autograd's through torch's ``rms_norm`` (``rstd**3`` and ``2 h`` from the
    derivative of ``mean(h**2)``), so dx and dw round the same FP32 values torch's do."""
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
    """``(dx, dw)`` from the saved output ``y`` (the memory-efficient mode); dw in w's dtype.

    The kernels' FP32 math: xhat = y / clamp(w + offset) (``xhat_from_output``), then
    c = sum(a * xhat) / H, dx = rstd * (a - xhat * c) [+ g_residual], dw = sum over rows of g * xhat."""
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
    """xhat recomputed from the norm's output as the memory-efficient backward kernel does it: y times
    1 / s, s = w + weight_offset in ``compute_dtype`` with |s| raised to at least
    ``kernels.config.SCALE_FLOOR``, its sign kept (0 counts as positive)."""
    s = w.to(compute_dtype) + weight_offset
    clamped = torch.where(s >= 0, s.clamp(min=SCALE_FLOOR), s.clamp(max=-SCALE_FLOOR))
    return y.to(compute_dtype) * clamped.reciprocal()


def _summed_over_rows(products: torch.Tensor) -> torch.Tensor:
    """dw's FP32 sum of the per-row products over every leading dimension (an [H] input is one row)."""
    return products.sum(dim=tuple(range(products.dim() - 1))) if products.dim() > 1 else products
