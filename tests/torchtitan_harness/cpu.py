"""The settings torchtitan 0.3 needs on a CPU-only machine and does not expose; ``prepare()`` makes them
before torchtitan is imported (the launcher and the tests call it):

- device: torchtitan falls back to ``cuda`` when no accelerator is found; here the device type is ``cpu``
  (so its process group backend is gloo);
- torchtitan's expert-parallel kernels module imports ``triton`` at module level (CPU wheels of torch
  come without it): it is a placeholder whose kernels raise (the llama3 model never calls them);
- the Qwen3.5 model imports fla (Triton kernels) at module level: where fla is missing,
  ``import_qwen35()`` imports it with placeholder fla modules that give it transformers' torch
  implementation of the chunked gated delta rule (the same math as fla's ``chunk_gated_delta_rule``,
  for the stock and cake runs alike) and, for fla's varlen and recurrent kernels (which a training run
  without packed documents does not call), functions that raise. The placeholders leave
  ``sys.modules`` once the model is imported, so nothing else in the process takes them for fla.

``patch_trainer()`` (after the import) makes the settings of a training run:

- ``torch.cpu`` keeps no memory statistics: the memory monitor reports zeros;
- gloo refuses FSDP2's ``PREMUL_SUM`` reduce-scatter: FSDP2 is told to reduce with a plain sum (the
  divide factor torchtitan sets is 1.0, so the gradients are the same);
- ``torch.distributed.set_timeout`` (called after the first step) does not exist in this torch: the
  timeout change is skipped.
"""

import importlib.util
import math
import sys
import types

import torch._utils

_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _triton_kernel(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{name} is a triton kernel; this CPU run has no triton")

    return unavailable


class _FlaOnly(torch.autograd.Function):
    """Stands for an fla autograd Function the Qwen3.5 model registers with its SPMD types but a CPU
    training run never applies."""

    @staticmethod
    def forward(ctx, *args):
        raise RuntimeError("an fla kernel; this CPU run has no fla")


def _torch_delta_rule():
    """transformers' torch ``chunk_gated_delta_rule``, unwrapped from its kernel-hub decorator: it
    takes fla's [batch, tokens, heads, dim] arguments and returns (output, final state)."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    rule = modeling_qwen3_next.torch_chunk_gated_delta_rule
    while hasattr(rule, "__wrapped__"):
        rule = rule.__wrapped__
    return rule


def _fla_placeholders() -> dict[str, dict]:
    """The fla modules torchtitan's Qwen3.5 model imports, and the names it takes from them."""
    unavailable = _triton_kernel("fla's kernel")
    return {
        "fla": {},
        "fla.modules": {},
        "fla.modules.conv": {},
        "fla.modules.conv.triton": {},
        "fla.modules.conv.triton.ops": {
            "CausalConv1dFunction": type("CausalConv1dFunction", (_FlaOnly,), {})
        },
        "fla.modules.conv.causal_conv1d": {"causal_conv1d": unavailable},
        "fla.ops": {},
        "fla.ops.gated_delta_rule": {
            "chunk_gated_delta_rule": _torch_delta_rule(),
            "fused_recurrent_gated_delta_rule": unavailable,
        },
        "fla.ops.gated_delta_rule.chunk": {
            "ChunkGatedDeltaRuleFunction": type("ChunkGatedDeltaRuleFunction", (_FlaOnly,), {})
        },
        "fla.ops.gated_delta_rule.fused_recurrent": {
            "FusedRecurrentFunction": type("FusedRecurrentFunction", (_FlaOnly,), {})
        },
    }


def prepare() -> None:
    """Device type ``cpu`` where no accelerator is found, and the placeholder kernels module where
    triton is missing; call before importing torchtitan. Idempotent."""
    if torch._utils._get_available_device_type() is None:
        torch._utils._get_available_device_type = lambda: "cpu"  # read once by torchtitan.tools.utils
    if importlib.util.find_spec("triton") is None and _EP_KERNELS not in sys.modules:
        placeholder = types.ModuleType(_EP_KERNELS)
        placeholder.__getattr__ = _triton_kernel
        sys.modules[_EP_KERNELS] = placeholder


QWEN35_MODEL = "torchtitan.models.qwen3_5.model"


def import_qwen35() -> None:
    """Import torchtitan's Qwen3.5 model (after ``prepare()``); where fla is missing, with the
    placeholder fla modules in ``sys.modules`` for that import only. Idempotent."""
    if QWEN35_MODEL in sys.modules or importlib.util.find_spec("fla") is not None:
        importlib.import_module(QWEN35_MODEL)
        return
    placeholders = _fla_placeholders()
    for name, names in placeholders.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so the submodules below it resolve
        module.__dict__.update(names)
        sys.modules[name] = module
    try:
        importlib.import_module(QWEN35_MODEL)
    finally:
        for name in placeholders:
            sys.modules.pop(name, None)


class _HostMemoryMonitor:
    """torchtitan's device memory monitor reads CUDA-style statistics, which ``torch.cpu`` lacks."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


def patch_trainer() -> None:
    """Memory monitor, FSDP2 reduction and process-group timeouts for a CPU run (see the module doc)."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.utils as dist_utils

    disable_division = fsdp.disable_fsdp_gradient_division

    def sum_reduction(model) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    metrics.build_device_memory_monitor = _HostMemoryMonitor
    fsdp.disable_fsdp_gradient_division = sum_reduction
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


def built_on_cpu(model_config, seed: int = 0):
    """The model of ``model_config`` built on the meta device as torchtitan's trainer builds it (its
    module protocol verified), then on CPU with NaN parameters, then initialized by ``init_states``
    from ``seed``: a parameter its init leaves alone stays NaN."""
    with torch.device("meta"):
        model = model_config.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(math.nan)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states()
    return model
