"""The gradient-sum pass (``cake_cute.graph_passes``) and ``cake_cute::rmsnorm_bwd_parts`` without a GPU:
which graphs it folds and which it must leave alone, that a folded graph computes the unfolded one's
bits (FX graphs on the ops' CPU kernels; a Llama compiled by inductor on CPU), the op against
``rmsnorm_bwd`` of the summed gradient, and the named errors for a bad list of summands."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import fresh_cache
from torch.fx.experimental.proxy_tensor import make_fx

import cake_cute  # noqa: F401  (defines the ops)
from cake_cute import graph_passes
from cake_cute import validation as v
from cake_cute.reference import summed_gradient

T, H = 6, 32
BWD = torch.ops.cake_cute.rmsnorm_bwd.default
BWD_PARTS = torch.ops.cake_cute.rmsnorm_bwd_parts.default
# (backward, its op of summands): the default mode's, and the memory-efficient mode's (y in x's place).
BACKWARDS = [
    (BWD, BWD_PARTS),
    (
        torch.ops.cake_cute.rmsnorm_bwd_from_output.default,
        torch.ops.cake_cute.rmsnorm_bwd_from_output_parts.default,
    ),
]
BACKWARD_IDS = ["default", "memory_efficient"]


def _inputs(dtype=torch.float32, parts=3):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, w, rstd = rand(T, H), rand(H) * 0.5 + 1, torch.rand(T, generator=gen) + 0.5
    acts = [rand(T, 16) for _ in range(parts)]
    mats = [rand(16, H) for _ in range(parts)]
    return x, w, rstd, acts, mats


def _fold(fn, *args):
    """(outputs of ``fn``, outputs of its traced graph after the pass, the folded graph, the count)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    folded = graph_passes.fold_gradient_sums(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return fn(*args), gm(*args), gm.graph, folded


def _calls(graph, target):
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _assert_bitwise(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backward, backward_parts", BACKWARDS, ids=BACKWARD_IDS)
@pytest.mark.parametrize("parts", [2, 3])
def test_dgrad_sums_are_folded_in_order(parts, backward, backward_parts):
    x, w, rstd, acts, mats = _inputs(parts=parts)

    def step(x, w, rstd, acts, mats):
        g = acts[0] @ mats[0]
        for a, m in zip(acts[1:], mats[1:]):
            g = g + a @ m
        return backward(g, x, w, rstd)

    expected, actual, graph, folded = _fold(step, x, w, rstd, acts, mats)
    assert folded == 1 and not _calls(graph, backward) and not _calls(graph, torch.ops.aten.add.Tensor)
    (call,) = _calls(graph, backward_parts)
    assert call.args[0] == _calls(graph, torch.ops.aten.mm.default)  # the products, in order
    _assert_bitwise(actual, expected)  # FP32: the eager adds round like the folded sum


def test_viewed_products_and_graph_inputs_are_summands():
    x, w, rstd, acts, mats = _inputs(parts=2)
    x3 = x.view(2, 3, H)

    def step(x3, w, rstd, acts, mats, p):
        g = (acts[0] @ mats[0]).view(2, 3, H) + (acts[1] @ mats[1]).view(2, 3, H) + p
        return BWD(g, x3, w, rstd.view(2, 3))

    expected, actual, graph, folded = _fold(step, x3, w, rstd, acts, mats, torch.randn(2, 3, H))
    assert folded == 1 and len(_calls(graph, BWD_PARTS)[0].args[0]) == 3
    _assert_bitwise(actual, expected)


@pytest.mark.parametrize(
    "case",
    [
        "elementwise summand",
        "sum used twice",
        "four summands",
        "alpha",
        "broadcast",
        "right-nested",
    ],
)
def test_sums_that_would_change_bits_or_outputs_are_left_alone(case):
    x, w, rstd, acts, mats = _inputs(parts=3)

    def step(x, w, rstd, acts, mats):
        p = [a @ m for a, m in zip(acts, mats)]
        extra = ()
        if case == "elementwise summand":
            g = p[0] * 2 + p[1]
        elif case == "sum used twice":
            g = p[0] + p[1]
            extra = (g,)
        elif case == "four summands":
            g = p[0] + p[1] + p[2] + p[0]
        elif case == "alpha":
            g = torch.add(p[0], p[1], alpha=2)
        elif case == "broadcast":
            g = p[0] + w
        else:
            g = p[0] + (p[1] + p[2])
        return (*BWD(g, x, w, rstd), *extra)

    expected, actual, graph, folded = _fold(step, x, w, rstd, acts, mats)
    assert folded == 0 and _calls(graph, BWD) and not _calls(graph, BWD_PARTS)
    _assert_bitwise(actual, expected)


def test_nothing_is_folded_when_inductor_rounds_each_add():
    x, w, rstd, acts, mats = _inputs(parts=2)

    def step(x, w, rstd, acts, mats):
        return BWD(acts[0] @ mats[0] + acts[1] @ mats[1], x, w, rstd)

    with torch._inductor.config.patch(emulate_precision_casts=True):
        assert _fold(step, x, w, rstd, acts, mats)[3] == 0


@pytest.mark.parametrize("backward, backward_parts", BACKWARDS, ids=BACKWARD_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_parts_op_is_the_backward_of_the_rounded_sum(dtype, residual, backward, backward_parts):
    x, w, rstd, _, _ = _inputs(dtype)
    parts = [torch.randn(T, H).to(dtype) for _ in range(3)]
    g_res = torch.randn(T, H).to(dtype) if residual else None
    expected = backward(summed_gradient(parts), x, w, rstd, g_res, 1.0)
    _assert_bitwise(backward_parts(parts, x, w, rstd, g_res, 1.0), expected)
    if dtype == torch.bfloat16:  # rounded once: not the eager chain of adds, which rounds twice
        assert not torch.equal(summed_gradient(parts), parts[0] + parts[1] + parts[2])


@pytest.mark.parametrize("backward_parts", [parts for _, parts in BACKWARDS], ids=BACKWARD_IDS)
def test_parts_op_opcheck(backward_parts):
    x, w, rstd, _, _ = _inputs()
    parts = [torch.randn(T, H) for _ in range(2)]
    torch.library.opcheck(backward_parts, (parts, x, w, rstd, None, 0.0))


def test_bad_gradient_parts_are_named():
    x = torch.empty(T, H, dtype=torch.bfloat16)
    assert v.check_gradient_parts(x, x) == (x,)
    assert len(v.check_gradient_parts([x, x, x], x)) == 3
    with pytest.raises(TypeError, match=r"g must be a tensor or a list / tuple of 1 to 3 tensors"):
        v.check_gradient_parts([x] * 4, x)
    with pytest.raises(TypeError, match="g must be"):
        v.check_gradient_parts(None, x)
    with pytest.raises(ValueError, match=r"g\[1\] must have shape"):
        v.check_gradient_parts((x, x[:-1]), x)
    with pytest.raises(TypeError, match=r"g\[0\]"):
        v.check_gradient_parts((x.float(), x), x)


def compiled_with_and_without_the_pass(make_model):
    """The training step of ``make_model()`` compiled by inductor without and then with the pass, each
    compiled afresh (no cache hit, so the pass runs here): ([without, with] results of
    ``test_fusion_cpu._step``, the pass's fold count per graph)."""
    from .test_fusion_cpu import _step

    counts = []

    class Counting(graph_passes.GradientSumPass):
        def __call__(self, graph):
            counts.append(graph_passes.fold_gradient_sums(graph))

    results = []
    for options in ({}, {"post_grad_custom_post_pass": Counting()}):
        torch._dynamo.reset()
        model = make_model()
        with fresh_cache():
            results.append(_step(torch.compile(model, fullgraph=True, options=options)))
    return results, counts


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["default", "memory_efficient"])
def test_compiled_llama_is_bitwise_with_and_without_the_pass(memory_efficient):
    """A fused bf16 Llama compiled by inductor on CPU: the pass folds each layer's two sums (q/k/v,
    gate/up) in either mode and the loss and every gradient keep their bits."""
    pytest.importorskip("transformers")
    from cake_cute import fuse_residual_rmsnorm

    from .test_fusion_cpu import LAYERS, _tiny

    def fused_llama():
        model = _tiny("llama", dtype=torch.bfloat16)
        fuse_residual_rmsnorm(model, memory_efficient=memory_efficient)
        return model

    ((loss, _, grads), (loss_folded, _, grads_folded)), counts = compiled_with_and_without_the_pass(
        fused_llama
    )
    assert sum(counts) == 2 * LAYERS, counts
    assert torch.equal(loss, loss_folded)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_folded[name]), name
