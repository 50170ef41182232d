"""The fused residual of ``fuse_residual_rmsnorm(model)`` on a GPU, where eager calls launch
the kernels directly (not through the custom ops the CPU tests run): a tiny random Hugging Face Llama
and Gemma in bf16, against the unfused cake model and the unpatched model, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from .test_fusion_cpu import _assert_grads, _step, _swapped, _tiny

pytestmark = pytest.mark.gpu


def _on_gpu(arch: str, dtype):
    return _tiny(arch, dtype).cuda()


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_the_unfused_cake_model(arch, dtype):
    model = _on_gpu(arch, dtype)
    loss, hidden, grads = _step(_swapped(model, fuse=False), output_hidden_states=True)
    fused_loss, fused_hidden, fused_grads = _step(_swapped(model, fuse=True), output_hidden_states=True)
    assert torch.equal(fused_loss, loss)
    for a, b in zip(fused_hidden, hidden):
        assert torch.equal(a, b)
    # Not bitwise even in FP32: the residual backward's launch plan (how many programs sum dW's
    # partial rows) can differ from the plain one's, so dW is summed in another fixed order.
    tight = dtype == torch.float32
    _assert_grads(fused_grads, grads, exact=False, rtol=1e-5 if tight else 2e-2, atol=1e-7 if tight else 2e-3)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_fused_matches_the_unpatched_model(arch):
    model = _on_gpu(arch, torch.float32)
    loss, _, grads = _step(model)
    fused_loss, _, fused_grads = _step(_swapped(model, fuse=True))
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    _assert_grads(fused_grads, grads, exact=False, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fused_model_matches_eager(backend):
    """aot_eager runs the traced graph's ops as they are: bitwise the eager step (whose norms launch
    directly, not through the ops). inductor also compiles the other ops (their sums in its order)."""
    model = _swapped(_on_gpu("llama", torch.float32), fuse=True)
    torch._dynamo.reset()
    compiled_loss, _, compiled_grads = _step(torch.compile(model, fullgraph=True, backend=backend))
    loss, _, grads = _step(model)
    exact = backend == "aot_eager"
    if exact:
        assert torch.equal(compiled_loss, loss)
    else:
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
    _assert_grads(compiled_grads, grads, exact=exact, rtol=1e-4, atol=1e-6)


def test_compiled_model_with_the_gradient_sum_pass_keeps_its_bits():
    """bf16 Llama compiled by inductor on the GPU, with and without cake_cute.graph_passes: the pass
    folds each layer's q/k/v and gate/up gradient sums into the norms' backward, and the loss and every
    gradient keep their bits (the kernel sums like inductor's fused add)."""
    from .test_fusion_cpu import LAYERS
    from .test_graph_passes_cpu import compiled_with_and_without_the_pass

    results, counts = compiled_with_and_without_the_pass(
        lambda: _swapped(_on_gpu("llama", torch.bfloat16), fuse=True)
    )
    assert sum(counts) == 2 * LAYERS, counts
    (loss, _, grads), (loss_folded, _, grads_folded) = results
    assert torch.equal(loss, loss_folded)
    _assert_grads(grads_folded, grads, exact=True)
