"""Shared test setup: tests marked ``gpu`` are skipped on machines without a CUDA device (and on a
CUDA device cake_cute does not support: it needs sm_90 / sm_100 / sm_103).

Shared helpers (NaN-poisoned output factory, bitwise comparison, error measures) live in
``tests/_helpers.py``; the fixtures below expose the most common ones.
"""

from functools import cache

import pytest
import torch

from ._helpers import poison, sentinel


@cache
def gpu_skip_reason():
    """None when the GPU tests can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        from cake_cute import is_cake_rmsnorm_train_supported

        if not is_cake_rmsnorm_train_supported(torch.device("cuda")):
            major, minor = torch.cuda.get_device_capability()
            return f"needs an sm_90/sm_100/sm_103 GPU, this one is sm_{major}{minor}"
    except Exception as exc:  # a broken install must not silently skip: report it as the reason
        return f"cake_cute cannot check the GPU: {exc!r}"
    return None


def pytest_configure(config):
    # Declared in pyproject.toml too; repeated so --strict-markers works from any root.
    config.addinivalue_line("markers", "gpu: needs an NVIDIA Hopper or Blackwell GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        # The native host path is built before any test runs, as ``cake-cute warmup`` or
        # ``cake_cute.prepare()`` builds it before training: no call in a test step ever compiles it.
        import cake_cute

        cake_cute.prepare()
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poisoned():
    """Factory: ``poisoned(shape, dtype, device="cuda")`` -> a NaN (or 0xFF) filled output buffer."""
    return poison


@pytest.fixture
def sentinel_buffer():
    """Factory: ``sentinel_buffer(shape, dtype, device="cpu")`` -> a buffer filled with -7.0 (0xAB)."""
    return sentinel


@pytest.fixture(scope="module")
def megatron_cpu():
    """Megatron-Core's parallel state on the CPU (one gloo rank) for a test module, torn down after it."""
    from ._megatron_cpu import CPU

    started = CPU.initialize_megatron_on_cpu()
    yield
    CPU.shutdown_megatron_on_cpu(started)


# What the stand-in of the dW reduction writes into its output, so that what the host does with dw
# afterwards can be seen.
RECORDED_DW = 0.25


class _Recorder:
    """Stands in for a compiled kernel: records the spec and arguments of each launch (a dW reduction
    writes ``RECORDED_DW`` into its output)."""

    def __init__(self, spec, calls):
        self.spec, self.calls = spec, calls

    def __call__(self, *args):
        self.calls.append((self.spec, args))
        if self.spec.kind == "dw":
            args[1].fill_(RECORDED_DW)


@pytest.fixture
def launches(monkeypatch):
    """The gated host path (``gated_ops``) down to the launches on CPU tensors: an sm_90a device of 132
    SMs, and kernels that record their spec and arguments (``(spec, args)`` in launch order)."""
    import contextlib

    from cake_cute.gated import ops as gated_ops
    from cake_cute.runtime.device import DeviceFacts

    calls = []
    monkeypatch.setattr(gated_ops, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(
        gated_ops, "device_facts", lambda device: DeviceFacts(0, "test", (9, 0), "sm_90a", 132)
    )
    monkeypatch.setattr(gated_ops, "resident_clusters", lambda *args: 264)
    monkeypatch.setattr(gated_ops, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(gated_ops, "get_kernel", lambda spec: _Recorder(spec, calls))
    return calls
