"""FlashInfer's SiLU-gated names (``flashinfer.cake_rmsnorm_silu_gate_train``) on CPU:
``cake_rmsnorm_silu_gate`` and ``CakeRMSNormSiLUGateFunction`` compute bitwise what
``cake_gated_rmsnorm`` computes (y and every gradient), at FlashInfer's ``[T, heads, 128]`` rows and
others; they save only ``(x, z, weight, rstd)``, compile with ``fullgraph=True`` to the same bits, and
name FlashInfer's arguments in their errors; ``cake_rmsnorm_silu_gate_train_forward`` checks its
arguments before the device (it runs on CUDA)."""

from __future__ import annotations

import pytest
import torch

from cake_cute import (
    CakeRMSNormSiLUGateFunction,
    cake_gated_rmsnorm,
    cake_rmsnorm_silu_gate,
    cake_rmsnorm_silu_gate_train_forward,
)

from ._helpers import assert_bitwise_equal, saved_by

EPS = 1e-6
OUTPUTS = ("y", "dx", "dz", "dw")


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, z, g = (torch.randn(shape, generator=gen) * s for s in (1, 2, 1))
    w = torch.rand(shape[-1], generator=gen) + 0.5
    return x.to(dtype), z.to(dtype), w.to(dtype), g.to(dtype)


def _run(fn, x, z, w, g):
    """y and (dx, dz, dw) of fresh leaves."""
    xl, zl, wl = (t.detach().clone().requires_grad_() for t in (x, z, w))
    y = fn(xl, zl, wl, EPS)
    y.backward(g)
    return y, xl.grad, zl.grad, wl.grad


ENTRIES = {
    "cake_rmsnorm_silu_gate": cake_rmsnorm_silu_gate,
    "Function.apply": CakeRMSNormSiLUGateFunction.apply,
}


@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ENTRIES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(7, 4, 128), (129, 128), (1, 2, 64)], ids=str)
def test_bitwise_the_gated_norm(entry, dtype, shape):
    x, z, w, g = _inputs(shape, dtype)
    for name, got, want in zip(
        ("y", "dx", "dz", "dw"), _run(entry, x, z, w, g), _run(cake_gated_rmsnorm, x, z, w, g)
    ):
        assert_bitwise_equal(got, want, name)


def test_saves_x_z_weight_and_rstd():
    x, z, w, _ = _inputs((5, 2, 128), torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, z, w)]
    _, saved = saved_by(lambda: cake_rmsnorm_silu_gate(*leaves, EPS))
    _, rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(x, z, w, EPS)
    assert len(saved) == 4
    for got, want in zip(saved, (x, z, w, rstd)):
        assert torch.equal(got, want)


def test_compiled_fullgraph_is_bitwise_eager():
    x, z, w, g = _inputs((6, 3, 128), torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(cake_rmsnorm_silu_gate, fullgraph=True)
    for name, got, want in zip(
        ("y", "dx", "dz", "dw"), _run(compiled, x, z, w, g), _run(cake_rmsnorm_silu_gate, x, z, w, g)
    ):
        assert_bitwise_equal(got, want, name)


BAD = [
    (dict(weight=torch.ones(64)), ValueError, r"^weight must have shape \(128,\)"),
    (dict(weight=torch.ones(128, dtype=torch.float16)), TypeError, "^weight must have dtype"),
    (dict(z=torch.zeros(4, 64, dtype=torch.bfloat16)), ValueError, "^z must have shape"),
    (dict(eps=-1.0), ValueError, "^eps"),
    (dict(eps="1e-6"), TypeError, "^eps"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD, ids=[next(iter(c)) + "-" + m for c, _, m in BAD])
@pytest.mark.parametrize(
    "entry", [cake_rmsnorm_silu_gate, cake_rmsnorm_silu_gate_train_forward], ids=["autograd", "forward"]
)
def test_errors_name_flashinfers_arguments(entry, change, error, match):
    x, z, w, _ = _inputs((4, 128), torch.bfloat16)
    arguments = dict(x=x, z=z, weight=w, eps=EPS) | change
    with pytest.raises(error, match=match):
        entry(**arguments)


def test_functional_forward_needs_cuda():
    x, z, w, _ = _inputs((4, 128), torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="^x must be a CUDA tensor"):
        cake_rmsnorm_silu_gate_train_forward(x, z, w, EPS, out=out)
    assert out.isnan().all()
