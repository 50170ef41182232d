"""The SPEC's math on CPU tensors, registered as the CPU kernels of the ``cake_cute::`` custom ops, so
that a model holding ``CakeRMSNorm`` runs (slowly) without a GPU and the distributed plumbing (DTensor,
FSDP2, DDP over gloo) can be tested on any machine.

Rounding points are the kernels': FP32 compute, h rounded to the activation dtype before it is
normalized, y and dx rounded once at the end. dw is summed over rows by a sequential scan
(``torch.cumsum`` along the rows, whose CPU loop runs row by row), so its order is fixed and does not
depend on the number of threads.
"""

from __future__ import annotations

import torch

from .reference import backward_terms, forward_reference
from .views import as_output


def forward(x, w, eps, residual, weight_offset):
    """``(y, rstd, h_new)`` with rstd shaped ``x.shape[:-1]``; h_new is None in plain mode. The outputs
    are laid out as the CUDA kernels' (``views.new_output``), whatever x's layout."""
    y, rstd, h = forward_reference(x, w, eps, residual, weight_offset, compute_dtype=torch.float32)
    rstd = as_output(rstd, x, x.shape[:-1], torch.float32)
    return as_output(y, x), rstd, (None if residual is None else as_output(h, x))


def backward(g, h, w, rstd, g_residual, weight_offset):
    """``(dx, dw)`` for the saved ``h`` (x, or h_new in residual mode); dw in w's dtype."""
    dx, products = backward_terms(g, h, w, rstd, g_residual, weight_offset, compute_dtype=torch.float32)
    # The last running sum, copied out of the cumsum's storage: an output must not be a view into it.
    dw = products.cumsum(dim=0)[-1].clone() if products.shape[0] else products.new_zeros(h.shape[-1])
    return as_output(dx, h), as_output(dw, w)
