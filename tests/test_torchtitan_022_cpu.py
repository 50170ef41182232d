"""torchtitan 0.2.x integration (``cake_cute.integrations.torchtitan``'s model converters): the llama3
debug model built on the meta device, converted, materialized and initialized as 0.2.x's trainer does
has a ``CakeRMSNorm`` in place of every norm, in the mode the converter names, and computes the stock
forward bitwise and its gradients.

Runs where torchtitan 0.2.x is installed (``benchmarks/torchtitan_022_kit.sh`` lists what its llama3
package imports; on CPU builds of torch also triton, which its MoE kernels module imports); with
torchtitan 0.3 (tests/test_torchtitan_cpu.py) or none this module is skipped.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest
import torch

from cake_cute import CakeRMSNorm


def _torchtitan_version() -> str | None:
    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return None


# Read from the installed metadata, not by importing: torchtitan 0.3 must be imported only after
# tests/test_torchtitan_cpu.py has prepared it for a CPU-only machine (tests/torchtitan_harness/cpu.py).
TORCHTITAN_VERSION = _torchtitan_version()
if TORCHTITAN_VERSION is None or not TORCHTITAN_VERSION.startswith("0.2."):
    pytest.skip(
        f"torchtitan 0.2.x is not installed here (found {TORCHTITAN_VERSION})", allow_module_level=True
    )

from torchtitan.models.llama3 import Transformer, llama3_args  # noqa: E402
from torchtitan.protocols.model_converter import _registry_model_converter_cls as converters  # noqa: E402

from cake_cute.integrations.torchtitan import (  # noqa: E402
    CakeRMSNormConverter,
    CakeRMSNormMemoryEfficientConverter,
)

N_NORMS = 13  # two per block of six, and the final norm
CONVERTERS = pytest.mark.parametrize(
    ("converter", "memory_efficient"),
    [("cake_rmsnorm", False), ("cake_rmsnorm_memory_efficient", True)],
)


def _debug_model(converter: str | None) -> torch.nn.Module:
    """The llama3 debug model as 0.2.x's trainer builds it: on the meta device, converted, then
    materialized on CPU and initialized from one seed."""
    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel"])
    if converter is not None:
        converters[converter](None, None).convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def _with_norm_weights_off_one(model: torch.nn.Module) -> torch.nn.Module:
    """Every norm weight drawn from [0.5, 1.5), one draw per model, as a trained model's are: at its init
    of ones the memory-efficient backward, which divides the saved output by the weight, is not tried."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5, generator=generator)
    return model


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    logits = model(tokens)
    logits.float().square().mean().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_importing_registers_both_converters():
    assert converters["cake_rmsnorm"] is CakeRMSNormConverter
    assert converters["cake_rmsnorm_memory_efficient"] is CakeRMSNormMemoryEfficientConverter


@CONVERTERS
def test_converter_swaps_every_norm_in_its_mode(converter, memory_efficient):
    model = _debug_model(converter)
    norms = [m for m in model.modules() if isinstance(m, CakeRMSNorm)]
    assert len(norms) == N_NORMS
    assert not any(type(m) is torch.nn.RMSNorm for m in model.modules())
    assert all(norm.memory_efficient is memory_efficient for norm in norms)
    assert all(torch.equal(norm.weight, torch.ones_like(norm.weight)) for norm in norms)  # init_weights


@CONVERTERS
def test_converted_forward_bitwise_and_gradients_match_stock(converter, memory_efficient):
    tokens = torch.randint(
        0, llama3_args["debugmodel"].vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    stock_logits, stock_grads = _loss_and_grads(_with_norm_weights_off_one(_debug_model(None)), tokens)
    logits, grads = _loss_and_grads(_with_norm_weights_off_one(_debug_model(converter)), tokens)
    assert torch.equal(logits, stock_logits)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-5, atol=1e-7, msg=name)
