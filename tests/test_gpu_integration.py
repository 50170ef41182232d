"""Integration with the rest of PyTorch on a GPU: torch.compile (no graph break, bitwise equal to eager),
CUDA graphs (capture, bitwise replays, no host synchronization), streams and devices, and a small
Llama-style training run with ``swap_rmsnorm`` against ``torch.nn.RMSNorm``.

Everything here needs an sm_90 / sm_100 / sm_103 GPU and is skipped without one."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn

import cake_cute
from cake_cute import (
    CakeRMSNorm,
    CakeRMSNormFunction,
    cake_rmsnorm,
    cake_rmsnorm_train_backward,
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_forward,
    swap_rmsnorm,
)

from ._helpers import warm_up_before_capture


def _supported(device: str = "cuda") -> bool:
    return torch.cuda.is_available() and cake_cute.is_cake_rmsnorm_train_supported(device)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _supported(), reason="needs an NVIDIA Hopper or Blackwell GPU"),
]

EPS = 1e-6
BF16 = torch.bfloat16
# About 25-50 ms of GPU time: long enough that a kernel on the wrong stream would read unset inputs.
SLEEP_CYCLES = 50_000_000


def _randn(shape, *, dtype=BF16, device="cuda", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, dtype=dtype, device=device, generator=gen)


def _problem(residual: bool, shape=(2, 96, 1024), device="cuda"):
    """Inputs and output gradients of one fused-norm call: (x, w, residual, g_y, g_h_new)."""
    hidden = shape[-1]
    x = _randn(shape, device=device, seed=1)
    w = (_randn((hidden,), dtype=torch.float32, device=device, seed=2) * 0.5 + 1).to(BF16)
    res = _randn(shape, device=device, seed=3) if residual else None
    g_y = _randn(shape, device=device, seed=4)
    g_h = _randn(shape, device=device, seed=5) if residual else None
    return x, w, res, g_y, g_h


def _forward_backward(fn, inputs, out_grads, params=()):
    """Outputs of ``fn(*inputs)`` on fresh leaves, then the gradients of those leaves and of ``params``."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, out_grads[: len(outs)])
    grads = [leaf.grad for leaf in leaves if leaf is not None] + [p.grad for p in params]
    return [o.detach() for o in outs] + grads


def _assert_bitwise(actual, expected):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, i
        assert torch.equal(a, e), (
            f"tensor {i} differs: max |diff| {(a.float() - e.float()).abs().max().item()}"
        )


def _via_function(x, w, res):
    return cake_rmsnorm(x, w, EPS, res)


