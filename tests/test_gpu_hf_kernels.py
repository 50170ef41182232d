"""Hugging Face's kernel route on the GPU (``test_hf_kernels_cpu.py`` on CPU): models loaded with
``from_pretrained(..., use_kernels=True, kernel_config=cake_cute.hf_kernel_config(config))`` on CUDA
in bf16 run cake_cute's kernels in their norms and step bitwise as the same norms swapped by
``swap_rmsnorm`` / ``swap_gated_rmsnorm`` (the same kernels, the same casts), eager, compiled by
inductor, and in a Trainer run with ``bf16=True``."""

from __future__ import annotations

import pytest
import torch

from cake_cute import hf_kernel_config
from cake_cute.hf import kernel_route

from .test_hf_kernels_cpu import (
    _assert_bound,
    _assert_same_step,
    _family_model,
    _step,
    _swapped_like_route,
    assert_trainer_runs_alike,
)

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
pytest.importorskip("kernels")


def _loaded(name: str, path, dtype=torch.bfloat16):
    """(route model, swapped model) of the family's tiny model saved to ``path`` and loaded on CUDA."""
    _family_model(name).to(dtype).save_pretrained(path)
    config = transformers.AutoConfig.from_pretrained(path)
    load = dict(dtype=dtype, device_map="cuda", attn_implementation="eager")
    routed = transformers.AutoModelForCausalLM.from_pretrained(
        path, use_kernels=True, kernel_config=hf_kernel_config(config), **load
    ).train()
    # use_kernels=False: with the kernels package installed, transformers 5.25 kernelizes a model by
    # default from its own hub mapping (rotary embeddings among it on CUDA), which needs the network.
    stock = transformers.AutoModelForCausalLM.from_pretrained(path, use_kernels=False, **load).train()
    _assert_bound(routed)
    return routed, _swapped_like_route(stock, kernel_route.LAYERS)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_route_steps_bitwise_the_swapped_norms(name, tmp_path):
    routed, swapped = _loaded(name, tmp_path)
    _assert_same_step(_step(routed), _step(swapped))


def test_gated_route_on_cuda(tmp_path):
    """Qwen3.5 (its 1 + weight norms and its gated norms through the route): logits and loss bitwise the
    swapped norms'; gradients within 1e-3 relative (its linear attention's backward on CUDA is not
    guaranteed to sum in one order from run to run)."""
    routed, swapped = _loaded("qwen3_5", tmp_path)
    (logits, loss, grads), (want_logits, want_loss, want_grads) = _step(routed), _step(swapped)
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)
    for key, g in want_grads.items():
        if g is not None:
            error = (grads[key].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)
            assert error <= 1e-3, (key, error.item())


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_route_under_autocast_with_fp32_weights(name, tmp_path):
    routed, swapped = _loaded(name, tmp_path, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _assert_same_step(_step(routed), _step(swapped))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_route_compiled_by_inductor(name, tmp_path):
    """``Mode.TRAINING | Mode.TORCH_COMPILE`` and torch.compile(fullgraph=True): the compiled route
    model bitwise the swapped norms compiled alike (one graph each, the same operations)."""
    from kernels import Mode

    routed, swapped = _loaded(name, tmp_path)
    routed.set_use_kernels(
        True, kernel_config=hf_kernel_config(routed), mode=Mode.TRAINING | Mode.TORCH_COMPILE
    )
    results = []
    for model in (routed, swapped):
        torch._dynamo.reset()
        results.append(_step(torch.compile(model, fullgraph=True)))
    _assert_same_step(*results)


def test_kernelized_on_cpu_then_moved_to_cuda(tmp_path):
    """Loaded (and kernelized) on CPU, moved to CUDA, then train(): transformers re-kernelizes for the
    model's new device, where the config maps the layers too."""
    _family_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    load = dict(dtype=torch.bfloat16, attn_implementation="eager")
    routed = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, use_kernels=True, kernel_config=hf_kernel_config(config), **load
    )
    routed = routed.cuda().train()
    _assert_bound(routed)
    stock = (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=False, **load).cuda().train()
    )
    _assert_same_step(_step(routed), _step(_swapped_like_route(stock, kernel_route.LAYERS)))


def test_trainer_bf16(tmp_path):
    """Three Trainer steps with bf16=True (fp32 weights under autocast) bitwise the swapped model's."""
    pytest.importorskip("accelerate")  # the Trainer's
    routed, swapped = _loaded("llama", tmp_path / "model", torch.float32)
    assert_trainer_runs_alike(routed, swapped, tmp_path, bf16=True)
