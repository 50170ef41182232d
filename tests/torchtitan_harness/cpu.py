"""The settings torchtitan 0.3 needs on a CPU-only machine and does not expose; ``prepare()`` makes them
before torchtitan is imported (the launcher and the tests call it):

- device: torchtitan falls back to ``cuda`` when no accelerator is found; here the device type is ``cpu``
  (so its process group backend is gloo);
- torchtitan's expert-parallel kernels module imports ``triton`` at module level (CPU wheels of torch
  come without it): it is a placeholder whose kernels raise (the llama3 model never calls them).

``patch_trainer()`` (after the import) makes the settings of a training run:

- ``torch.cpu`` keeps no memory statistics: the memory monitor reports zeros;
- gloo refuses FSDP2's ``PREMUL_SUM`` reduce-scatter: FSDP2 is told to reduce with a plain sum (the
  divide factor torchtitan sets is 1.0, so the gradients are the same);
- ``torch.distributed.set_timeout`` (called after the first step) does not exist in this torch: the
  timeout change is skipped.
"""

import importlib.util
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


def prepare() -> None:
    """Device type ``cpu`` where no accelerator is found, and the placeholder kernels module where
    triton is missing; call before importing torchtitan. Idempotent."""
    if torch._utils._get_available_device_type() is None:
        torch._utils._get_available_device_type = lambda: "cpu"  # read once by torchtitan.tools.utils
    if importlib.util.find_spec("triton") is None and _EP_KERNELS not in sys.modules:
        placeholder = types.ModuleType(_EP_KERNELS)
        placeholder.__getattr__ = _triton_kernel
        sys.modules[_EP_KERNELS] = placeholder


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
