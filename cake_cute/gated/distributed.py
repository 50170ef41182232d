"""DTensor sharding rules of the gated norm's custom ops: any dimension but the last may be sharded (the
heads of ``[T, heads, head_dim]`` under tensor parallelism); the row tensors are ``Shard(d)``, w
``Replicate()``, dw ``Partial()``. A sharded hidden dimension is refused; no strategy needs a
collective inside the norm.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.experimental import register_sharding

from ..distributed import row_placements
from ..vocab import SILU


def _row_placements(x):
    return row_placements(x, norm="gated RMSNorm")


@register_sharding(torch.ops.cake_cute.gated_rmsnorm_fwd.default)
def _forward_sharding(
    x, z, w, eps, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU
):
    """Outputs (y, rstd); inputs (x, z, w, eps, then the options)."""
    options = [None] * 5  # eps, group_size, norm_before_gate, weight_offset, activation
    return [([rows, rows], [rows, rows, Replicate(), *options]) for rows in _row_placements(x)]


@register_sharding(torch.ops.cake_cute.gated_rmsnorm_bwd.default)
def _backward_sharding(
    g, x, z, w, rstd, group_size=None, norm_before_gate=True, weight_offset=0.0, activation=SILU
):
    """Outputs (dx, dz, dw); inputs (g, x, z, w, rstd, then the options)."""
    strategies = []
    for rows in _row_placements(x):
        dw = Replicate() if isinstance(rows, Replicate) else Partial()
        options = [None] * 4  # group_size, norm_before_gate, weight_offset, activation
        strategies.append(([rows, rows, dw], [rows, rows, rows, Replicate(), rows, *options]))
    return strategies
