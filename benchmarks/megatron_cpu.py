"""Megatron-Core on a CPU, for tests and smoke runs (never for cake_cute itself): a gloo process group of
world size 1 and Megatron's model-parallel state, plus the two Megatron calls that assume CUDA.

- ``GlobalMemoryBuffer.get_tensor`` (``megatron/core/utils.py``) allocates the local attention's score
  buffer on ``torch.cuda.current_device()``: a CPU buffer class takes its place in ``parallel_state``.
- The dropout regions fork the CUDA RNG tracker (``tensor_parallel.random``), which reads and sets
  ``torch.cuda`` RNG states: a tracker whose fork is a no-op takes its place (the runs use no dropout).

The default causal mask of the local attention is also built on CUDA
(``transformer/utils.py`` ``get_default_causal_mask``): callers pass ``causal_mask(seq)`` explicitly.
Megatron's DDP buffers (``param_and_grad_buffer.py``) and its checkpoint writer (``filesystem_async.py``,
``state_dict_saver.py``) allocate on ``torch.cuda.current_device()``, synchronize CUDA and (0.17+) ask
for the current CUDA stream: ``cuda_calls_on_cpu()`` answers those calls with the CPU while entered.
Gated DeltaNet layers need fla, whose kernels need a GPU: ``gated_delta_net_without_fla()`` puts torch
forms in their place (Megatron-Core 0.16-0.18, where the layer is the module ``ssm/gated_delta_net.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile

import torch


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked) for causal attention over ``seq`` tokens."""
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


class _CpuStream:
    """The stream Megatron 0.17+'s DDP asks for before a gradient sync, to wait on CUDA-graph events
    (none on the CPU)."""

    def wait_event(self, event) -> None:
        raise RuntimeError("a CUDA event reached the CPU stand-in stream")


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """While entered, ``torch.cuda.current_device()`` names the CPU, ``torch.cuda.synchronize()`` returns
    at once (the CPU has nothing to wait for) and ``torch.cuda.current_stream()`` is a stream with no
    events to wait on."""
    saved = torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _CpuStream()
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream = saved


def _torch_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2norm`` (``x / sqrt(sum(x^2) + eps)`` over the last dimension, FP32 math, x's dtype)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


@contextlib.contextmanager
def gated_delta_net_without_fla():
    """While entered, Megatron's ``GatedDeltaNet`` builds and runs without fla (whose Triton kernels need
    a GPU): fla's ``l2norm`` is the torch form above and ``chunk_gated_delta_rule`` is Megatron's own
    ``torch_chunk_gated_delta_rule`` (what its ``deterministic_mode`` runs); the convolution takes
    Megatron's torch path, as without ``causal_conv1d``. The layer also allocates on
    ``torch.cuda.current_device()``: build it inside ``cuda_calls_on_cpu()``."""
    import importlib

    module = importlib.import_module("megatron.core.ssm.gated_delta_net")
    stand_ins = {
        "HAVE_FLA": True,
        "l2norm": _torch_l2norm,
        "chunk_gated_delta_rule": module.torch_chunk_gated_delta_rule,
    }
    saved = {name: getattr(module, name, None) for name in stand_ins}
    for name, value in stand_ins.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _cpu_memory_buffer():
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        """Hands out fresh CPU tensors (the attention's baddbmm overwrites them: beta = 0)."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(math.prod(tensor_shape), dtype=dtype).view(*tensor_shape)

    return CpuMemoryBuffer()


def _cpu_rng_tracker():
    from megatron.core.tensor_parallel import random as megatron_random

    class CpuRngTracker(megatron_random.CudaRNGStatesTracker):
        """Forks nothing: with dropout 0 no random numbers are drawn inside the forked regions."""

        @contextlib.contextmanager
        def fork(self, name=None):
            yield

    return megatron_random, CpuRngTracker()


def initialize_megatron_on_cpu() -> bool:
    """Start a gloo group of world size 1 (unless one exists), Megatron's parallel state with TP = PP = 1,
    and the CPU stand-ins above. Returns whether this call started the process group."""
    from megatron.core import parallel_state

    started = not torch.distributed.is_initialized()
    if started:
        store = os.path.join(tempfile.mkdtemp(prefix="megatron-cpu-"), "store")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer()
    megatron_random, tracker = _cpu_rng_tracker()
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return started


def shutdown_megatron_on_cpu(started: bool) -> None:
    """Undo ``initialize_megatron_on_cpu``: Megatron's parallel state, the RNG tracker, and the process
    group if that call started it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    parallel_state.destroy_model_parallel()
    megatron_random._CUDA_RNG_STATE_TRACKER = None
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    if started:
        torch.distributed.destroy_process_group()
