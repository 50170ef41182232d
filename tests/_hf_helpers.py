"""Helpers shared by the Hugging Face tests: counting the norm kernel calls a model makes, and class
names that moved between transformers releases."""

from __future__ import annotations

import importlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cake_cute  # noqa: F401  (registers the cake_cute ops)


class NormCalls(TorchDispatchMode):
    """Counts, while active, the ``cake_cute::rmsnorm_fwd`` calls: ``fused`` (residual mode, an add done
    by the norm kernel) and ``plain``; and torch's adds of two ``[batch, tokens, hidden]`` tensors
    (the residual adds of a decoder, and any other add of that shape): ``same_dtype_adds`` and
    ``mixed_adds`` (operands of two dtypes, type-promoted)."""

    def __init__(self):
        super().__init__()
        self.fused = 0
        self.plain = 0
        self.same_dtype_adds = 0
        self.mixed_adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.cake_cute.rmsnorm_fwd.default:
            residual = args[3] if len(args) > 3 else kwargs.get("residual")
            if residual is None:
                self.plain += 1
            else:
                self.fused += 1
        elif func is torch.ops.aten.add.Tensor and _three_d_pair(args):
            if args[0].dtype == args[1].dtype:
                self.same_dtype_adds += 1
            else:
                self.mixed_adds += 1
        return func(*args, **kwargs)


def _three_d_pair(args) -> bool:
    return (
        len(args) >= 2
        and all(isinstance(a, torch.Tensor) and a.dim() == 3 for a in args[:2])
        and args[0].shape == args[1].shape
    )


def mamba2_gated_norm() -> str:
    """The name of Mamba-2's gated norm class in the installed transformers: ``Mamba2RMSNormGated`` from
    5.25, ``MambaRMSNormGated`` before (the same module under its old name)."""
    try:
        module = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    except ImportError:
        return "Mamba2RMSNormGated"
    return "Mamba2RMSNormGated" if hasattr(module, "Mamba2RMSNormGated") else "MambaRMSNormGated"
