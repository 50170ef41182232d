"""Helpers shared by the Hugging Face fusion tests: counting the norm kernel calls a model makes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cake_cute  # noqa: F401  (registers the cake_cute ops)


class NormCalls(TorchDispatchMode):
    """Counts the ``cake_cute::rmsnorm_fwd`` calls made while active: ``fused`` (residual mode, an add
    done by the norm kernel) and ``plain``."""

    def __init__(self):
        super().__init__()
        self.fused = 0
        self.plain = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.cake_cute.rmsnorm_fwd.default:
            residual = args[3] if len(args) > 3 else kwargs.get("residual")
            if residual is None:
                self.plain += 1
            else:
                self.fused += 1
        return func(*args, **kwargs)
