"""Pure-torch reference of the gated RMSNorms, forward and backward, in a chosen compute dtype: in FP64
the reference the GPU tests measure against, in FP32 the kernels' operations. Statistics per group of
``group_size`` columns, act SiLU or sigmoid:

    norm then gate:  y = x * rstd * (w + offset) * act(z)
    gate then norm:  y = (x * act(z)) * rstd_group * (w + offset)

The backward is the closed form the kernel evaluates; the CPU tests check it against autograd.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..vocab import SIGMOID, SILU


def _groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """(T, H) -> (T, H / group_size, group_size) (the group count named: T may be 0)."""
    return t.reshape(t.shape[0], t.shape[1] // group_size, group_size)


def gate_terms(z: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(z), act'(z)) in z's dtype, with torch's silu and sigmoid."""
    s = torch.sigmoid(z)
    if activation == SIGMOID:
        return s, s * (1 - s)
    return F.silu(z), s * (1 + z * (1 - s))


class _Forward(NamedTuple):
    """The forward's values in the compute dtype, which the backward recomputes from x and z."""

    x: torch.Tensor
    gate: torch.Tensor  # act(z)
    dgate: torch.Tensor  # act'(z)
    w: torch.Tensor  # w + weight_offset
    rstd: torch.Tensor  # (T, H / group_size)
    n: torch.Tensor  # the normalized values: (x, or x * act(z)) * rstd per group
    group_size: int
    norm_before_gate: bool


def _forward(
    x: torch.Tensor,
    z: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    weight_offset: float = 0.0,
    activation: str = SILU,
    compute_dtype: torch.dtype = torch.float64,
) -> _Forward:
    """The values both references start from (options: ``gated_forward_reference``'s)."""
    group_size = group_size or x.shape[-1]
    x, z = x.to(compute_dtype), z.to(compute_dtype)
    gate, dgate = gate_terms(z, activation)
    h = x if norm_before_gate else x * gate
    hg = _groups(h, group_size)
    rstd = torch.rsqrt(hg.square().mean(-1) + eps)
    n = (hg * rstd.unsqueeze(-1)).reshape(h.shape)
    w = w.to(compute_dtype) + weight_offset
    return _Forward(x, gate, dgate, w, rstd, n, group_size, norm_before_gate)


def gated_forward_reference(
    x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated forward of (T, H) rows: ``(y, rstd)`` in ``compute_dtype``, unrounded. Options
    (keyword only): ``group_size``, ``norm_before_gate``, ``weight_offset``, ``activation``,
    ``compute_dtype`` (default FP64); TypeError for any other."""
    f = _forward(x, z, w, eps, **options)
    y = f.n * f.w
    return (y * f.gate if f.norm_before_gate else y), f.rstd


def gated_backward_reference(
    g: torch.Tensor, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, **options
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated backward, recomputing the gate and statistics: ``(dx, dz, dw)`` in ``compute_dtype``,
    unrounded; options as for ``gated_forward_reference``."""
    f = _forward(x, z, w, eps, **options)
    g = g.to(f.n.dtype)
    a = g * f.w * f.gate if f.norm_before_gate else g * f.w
    a_groups, n_groups = _groups(a, f.group_size), _groups(f.n, f.group_size)
    c = (a_groups * n_groups).mean(-1, keepdim=True)
    dn = ((a_groups - n_groups * c) * f.rstd.unsqueeze(-1)).reshape(f.n.shape)
    if f.norm_before_gate:
        return dn, g * f.n * f.w * f.dgate, (g * f.n * f.gate).sum(0)
    return dn * f.gate, dn * f.x * f.dgate, (g * f.n).sum(0)
