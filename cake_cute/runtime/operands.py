"""The hot path's memory of validated operands: an (x, w) pair whose properties were checked before is
recognised with one dict lookup, and everything after validation reads its facts from one value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..vocab import dtype_name
from . import device as dev
from .specs import KernelSpec


@dataclass(frozen=True, eq=False)  # one instance per validated signature: identity hashing is cheap
class Operands:
    """What validating (x, w) established, for everything after it: device, sizes, names, alignment."""

    device: torch.device
    hidden: int
    arch: str
    act: str
    w_name: str
    facts: dev.DeviceFacts

    def spec(self, kind: str, **fields) -> KernelSpec:
        """The spec of a plain-norm kernel of ``kind`` for these operands (``fields``: its mode, by name)."""
        return KernelSpec(kind, self.arch, self.act, self.w_name, self.hidden, **fields)


_known_operands: dict[tuple, Operands] = {}


def _operands_key(x, w):
    try:
        return (x.dtype, x.dim(), x.shape[-1], x.device, w.dtype, w.shape, w.device)
    except (AttributeError, IndexError, TypeError):
        return None


def known_operands(x, w) -> Operands | None:
    """``Operands`` of an (x, w) validated before, else None (the caller then runs the full checks)."""
    key = _operands_key(x, w)
    return None if key is None else _known_operands.get(key)


def operands(x, w) -> Operands:
    """After the argument checks: the device check, and the result remembered (CUDA devices only)."""
    key, device = _operands_key(x, w), x.device
    arch = dev.device_arch(device)
    found = Operands(
        device, x.shape[-1], arch, dtype_name(x.dtype), dtype_name(w.dtype), dev.device_facts(device)
    )
    if device.type == "cuda":
        _known_operands[key] = found
    return found


def operands_of(x, w) -> Operands:
    """The (x, w) facts of tensors validated before: ``known_operands``, else ``operands``."""
    return known_operands(x, w) or operands(x, w)
