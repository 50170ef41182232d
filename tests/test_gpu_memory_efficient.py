"""The memory-efficient mode's backward kernel (``kernels.rmsnorm_bwd`` reading y) on the GPU:
dx and dw against FP64 per dtype beside the default mode (the bound of docs/memory.md), caller-owned
outputs poisoned with NaN, bitwise determinism, batch invariance, CUDA graph capture and replay,
residual on and off, strided inputs, and what autograd saves.
"""

from __future__ import annotations

import pytest
import torch

from cake_cute import cake_rmsnorm
from cake_cute.calls import backward_call
from cake_cute.launch import cake_rmsnorm_train_backward_workspace, launch_backward

from ._helpers import EPS, assert_bitwise_equal, fixed_seed, poison, rand_weight  # noqa: F401 (fixture)
from .test_memory_efficient_cpu import WEIGHTS, assert_within_the_modes_bound

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One vector per lane, predicated columns, a cluster-split row, dW in shared memory.
SHAPES = [(1, 1), (129, 7), (2048, 4096), (129, 4097), (64, 16384), (16, 65536)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_fp32", [False, True], ids=["w-act", "w-fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("rows, hidden", SHAPES)
def test_kernel_error_against_fp64_beside_the_default_mode(dtype, w_fp32, residual, kind, rows, hidden):
    w_dtype = torch.float32 if w_fp32 else None
    assert_within_the_modes_bound(rows, hidden, dtype, w_dtype, residual, kind, DEV)


def _forward(rows, hidden, dtype, residual):
    """(x, w, residual, y, rstd) of a forward; y is what the mode saves."""
    x = torch.randn(rows, hidden, device=DEV, dtype=dtype)
    r = torch.randn_like(x) if residual else None
    w = rand_weight(hidden, dtype)
    outs = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r, 0.0)
    return x, w, r, outs[0], outs[1].reshape(-1)


def _backward(g, y, w, rstd, g_residual, outputs=(None, None, None)):
    workspace, dx, dw = outputs
    call = backward_call(
        g, y, w, rstd, g_residual, 0.0, torch.float32, workspace, dx, dw, memory_efficient=True
    )
    return launch_backward(call)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [7, 4096, 16384])
def test_poisoned_outputs_are_written_and_two_runs_are_bitwise_equal(dtype, residual, hidden):
    rows = 333
    _, w, _, y, rstd = _forward(rows, hidden, dtype, residual)
    g = torch.randn_like(y)
    g_r = torch.randn_like(y) if residual else None
    runs = []
    for _ in range(2):
        workspace = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=residual)
        workspace.fill_(0xFF)  # NaN partial rows unless every one is written
        dx, dw = poison((rows, hidden), dtype), poison((hidden,), torch.float32)
        runs.append(_backward(g, y, w, rstd, g_r, (workspace, dx, dw)))
        assert not runs[-1][0].isnan().any() and not runs[-1][1].isnan().any()
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [7, 4096, 16384])
def test_a_rows_dx_does_not_depend_on_t(dtype, hidden):
    _, w, _, y, rstd = _forward(4096, hidden, dtype, False)
    g = torch.randn_like(y)
    full, _ = _backward(g, y, w, rstd, None)
    for rows in (1, 3, 130):
        part, _ = _backward(g[:rows], y[:rows], w, rstd[:rows], None)
        assert_bitwise_equal(part, full[:rows], f"dx of the first {rows} rows")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_cuda_graph_capture_and_replay(residual):
    rows, hidden, dtype = 512, 4096, torch.bfloat16
    _, w, _, y, rstd = _forward(rows, hidden, dtype, residual)
    g = torch.randn_like(y)
    g_r = torch.randn_like(y) if residual else None
    workspace = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=residual)
    dx, dw = torch.empty_like(y), torch.empty(hidden, device=DEV)
    outputs = (workspace, dx, dw)
    _backward(g, y, w, rstd, g_r, outputs)  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _backward(g, y, w, rstd, g_r, outputs)
    g.copy_(torch.randn_like(g))
    graph.replay()
    torch.cuda.synchronize()
    expected = _backward(g, y, w, rstd, g_r)
    assert_bitwise_equal(dx, expected[0], "dx")
    assert_bitwise_equal(dw, expected[1], "dw")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_strided_views_give_the_contiguous_bits(residual):
    """A row-strided x (and residual) view and an expanded gradient (stride 0) through autograd."""
    rows, hidden, dtype = 96, 4096, torch.bfloat16
    wide = torch.randn(rows, hidden + 64, device=DEV, dtype=dtype)
    x_view = wide[:, :hidden]
    r_view = torch.randn_like(wide)[:, :hidden] if residual else None
    g = torch.randn(1, hidden, device=DEV, dtype=dtype).expand(rows, hidden)
    w = rand_weight(hidden, dtype)
    results = []
    for x, r, grad in (
        (x_view, r_view, g),
        (x_view.contiguous(), None if r_view is None else r_view.contiguous(), g.contiguous()),
    ):
        xl = x.detach().requires_grad_()
        wl = w.detach().clone().requires_grad_()
        out = cake_rmsnorm(xl, wl, EPS, r, memory_efficient=True)
        y = out[0] if residual else out
        y.backward(grad)
        results.append((y.detach(), xl.grad, wl.grad))
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)


def test_saves_the_returned_y_on_the_gpu():
    x = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = rand_weight(4096, torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = cake_rmsnorm(x, w, EPS, memory_efficient=True)
    assert len(saved) == 3 and saved[0].data_ptr() == y.data_ptr()
