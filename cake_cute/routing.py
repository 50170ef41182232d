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
from .validation import check_tensor

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch built without distributed has no DTensor, so no input is one

    class DTensor:  # noqa: D101
        pass


MATH = "math"
OP = "op"
NATIVE = "native"
PYTHON = "python"

# The exact types of plain tensors: one set lookup each on the hot path, where the isinstance checks
# (a tensor at all? a DTensor?) run only for other types.
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def route(x, w, residual=None) -> str:
    """The path of a call on (x, w[, residual]): ``MATH``, ``OP``, ``NATIVE`` or ``PYTHON``.

    Raises
    ------
    TypeError
        x or w is not a tensor, or residual is neither None nor a tensor.
    """
    plain = type(x) in _PLAIN_TYPES and type(w) in _PLAIN_TYPES
    if not plain:  # a tensor subclass (a DTensor), or not a tensor at all
        check_tensor("x", x)
        check_tensor("w", w)
    if residual is not None and type(residual) not in _PLAIN_TYPES:
        check_tensor("residual", residual)
    if x.dtype is torch.float64 or torch._C._are_functorch_transforms_active():
        return MATH
    if not plain and (isinstance(x, DTensor) or isinstance(w, DTensor)):
        return OP
    if torch.compiler.is_compiling() or not x.is_cuda:
        return OP
    return PYTHON if native.extension is None else NATIVE