def _via_autograd_function(x, w, res):
    return CakeRMSNormFunction.apply(x, w, EPS, res, True, 0.0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry", [_via_function, _via_autograd_function], ids=["cake_rmsnorm", "Function.apply"]
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_compile_fullgraph_is_bitwise_eager(entry, residual):
    x, w, res, g_y, g_h = _problem(residual)
    explanation = torch._dynamo.explain(entry)(x, w, res)
    assert explanation.graph_break_count == 0
    expected = _forward_backward(entry, (x, w, res), (g_y, g_h))
    # fullgraph=True raises on any graph break; the default backend is inductor.
    actual = _forward_backward(torch.compile(entry, fullgraph=True), (x, w, res), (g_y, g_h))
    _assert_bitwise(actual, expected)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_compiled_module_is_bitwise_eager(residual, weight_offset):
    x, w, res, g_y, g_h = _problem(residual)
    norm = CakeRMSNorm(x.shape[-1], eps=EPS, weight_offset=weight_offset, device="cuda", dtype=BF16)
    with torch.no_grad():
        norm.weight.copy_(w)
    results = []
    for module in (norm, torch.compile(norm, fullgraph=True)):
        norm.weight.grad = None
        results.append(
            _forward_backward(
                lambda x, r, m=module: m(x, residual=r), (x, res), (g_y, g_h), params=(norm.weight,)
            )
        )
    _assert_bitwise(results[1], results[0])


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_compiled_cuda_graphs_replay_bitwise_eager(residual):
    """torch.compile(mode="reduce-overhead"): the compiled graphs, with the custom ops' C++ kernels in
    them, captured as CUDA graphs and replayed with new inputs, give the eager bits."""
    x, w, res, g_y, g_h = _problem(residual)
    compiled = torch.compile(_via_function, mode="reduce-overhead", fullgraph=True)
    for scale in (1.0, 0.5, 2.0, -1.0):  # the first calls record, the later ones replay
        inputs = (x * scale, w, None if res is None else res * scale)
        torch.compiler.cudagraph_mark_step_begin()
        actual = _forward_backward(compiled, inputs, (g_y, g_h))
        _assert_bitwise(actual, _forward_backward(_via_function, inputs, (g_y, g_h)))


def test_compile_dynamic_rows_traces_once():
    """With dynamic shapes the fake implementations propagate symbolic row counts: the first trace
    serves every T, and each result still equals eager bitwise."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_via_function, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for rows in (64, 200, 3):
        x, w, _res, g_y, _g_h = _problem(False, shape=(rows, 1024))
        expected = _forward_backward(_via_function, (x, w, None), (g_y,))
        _assert_bitwise(_forward_backward(compiled, (x, w, None), (g_y,)), expected)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled for a new row count: {frames}"


# --- CUDA graphs ---------------------------------------------------------------------------------


def _eager_train_step(x, w, res, g, g_res):
    """Forward then backward with freshly allocated outputs: what a replay must reproduce."""
    fwd = cake_rmsnorm_train_forward(x, w, EPS, residual=res)
    h = fwd[2] if res is not None else x
    return [*fwd, *cake_rmsnorm_train_backward(g, h, w, fwd[1], g_residual=g_res)]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_cuda_graph_replay_is_bitwise_eager(residual):
    rows, hidden = 512, 2048
    x, w, res, g, g_res = _problem(residual, shape=(rows, hidden))
    y, rstd = torch.empty_like(x), torch.empty(rows, dtype=torch.float32, device="cuda")
    h_new = torch.empty_like(x) if residual else None
    dx, dw = torch.empty_like(x), torch.empty(hidden, dtype=torch.float32, device="cuda")
    workspace = cake_rmsnorm_train_backward_workspace(rows, hidden, x.device, residual=residual)
    outputs = [t for t in (y, rstd, h_new, dx, dw) if t is not None]

    def step():
        cake_rmsnorm_train_forward(x, w, EPS, residual=res, out=y, rstd=rstd, residual_out=h_new)
        h = h_new if residual else x
        cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=g_res, workspace=workspace, dx=dx, dw=dw)

    warm_up_before_capture(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host synchronization inside would make the capture fail
        step()

    for seed in (10, 20):
        torch.manual_seed(seed)
        for t in (x, w, res, g, g_res):
            if t is not None:
                t.normal_()
        for t in outputs:
            t.fill_(float("nan"))
        graph.replay()
        _assert_bitwise(outputs, _eager_train_step(x, w, res, g, g_res))


def test_graphed_module_autograd_is_bitwise_eager():
    """The autograd path (CakeRMSNorm forward and backward) captured by make_graphed_callables."""
    rows, hidden = 256, 1024
    graphed = CakeRMSNorm(hidden, eps=EPS, device="cuda", dtype=BF16)
    with torch.no_grad():
        graphed.weight.normal_(1.0, 0.2)
    reference = copy.deepcopy(graphed)
    sample = _randn((rows, hidden), seed=7).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(graphed, (sample,))

    for seed in (11, 12):
        x = _randn((rows, hidden), seed=seed)
        g = _randn((rows, hidden), seed=seed + 100)
        results = []
        for module in (graphed, reference):
            module.weight.grad = None
            leaf = x.clone().requires_grad_()
            y = module(leaf)
            y.backward(g)
            results.append([y.detach(), leaf.grad, module.weight.grad])
        _assert_bitwise(*results)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_warm_calls_do_not_synchronize_the_host(residual):
    rows, hidden = 512, 2048
    x, w, res, g, g_res = _problem(residual, shape=(rows, hidden))
    workspace = cake_rmsnorm_train_backward_workspace(rows, hidden, x.device, residual=residual)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    res_leaf = res.clone().requires_grad_() if residual else None

    def calls():
        fwd = cake_rmsnorm_train_forward(x, w, EPS, residual=res)
        h = fwd[2] if residual else x
        cake_rmsnorm_train_backward(g, h, w, fwd[1], g_residual=g_res, workspace=workspace)
        cake_rmsnorm_train_backward(g, h, w, fwd[1], g_residual=g_res)  # allocates its workspace
        out = cake_rmsnorm(*leaves, EPS, res_leaf)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, (g, g_res)[: len(outs)])

    calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# --- streams and devices -------------------------------------------------------------------------


def _produced_late_on(stream, *tensors):
    """Copies of ``tensors`` that ``stream`` writes only after a long sleep; before that they hold NaN.
    Must be called with ``stream`` current."""
    copies = [torch.full_like(t, float("nan")) if t is not None else None for t in tensors]
    torch.cuda._sleep(SLEEP_CYCLES)
    for dst, src in zip(copies, tensors):
        if dst is not None:
            dst.copy_(src)
    return copies


def _functional_and_autograd(x, w, res, g, g_res):
    """Every result of the functional forward and backward, then of the autograd path."""
    return _eager_train_step(x, w, res, g, g_res) + _forward_backward(_via_function, (x, w, res), (g, g_res))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_calls_run_on_the_current_stream(residual):
    problem = _problem(residual, shape=(4096, 4096))
    expected = _functional_and_autograd(*problem)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        late = _produced_late_on(stream, *problem)
        actual = _functional_and_autograd(*late)
    stream.synchronize()
    _assert_bitwise(actual, expected)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and _supported("cuda:1")),
    reason="needs a second supported GPU",
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_second_device_and_its_streams(residual):
    """Inputs on cuda:1 while cuda:0 is current, then on a side stream of cuda:1: results equal cuda:0's
    (same GPU model, same kernels)."""
    problem = _problem(residual, shape=(1024, 4096))
    expected = _functional_and_autograd(*problem)
    on_1 = [t.to("cuda:1") if t is not None else None for t in problem]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    actual = _functional_and_autograd(*on_1)
    torch.cuda.synchronize(1)
    _assert_bitwise([t.to("cuda:0") for t in actual], expected)

    stream = torch.cuda.Stream(device=1)
    stream.wait_stream(torch.cuda.current_stream(1))
    with torch.cuda.stream(stream):
        late = _produced_late_on(stream, *on_1)
        actual = _functional_and_autograd(*late)
    stream.synchronize()
    _assert_bitwise([t.to("cuda:0") for t in actual], expected)


# --- a small training run ------------------------------------------------------------------------


class _MLPBlock(nn.Module):
    """Pre-norm residual block, Llama's layout with an MLP in place of attention."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, h):
        return h + self.down(F.silu(self.up(self.norm(h))))


class TinyLlama(nn.Module):
    """embedding -> [RMSNorm -> MLP] x layers -> RMSNorm -> head."""

    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_MLPBlock(dim, 4 * dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def token_data(steps: int, batch: int, seq: int, vocab: int, device, seed: int = 0):
    """Random tokens whose target is a fixed permutation of the token half of the time and a random
    token otherwise: learnable, with a loss floor far from 0 so relative comparisons mean something."""
    gen = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen, device=device)
    tokens = torch.randint(vocab, (steps, batch, seq), generator=gen, device=device)
    noise = torch.randint(vocab, (steps, batch, seq), generator=gen, device=device)
    keep = torch.rand((steps, batch, seq), generator=gen, device=device) < 0.5
    return tokens, torch.where(keep, perm[tokens], noise)


def train_losses(model: nn.Module, tokens, targets, lr: float = 3e-3) -> torch.Tensor:
    """AdamW on the given batches; the per-step losses (kept on the device until the end: no syncs)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for batch, target in zip(tokens, targets):
        logits = model(batch)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).float().cpu()


def compare_loss_curves(swapped: torch.Tensor, baseline: torch.Tensor) -> None:
    """Final-100-step means within 2%, every step within a loose bound, and the model learned."""
    final_swapped, final_baseline = swapped[-100:].mean().item(), baseline[-100:].mean().item()
    assert abs(final_swapped - final_baseline) <= 0.02 * final_baseline, (final_swapped, final_baseline)
    assert torch.all((swapped - baseline).abs() <= 0.1 * baseline + 0.05), (swapped - baseline).abs().max()
    assert final_baseline < 0.8 * baseline[0].item(), "the model did not learn: the comparison means nothing"


def test_swapped_llama_trains_like_torch_rmsnorm():
    steps, batch, seq, vocab = 300, 8, 128, 512
    torch.manual_seed(0)
    baseline = TinyLlama(vocab).to("cuda", BF16)
    swapped = copy.deepcopy(baseline)
    assert swap_rmsnorm(swapped) == 3
    assert all(not isinstance(m, nn.RMSNorm) for m in swapped.modules())
    tokens, targets = token_data(steps, batch, seq, vocab, "cuda")
    losses = [train_losses(model, tokens, targets) for model in (baseline, swapped)]
    assert all(math.isfinite(v) for v in losses[1].tolist())
    compare_loss_curves(losses[1], losses[0])
