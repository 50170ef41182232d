"""The GPU subset of the Hugging Face conformance matrix (``test_hf_conformance_cpu.py``): the fused
models on the CUDA kernels in bf16, under autocast with fp32 weights, under non-reentrant checkpointing
and compiled by inductor. Eager CUDA calls take the native path, which a dispatch mode does not see, so
these tests compare values; the CPU matrix counts the fused calls."""

from __future__ import annotations

import pytest
import torch

from .test_hf_conformance_cpu import converted, step, tiny

pytestmark = pytest.mark.gpu

# One family per template and branch op: pre-norm, q/k norms, sandwich (twice), dropout, multiplier, MoE.
GPU_FAMILIES = ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "granite", "llama4_text"]


def _on_gpu(name, dtype):
    return tiny(name, dtype).cuda()


def _relative_errors(actual: dict, expected: dict) -> dict:
    return {
        key: ((actual[key].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)).item()
        for key, g in expected.items()
        if g is not None
    }


@pytest.mark.parametrize("name", GPU_FAMILIES)
def test_bf16_fused_against_unfused(name):
    """bf16 on the CUDA kernels: the loss is bitwise the swapped, unfused model's (the kernel rounds the
    add as torch does); gradients within 3e-2 relative norm (one rounding instead of two per dx)."""
    model = _on_gpu(name, torch.bfloat16)
    fused_loss, fused_grads, _ = step(converted(model, fuse=True)[0], count=False)
    loss, grads, _ = step(converted(model, fuse=False)[0], count=False)
    assert torch.equal(fused_loss, loss)
    errors = _relative_errors(fused_grads, grads)
    assert max(errors.values()) <= 3e-2, errors


@pytest.mark.parametrize("name", GPU_FAMILIES)
def test_autocast_fp32_weights(name):
    """HF Trainer's bf16=True on CUDA: no crash, the step bitwise the swapped unfused model's."""
    model = _on_gpu(name, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused_loss, fused_grads, _ = step(converted(model, fuse=True)[0], count=False)
        loss, grads, _ = step(converted(model, fuse=False)[0], count=False)
    assert torch.equal(fused_loss, loss)
    assert max(_relative_errors(fused_grads, grads).values()) <= 1e-6


@pytest.mark.parametrize("name", GPU_FAMILIES)
def test_non_reentrant_checkpointing(name):
    model = _on_gpu(name, torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused_loss, fused_grads, _ = step(converted(model, fuse=True)[0], count=False)
    loss, grads, _ = step(converted(model, fuse=False)[0], count=False)
    assert torch.equal(fused_loss, loss)
    assert max(_relative_errors(fused_grads, grads).values()) <= 3e-2


def _compiled_against_eager(model) -> tuple:
    """(loss, eager loss, worst relative gradient error) of a compiled step against the eager one."""
    eager_loss, eager_grads, _ = step(model, count=False)
    torch._dynamo.reset()
    loss, grads, _ = step(torch.compile(model, fullgraph=True), count=False)
    return loss, eager_loss, max(_relative_errors(grads, eager_grads).values())


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3_text"])
def test_inductor_fullgraph(name):
    """torch.compile(fullgraph=True) with inductor on the bf16 fused model against its eager step. Inductor
    computes a bf16 model's other ops at its own precision, so the bound is the untouched model's own
    compiled-against-eager spread (half as much again), and 3e-2 where that spread is smaller."""
    stock = _on_gpu(name, torch.bfloat16)
    fused, _ = converted(stock, fuse=True)
    loss, eager_loss, error = _compiled_against_eager(fused)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=0.0)
    *_, stock_error = _compiled_against_eager(stock)
    assert error <= max(3e-2, 1.5 * stock_error), (error, stock_error)
