"""Pure-torch references: the SPEC's math in FP64 (for error measurement) and with the kernels'
rounding points in FP32 (what a faithful kernel must reproduce within FP32 rounding)."""

from __future__ import annotations

import torch


def compute_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype the norm computes in for activations of ``dtype``: FP32, or FP64 for FP64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward_reference(x, w, eps, residual=None, weight_offset=0.0, compute_dtype=torch.float64):
    """(y, rstd, h) with h rounded to x's dtype first, like the kernel; y is returned unrounded in
    ``compute_dtype`` so callers can measure the kernel's error against it."""
    h = x if residual is None else (x.to(compute_dtype) + residual.to(compute_dtype)).to(x.dtype)
    hc = h.to(compute_dtype)
    rstd = torch.rsqrt(hc.square().mean(dim=-1, keepdim=True) + eps)
    y = hc * rstd * (w.to(compute_dtype) + weight_offset)
    return y, rstd.squeeze(-1).reshape(-1), h


def summed_gradient(parts) -> torch.Tensor:
    """The sum of the gradient summands ``parts`` in FP32, left to right, rounded once to their dtype."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(parts[0].dtype)


def backward_reference(g, h, w, rstd, g_residual=None, weight_offset=0.0, compute_dtype=torch.float64):
    """(dx, dw) unrounded in ``compute_dtype``; ``h`` is the saved (rounded) normalized input."""
    hidden = h.shape[-1]
    gc = g.to(compute_dtype).reshape(-1, hidden)
    hc = h.to(compute_dtype).reshape(-1, hidden)
    r = rstd.to(compute_dtype).reshape(-1, 1)
    a = gc * (w.to(compute_dtype) + weight_offset)
    xhat = hc * r
    c = (a * xhat).sum(dim=-1, keepdim=True) / hidden
    dx = r * (a - xhat * c)
    if g_residual is not None:
        dx = dx + g_residual.to(compute_dtype).reshape(-1, hidden)
    return dx.reshape(h.shape), (gc * xhat).sum(dim=0)


def differentiable_backward(g, h, w, eps, g_residual=None, weight_offset=0.0):
    """``(dx, dw)`` as the kernels give them, in torch operations autograd can differentiate again; rstd
    is recomputed from ``h`` so its dependence on h is in the graph."""
    compute = compute_dtype_of(h.dtype)
    rstd = torch.rsqrt(h.to(compute).square().mean(dim=-1) + eps)
    dx, dw = backward_reference(g, h, w, rstd, g_residual, weight_offset, compute)
    return dx.to(h.dtype), dw.to(w.dtype)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in FP64 (0 when both are empty)."""
    a = actual.double().reshape(-1)
    e = expected.double().reshape(-1)
    if e.numel() == 0:
        return 0.0
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def tolerance(dtype: torch.dtype) -> float:
    """Relative-norm tolerance for one rounding to ``dtype`` plus FP32 accumulation."""
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
