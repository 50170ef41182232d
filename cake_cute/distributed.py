"""DTensor support: sharding rules for the ``cake_cute::`` custom ops, and a sequence-parallel style for
``CakeRMSNorm`` in residual mode.

The rules mirror aten's for ``_fused_rms_norm``: for every dimension d but the hidden one, the row
tensors (x, residual, g, y, h_new, rstd, dx, the FP8 data and scales) are ``Shard(d)``, w is
``Replicate()`` and dw ``Partial()`` (each rank's sum over its own rows); all ``Replicate()`` works too.
A sharded hidden dimension is refused rather than silently all-gathered. No strategy needs a collective
in the norm itself. Importing ``cake_cute`` registers the rules.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import SequenceParallel

from .forward_names import INPUT_NAME
from .validation import check_bool, check_count

__all__ = ["SequenceParallelResidual"]


def _refuse_a_sharded_hidden_dim(x, norm: str) -> None:
    """Refuse a DTensorSpec ``x`` sharded on its hidden dimension; ``norm`` names the norm in the error."""
    hidden_dim = x.ndim - 1
    for placement in x.placements:
        if isinstance(placement, Shard) and placement.dim in (hidden_dim, -1):
            raise ValueError(
                f"cake_cute {norm} normalizes over the last (hidden) dimension, which this DTensor shards "
                f"({tuple(x.placements)} over a {x.ndim}-D tensor); shard another dimension (sequence, "
                "batch, heads), or redistribute to Replicate() before the norm"
            )


def row_placements(x, norm: str = "RMSNorm"):
    """Replicate() and Shard(d) for every non-hidden dimension d of the DTensorSpec ``x``."""
    _refuse_a_sharded_hidden_dim(x, norm)
    return [Replicate(), *(Shard(d) for d in range(x.ndim - 1))]


def _forward_strategies(x, residual, row_outputs: int, options: int):
    """A forward op's strategies: ``row_outputs`` outputs placed like the rows, then h_new."""
    strategies = []
    for rows in row_placements(x):
        # In plain mode h_new is an empty tensor: replicated, whatever x is.
        h_new, res = (Replicate(), None) if residual is None else (rows, rows)
        strategies.append(([*[rows] * row_outputs, h_new], [rows, Replicate(), None, res, *[None] * options]))
    return strategies


# The memory-efficient mode's ops (``library_ops``) take the default ops' rules.
@register_sharding(
    [torch.ops.cake_cute.rmsnorm_fwd.default, torch.ops.cake_cute.rmsnorm_fwd_saving_output.default]
)
def _forward_sharding(x, w, eps, residual=None, weight_offset=0.0):
    """Outputs (y, rstd, h_new), inputs (x, w, eps, residual, weight_offset)."""
    return _forward_strategies(x, residual, row_outputs=2, options=1)


@register_sharding(
    [torch.ops.cake_cute.rmsnorm_bwd.default, torch.ops.cake_cute.rmsnorm_bwd_from_output.default]
)
def _backward_sharding(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    """Outputs (dx, dw), inputs (g, x, w, rstd, g_residual, weight_offset)."""
    strategies = []
    for rows in row_placements(x):
        dw = Replicate() if isinstance(rows, Replicate) else Partial()
        g_res = None if g_residual is None else rows
        strategies.append(([rows, dw], [rows, rows, Replicate(), rows, g_res, None]))
    return strategies


@register_sharding(torch.ops.cake_cute.rmsnorm_fp8_fwd.default)
def _fp8_forward_sharding(x, w, eps, residual, recipe, emit_y, weight_offset):
    """Outputs (data, scales, y, rstd, h_new): the (…, blocks) scales and y shard like the rows."""
    return _forward_strategies(x, residual, row_outputs=4, options=3)


class SequenceParallelResidual(SequenceParallel):
    """``SequenceParallel`` for a norm called as ``norm(x, residual=r)``, returning ``(y, h_new)``.

    Stock ``SequenceParallel`` converts only the first positional input, so a residual would reach the
    norm as a plain tensor. This style converts x and the residual alike (a local tensor is this rank's
    shard of the sequence; a DTensor is redistributed to ``Shard(sequence_dim)``), replicates the weight,
    and returns both outputs sharded on the sequence dimension.

    Parameters
    ----------
    sequence_dim : int
        The sequence dimension of x and residual (1 for ``[batch, seq, hidden]``).
    use_local_output : bool
        Return local tensors instead of DTensors.

    Raises
    ------
    TypeError
        sequence_dim is not an int; use_local_output is not a bool.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__(
            sequence_dim=check_count("sequence_dim", sequence_dim, None),
            use_local_output=check_bool("use_local_output", use_local_output),
        )

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._replicate_module_fn("", module, device_mesh)
        module.register_forward_pre_hook(self._make_pre_hook(device_mesh), with_kwargs=True)
        module.register_forward_hook(self._make_post_hook())
        return module

    def _make_pre_hook(self, device_mesh):
        def to_sequence_shards(module, args, kwargs):
            def convert(t):
                return self._prepare_input_fn(self.sequence_sharding, module, (t,), device_mesh)

            args = tuple(convert(a) if isinstance(a, torch.Tensor) else a for a in args)
            tensors = {
                k: convert(kwargs[k])
                for k in (INPUT_NAME, "residual")  # the module's input by keyword: torch's name for it
                if isinstance(kwargs.get(k), torch.Tensor)
            }
            kwargs = {**kwargs, **tensors}
            return args, kwargs

        return to_sequence_shards

    def _make_post_hook(self):
        def outputs(module, _args, output):
            if not self.use_local_output:
                return output
            if isinstance(output, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in output)
            return output.to_local()

        return outputs
