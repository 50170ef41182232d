"""Pure-torch reference of the gated RMSNorms, forward and backward, in a chosen compute dtype.

In FP64 it is the reference the GPU tests measure the kernels against; in FP32 it performs the
kernels' operations (``kernels.gated_fwd``, ``kernels.gated_bwd``) with their one rounding per output
when the caller casts the result to the activation dtype. Both forms, with statistics per group of
``group_size`` columns (``hidden`` for one group per row):

    norm then gate:  y = x * rstd * (w + offset) * silu(z)
    gate then norm:  y = (x * silu(z)) * rstd_group * (w + offset)

The backward is written out in closed form (the formulas the kernel evaluates); the CPU tests check it
against autograd of the forward.
"""

from __future__ import annotations

import torch


def _groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """(T, H) -> (T, H / group_size, group_size) (the group count named: T may be 0)."""
    return t.reshape(t.shape[0], t.shape[1] // group_size, group_size)


def _silu_and_derivative(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(z)
    return z * s, s * (1 + z * (1 - s))


def gated_forward_reference(
    x: torch.Tensor,
    z: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    weight_offset: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated RMSNorm forward of (T, H) rows.

    Parameters
    ----------
    x, z : torch.Tensor
        (T, H) input and gate.
    w : torch.Tensor
        (H,) weight.
    eps : float
        Added to the mean square.
    group_size : int, optional
        Columns per statistics group (default H: one per row).
    norm_before_gate : bool
        Normalize, then gate (Qwen3-Next); False: gate, then normalize (NemotronH, Mamba-2).
    weight_offset : float
        Added to w (1.0 for a ``1 + w`` weight).
    compute_dtype : torch.dtype
        Every operation's dtype: FP64 for the reference, FP32 for the kernels' arithmetic.

    Returns
    -------
    (y, rstd) : y (T, H) and rstd (T, H / group_size), both in ``compute_dtype`` (unrounded).
    """
    group_size = group_size or x.shape[-1]
    x, z = x.to(compute_dtype), z.to(compute_dtype)
    w = w.to(compute_dtype) + weight_offset
    silu, _ = _silu_and_derivative(z)
    h = x if norm_before_gate else x * silu
    hg = _groups(h, group_size)
    rstd = torch.rsqrt(hg.square().mean(-1) + eps)
    y = (hg * rstd.unsqueeze(-1)).reshape(h.shape) * w
    if norm_before_gate:
        y = y * silu
    return y, rstd


def gated_backward_reference(
    g: torch.Tensor,
    x: torch.Tensor,
    z: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    weight_offset: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated RMSNorm backward, recomputing the gate and the statistics from x and z.

    Parameters
    ----------
    g : torch.Tensor
        (T, H) gradient of y.
    x, z, w, eps, group_size, norm_before_gate, weight_offset, compute_dtype
        As for ``gated_forward_reference``.

    Returns
    -------
    (dx, dz, dw) : (T, H), (T, H) and (H,), in ``compute_dtype`` (unrounded).
    """
    group_size = group_size or x.shape[-1]
    _, rstd = gated_forward_reference(
        x, z, w, eps, group_size=group_size, norm_before_gate=norm_before_gate, compute_dtype=compute_dtype
    )
    g, x, z = (t.to(compute_dtype) for t in (g, x, z))
    w = w.to(compute_dtype) + weight_offset
    silu, dsilu = _silu_and_derivative(z)
    h = x if norm_before_gate else x * silu
    n = (_groups(h, group_size) * rstd.unsqueeze(-1)).reshape(h.shape)
    a = g * w * silu if norm_before_gate else g * w
    c = _groups(a * n, group_size).mean(-1, keepdim=True)
    dn = ((_groups(a, group_size) - _groups(n, group_size) * c) * rstd.unsqueeze(-1)).reshape(h.shape)
    if norm_before_gate:
        return dn, g * n * w * dsilu, (g * n * silu).sum(0)
    return dn * silu, dn * x * dsilu, (g * n).sum(0)
