"""The one routing rule every entry follows: which path a call takes.

* ``MATH`` for FP64 activations (no kernel computes in FP64) and inside a ``torch.func`` transform:
  the norm's math in torch operations, which every transform differentiates;
* ``OP`` while torch.compile traces (dynamo cannot trace the launch code), for DTensors (the ops carry
  the sharding rules) and for x off CUDA (the ops' CPU kernels): the ``cake_cute::`` custom ops;
* ``NATIVE`` for plain CUDA tensors in eager once the C++ extension is loaded: it serves the signatures
  the Python path registered and declines the rest;
* ``PYTHON`` otherwise: the Python launch.
"""

from __future__ import annotations

import torch

from .runtime import native
from .validation import PLAIN_TENSOR_TYPES

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch built without distributed has no DTensor, so no input is one

    class DTensor:  # noqa: D101
        pass


MATH = "math"
OP = "op"
NATIVE = "native"
PYTHON = "python"


def route(x, w) -> str:
    """The path of a call on the tensors (x, w): ``MATH``, ``OP``, ``NATIVE`` or ``PYTHON``."""
    if x.dtype is torch.float64 or torch._C._are_functorch_transforms_active():
        return MATH
    plain = type(x) in PLAIN_TENSOR_TYPES and type(w) in PLAIN_TENSOR_TYPES
    if not plain and (isinstance(x, DTensor) or isinstance(w, DTensor)):
        return OP
    if torch.compiler.is_compiling() or not x.is_cuda:
        return OP
    return PYTHON if native.extension is None else NATIVE
