"""FlashInfer's SiLU-gated names (``flashinfer.cake_rmsnorm_silu_gate_train``) on CPU:
``cake_rmsnorm_silu_gate`` and ``CakeRMSNormSiLUGateFunction`` compute bitwise what
``cake_gated_rmsnorm`` computes (y and every gradient), at FlashInfer's ``[T, heads, 128]`` rows and
others; they save only ``(x, z, weight, rstd)``, compile with ``fullgraph=True`` to the same bits, and
name FlashInfer's arguments in their errors; ``cake_rmsnorm_silu_gate_train_forward`` checks its
arguments before the device (it runs on CUDA); ``cake_rmsnorm_silu_gate_train_backward`` recomputes
rstd with the statistics kernel before the backward's, into caller-owned outputs and a workspace its
helpers size (its launches recorded on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from cake_cute import (
    CakeRMSNormSiLUGateFunction,
    cake_gated_rmsnorm,
    cake_rmsnorm_silu_gate,
    cake_rmsnorm_silu_gate_train_backward,
    cake_rmsnorm_silu_gate_train_backward_workspace,
    cake_rmsnorm_silu_gate_train_backward_workspace_bytes,
    cake_rmsnorm_silu_gate_train_forward,
)
from cake_cute.runtime.specs import GatedSpec, ReduceSpec

from ._helpers import assert_bitwise_equal, saved_by
from .conftest import RECORDED_DW

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


# --- the functional backward: its launches on CPU tensors (``launches``: recorded kernels) ---------


def _backward_inputs(shape=(9, 4, 128), dtype=torch.bfloat16):
    x, z, w, g = _inputs(shape, dtype)
    return g, x, z, w


def _specs(launches):
    return [spec for spec, _ in launches]


def test_backward_recomputes_rstd_then_runs_the_gated_backward(launches):
    """The statistics kernel (x's dtype for w's, no offset) writes rstd, which the backward kernel
    reads; dW's reduction writes dw in weight's dtype; x, z and g are read in place as (rows, H)."""
    g, x, z, w = _backward_inputs()
    dx, dz, dw = cake_rmsnorm_silu_gate_train_backward(g, x, z, w, EPS)
    form = dict(group_size=128, norm_before_gate=True)
    assert _specs(launches) == [
        GatedSpec("gated_rstd", "sm_90a", "bf16", "bf16", 128, **form),
        GatedSpec("gated_bwd", "sm_90a", "bf16", "bf16", 128, **form),
        ReduceSpec("sm_90a", "bf16", 128),
    ]
    (_, stats), (_, bwd), (_, reduce) = launches
    sx, sz, rstd, eps = stats
    assert sx.shape == (36, 128) and sx.data_ptr() == x.data_ptr() and sz.data_ptr() == z.data_ptr()
    assert rstd.shape == (36, 1) and rstd.dtype == torch.float32 and eps == EPS
    kg, kx, kz, kw, krstd, kdx, kdz, partials, programs = bwd
    assert kg.data_ptr() == g.data_ptr() and kx.data_ptr() == x.data_ptr() and kz.data_ptr() == z.data_ptr()
    assert krstd.data_ptr() == rstd.data_ptr()
    assert kdx.data_ptr() == dx.data_ptr() and kdz.data_ptr() == dz.data_ptr()
    assert partials.shape == (programs, 128) and reduce[0] is partials
    assert dx.shape == dz.shape == x.shape and dx.dtype == torch.bfloat16
    assert dw.dtype == torch.bfloat16 and reduce[1] is dw and (dw == RECORDED_DW).all()


def test_backward_into_caller_owned_outputs_and_workspace(launches, monkeypatch):
    """grad_x, grad_z and grad_weight are written directly; rstd, the partial rows and nothing else
    come out of the workspace, which a sized helper call provides."""
    g, x, z, w = _backward_inputs()
    _on_a_test_gpu(monkeypatch)
    workspace = cake_rmsnorm_silu_gate_train_backward_workspace_bytes(36, "cuda")
    workspace = torch.zeros(workspace, dtype=torch.uint8)
    grad_x, grad_z = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    grad_weight = torch.full((128,), float("nan"), dtype=torch.float32)
    dx, dz, dw = cake_rmsnorm_silu_gate_train_backward(
        g, x, z, w, EPS, grad_x=grad_x, grad_z=grad_z, grad_weight=grad_weight, workspace=workspace
    )
    assert dx is grad_x and dz is grad_z and dw is grad_weight and (dw == RECORDED_DW).all()
    (_, stats), (_, bwd), (reduce_fields, _) = launches
    assert reduce_fields == ReduceSpec("sm_90a", "fp32", 128)
    start, end = workspace.data_ptr(), workspace.data_ptr() + workspace.numel()
    rstd, partials = stats[2], bwd[7]
    for carved in (rstd, partials):
        assert start <= carved.data_ptr() and carved.data_ptr() + carved.numel() * 4 <= end
    assert partials.data_ptr() % 16 == 0 and partials.data_ptr() >= rstd.data_ptr() + rstd.numel() * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_accumulate_adds_the_fp32_sum_to_grad_weight(launches, dtype):
    """accumulate_grad_weight: dW's reduction writes an FP32 sum (not grad_weight), which is then
    added to grad_weight."""
    g, x, z, w = _backward_inputs()
    grad_weight = torch.full((128,), 1.0, dtype=dtype)
    _, _, dw = cake_rmsnorm_silu_gate_train_backward(
        g, x, z, w, EPS, grad_weight=grad_weight, accumulate_grad_weight=True
    )
    (reduce_fields, reduce_args) = launches[-1]
    assert reduce_fields == ReduceSpec("sm_90a", "fp32", 128) and reduce_args[1] is not grad_weight
    assert dw is grad_weight and (dw == 1.0 + RECORDED_DW).all()


def test_no_weight_gradient_launches_no_reduction(launches):
    g, x, z, w = _backward_inputs()
    dx, dz, dw = cake_rmsnorm_silu_gate_train_backward(g, x, z, w, EPS, compute_grad_weight=False)
    assert dw is None and [spec.kind for spec in _specs(launches)] == ["gated_rstd", "gated_bwd"]


def test_backward_of_no_rows_launches_nothing(launches):
    """T = 0: empty dx and dz, dw zeroed, or left as it was when accumulating."""
    g, x, z, w = _backward_inputs((0, 4, 128))
    dx, dz, dw = cake_rmsnorm_silu_gate_train_backward(g, x, z, w, EPS)
    assert dx.shape == dz.shape == (0, 4, 128) and not dw.any()
    grad_weight = torch.full((128,), 2.0, dtype=torch.bfloat16)
    *_, dw = cake_rmsnorm_silu_gate_train_backward(
        g, x, z, w, EPS, grad_weight=grad_weight, accumulate_grad_weight=True
    )
    assert dw is grad_weight and (dw == 2.0).all() and not launches


def _on_a_test_gpu(monkeypatch):
    """The workspace helpers' device checks pass for "cuda" and find ``launches``' sm_90a GPU."""
    from cake_cute import validation as v
    from cake_cute.gated import flashinfer as gated_flashinfer
    from cake_cute.gated import ops as gated_ops

    monkeypatch.setattr(v, "check_cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(gated_flashinfer, "device_arch", gated_ops.device_arch)
    monkeypatch.setattr(gated_flashinfer, "device_facts", gated_ops.device_facts)


# (rows, H): one row, a few, and enough row tiles that the programs reach the GPU's residency.
WORKSPACE_CASES = [(1, 128), (129, 64), (40000, 64), (40000, 128), (300, 4100)]


@pytest.mark.parametrize(("rows", "hidden"), WORKSPACE_CASES, ids=str)
def test_the_sized_workspace_serves_every_dtype(launches, monkeypatch, rows, hidden):
    """A workspace of ``..._workspace_bytes(rows, hidden=H)`` bytes serves a backward of ``rows``
    rows of H in every dtype (and fewer rows); one byte less is refused for at least one of them,
    before anything is launched."""
    _on_a_test_gpu(monkeypatch)
    nbytes = cake_rmsnorm_silu_gate_train_backward_workspace_bytes(rows, "cuda", hidden=hidden)
    assert nbytes == cake_rmsnorm_silu_gate_train_backward_workspace_bytes(
        rows, "cuda", deterministic=False, hidden=hidden
    )
    refused = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g, x, z, w = (t.to(dtype) for t in _backward_inputs((rows, hidden)))
        for workspace_rows in (rows, max(1, rows // 2)):
            n = workspace_rows
            cake_rmsnorm_silu_gate_train_backward(
                g[:n], x[:n], z[:n], w, EPS, workspace=torch.zeros(nbytes, dtype=torch.uint8)
            )
        launches.clear()
        try:
            cake_rmsnorm_silu_gate_train_backward(
                g, x, z, w, EPS, workspace=torch.zeros(nbytes - 1, dtype=torch.uint8)
            )
        except ValueError as err:
            assert str(err).startswith("workspace holds") and not launches
            refused += 1
    assert refused >= 1


BACKWARD_BAD = [
    (dict(grad_out=torch.zeros(4, 128)), TypeError, "^grad_out must have dtype bfloat16"),
    (
        dict(grad_out=torch.zeros(4, 64, dtype=torch.bfloat16)),
        ValueError,
        r"^grad_out must have shape \(4, 128\)",
    ),
    (dict(weight=torch.ones(64)), ValueError, r"^weight must have shape \(128,\)"),
    (dict(grad_x=torch.zeros(4, 128)), ValueError, "^grad_x must have dtype"),
    (
        dict(grad_z=torch.zeros(4, 256, dtype=torch.bfloat16)[:, :128]),
        ValueError,
        "^grad_z must be contiguous",
    ),
    (dict(grad_weight=torch.zeros(64)), ValueError, r"^grad_weight must have shape \(128,\)"),
    (dict(grad_weight=torch.zeros(128, dtype=torch.float16)), TypeError, "^grad_weight must have dtype"),
    (dict(accumulate_grad_weight=True), ValueError, "^accumulate_grad_weight=True needs grad_weight"),
    (dict(accumulate_grad_weight=1), TypeError, "^accumulate_grad_weight"),
    (dict(compute_grad_weight=False, grad_weight=torch.zeros(128)), ValueError, "^grad_weight and"),
    (dict(workspace=torch.zeros(4096)), TypeError, "^workspace must have dtype uint8"),
    (dict(eps=float("nan")), ValueError, "^eps"),
]


@pytest.mark.parametrize(
    ("change", "error", "match"), BACKWARD_BAD, ids=[next(iter(c)) + "-" + m for c, _, m in BACKWARD_BAD]
)
def test_backward_errors_name_flashinfers_arguments(launches, change, error, match):
    """Checked before anything is launched; caller-owned outputs stay untouched."""
    g, x, z, w = _backward_inputs((4, 128))
    grad_x = torch.full_like(x, float("nan"))
    arguments = dict(grad_out=g, x=x, z=z, weight=w, eps=EPS, grad_x=grad_x) | change
    with pytest.raises(error, match=match):
        cake_rmsnorm_silu_gate_train_backward(**arguments)
    assert not launches and (change.get("grad_x") is not None or grad_x.isnan().all())


def test_backward_and_workspace_helpers_need_cuda():
    g, x, z, w = _backward_inputs((4, 128))
    grad_x = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="^x must be a CUDA tensor"):
        cake_rmsnorm_silu_gate_train_backward(g, x, z, w, EPS, grad_x=grad_x)
    assert grad_x.isnan().all()
    with pytest.raises(ValueError, match="^device must be a CUDA device"):
        cake_rmsnorm_silu_gate_train_backward_workspace(8, "cpu")
    with pytest.raises(ValueError, match=r"^hidden must be an int in \[1, 8192\]"):
        cake_rmsnorm_silu_gate_train_backward_workspace_bytes(8, "cuda", hidden=8193)
    with pytest.raises(TypeError, match="^rows must be an int"):
        cake_rmsnorm_silu_gate_train_backward_workspace_bytes(8.0, "cuda")
