"""The autograd modes a stock norm supports, as functions the CPU and GPU tests share: second-order
gradients (a gradient penalty) and the ``torch.func`` transforms, each compared against FP64 torch.

Each check returns the largest relative error of the entry's results (computed in the entry's dtype)
against the same computation in FP64 with the reference function; the tests bound it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

from cake_cute import cake_gated_rmsnorm
from cake_cute.gated.reference import gated_forward_reference
from cake_cute.reference import rel_error

EPS = 1e-6
TRANSFORMS = ("grad", "vjp", "jvp", "jacrev", "jacfwd", "vmap")


def plain_reference(x, w, residual=None, weight_offset=0.0):
    """F.rms_norm in FP64 (h = x + residual first in residual mode, returned beside y)."""
    h = x.double() if residual is None else x.double() + residual.double()
    y = F.rms_norm(h, (h.shape[-1],), w.double() + weight_offset, EPS)
    return y if residual is None else (y, h)


def gated_reference(x, z, w, group_size=None, norm_before_gate=True, activation="silu"):
    """The gated norm's forward in FP64 over [..., H] rows."""
    hidden = x.shape[-1]
    y, _ = gated_forward_reference(
        x.double().reshape(-1, hidden),
        z.double().reshape(-1, hidden),
        w.double(),
        EPS,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        activation=activation,
    )
    return y.reshape(x.shape)


def gated_entry_and_reference(**options):
    """``(cake_gated_rmsnorm, gated_reference)`` of (x, z, w), both with the gated ``options``."""

    def entry(x, z, w):
        return cake_gated_rmsnorm(x, z, w, EPS, **options)

    def reference(x, z, w):
        return gated_reference(x, z, w, **options)

    return entry, reference


def _combined(out):
    """One tensor from an entry's output: y, or a fixed mix of (y, h_new)."""
    return out[0] * 1.25 + out[1] * 0.75 if isinstance(out, tuple) else out


def _weights(like: torch.Tensor) -> torch.Tensor:
    """A fixed, non-uniform upstream gradient (a uniform one makes the norm's dx vanish)."""
    return torch.linspace(-1.0, 1.5, like.numel(), dtype=like.dtype, device=like.device).reshape(like.shape)


def gradient_penalty(fn, inputs):
    """d/d(inputs) of the squared norm of d(sum(weights * fn(inputs)))/d(inputs): a double backward."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = _combined(fn(*leaves))
    first = torch.autograd.grad((y * _weights(y)).sum(), leaves, create_graph=True)
    penalty = sum(g.float().pow(2).sum() if g.dtype != torch.float64 else g.pow(2).sum() for g in first)
    return torch.autograd.grad(penalty, leaves)


def second_order_error(fn, reference, inputs) -> float:
    """The largest relative error of ``fn``'s gradient-penalty gradients against ``reference``'s in FP64."""
    got = gradient_penalty(fn, inputs)
    expected = gradient_penalty(reference, [t.double() for t in inputs])
    return max(rel_error(a, e) for a, e in zip(got, expected))


def transform(name: str, fn, inputs):
    """The result of the ``torch.func`` transform ``name`` over ``fn`` at ``inputs``, as a flat list of
    tensors (vmap maps over a new leading dim of the first input only)."""
    argnums = tuple(range(len(inputs)))
    if name == "grad":
        out = grad(lambda *a: _combined(fn(*a)).sin().sum(), argnums=argnums)(*inputs)
    elif name == "vjp":
        y, pullback = vjp(lambda *a: _combined(fn(*a)), *inputs)
        out = pullback(_weights(y))
    elif name == "jvp":
        tangents = tuple(_weights(t) for t in inputs)
        out = jvp(lambda *a: _combined(fn(*a)), tuple(inputs), tangents)
    elif name == "jacrev":
        out = jacrev(lambda *a: _combined(fn(*a)), argnums=argnums)(*inputs)
    elif name == "jacfwd":
        out = jacfwd(lambda *a: _combined(fn(*a)), argnums=argnums)(*inputs)
    elif name == "vmap":
        batched = torch.stack([inputs[0], inputs[0].flip(0)])
        in_dims = (0, *(None,) * (len(inputs) - 1))
        out = vmap(lambda *a: _combined(fn(*a)), in_dims=in_dims)(batched, *inputs[1:])
    else:
        raise ValueError(name)
    return torch.utils._pytree.tree_leaves(out)


def transform_error(name: str, fn, reference, inputs) -> float:
    """The largest relative error of a transform of ``fn`` against the same transform of ``reference``
    in FP64."""
    got = transform(name, fn, inputs)
    expected = transform(name, reference, [t.double() for t in inputs])
    assert len(got) == len(expected)
    return max(rel_error(a, e) for a, e in zip(got, expected))
