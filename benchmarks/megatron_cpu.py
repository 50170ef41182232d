"""Megatron-Core on a CPU, for tests and smoke runs (never for cake_cute itself): a gloo process group of
world size 1 and Megatron's model-parallel state, plus stand-ins for the Megatron calls that assume CUDA
(or Transformer Engine).

- ``GlobalMemoryBuffer.get_tensor`` (``megatron/core/utils.py``) allocates the local attention's score
  buffer on ``torch.cuda.current_device()``: a CPU buffer class takes its place in ``parallel_state``.
- The dropout regions fork the CUDA RNG tracker (``tensor_parallel.random``), which reads and sets
  ``torch.cuda`` RNG states: a tracker whose fork is a no-op takes its place (the runs use no dropout).
- Selective recomputation saves the CUDA RNG state and asks Transformer Engine whether FP8 is on:
  ``_recomputation_on_cpu`` answers both.

The default causal mask of the local attention is also built on CUDA
(``transformer/utils.py`` ``get_default_causal_mask``): callers pass ``causal_mask(seq)`` explicitly.
Megatron's DDP buffers (``param_and_grad_buffer.py``) and its checkpoint writer (``filesystem_async.py``,
``state_dict_saver.py``) allocate on ``torch.cuda.current_device()``, synchronize CUDA and (0.17+) ask
for the current CUDA stream: ``cuda_calls_on_cpu()`` answers those calls with the CPU while entered.
Gated DeltaNet layers need fla, whose kernels need a GPU: ``gated_delta_net_without_fla()`` puts torch
forms in their place.
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


def _torch_causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **state):
    """fla's ``causal_conv1d`` as Megatron 0.19's Gated DeltaNet calls it (x ``[b, s, d]``, weight ``[d, w]``,
    no state in or out), by torch's depthwise convolution, as Megatron's deterministic path computes it."""
    if cu_seqlens is not None or state.get("initial_state") is not None or state.get("output_final_state"):
        raise NotImplementedError("the CPU stand-in convolves whole sequences without state")
    seq, width = x.shape[1], weight.shape[-1]
    y = torch.nn.functional.conv1d(
        x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[2]
    )
    y = y[..., :seq].transpose(1, 2)
    return (torch.nn.functional.silu(y) if activation in ("silu", "swish") else y), None


@contextlib.contextmanager
def gated_delta_net_without_fla():
    """While entered, Megatron's ``GatedDeltaNet`` builds and runs without fla (whose Triton kernels need
    a GPU): fla's ``l2norm`` and (0.19) ``causal_conv1d`` are the torch forms above and
    ``chunk_gated_delta_rule`` is Megatron's own ``torch_chunk_gated_delta_rule`` (what its
    ``deterministic_mode`` runs); before 0.19 the convolution takes Megatron's torch path, as without the
    ``causal_conv1d`` package. The layer also allocates on
    ``torch.cuda.current_device()``: build it inside ``cuda_calls_on_cpu()``."""
    import importlib
    import sys

    package = importlib.import_module("megatron.core.ssm.gated_delta_net")
    stand_ins = {
        "HAVE_FLA": True,
        "l2norm": _torch_l2norm,
        "chunk_gated_delta_rule": package.torch_chunk_gated_delta_rule,
        "causal_conv1d": _torch_causal_conv1d,
    }
    # Where the layer looks these names up: the module (0.16-0.18), or the package's modules (0.19);
    # without fla some of them are not defined there at all.
    modules = [m for name, m in list(sys.modules.items()) if name.startswith(package.__name__)]
    absent = object()
    saved = [(m, name, getattr(m, name, absent)) for m in modules for name in stand_ins]
    for module, name, _ in saved:
        setattr(module, name, stand_ins[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            if value is absent:
                delattr(module, name)
            else:
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
    _recomputation_on_cpu(megatron_random)
    return started


class _Fp8Off:
    """Transformer Engine's FP8 state manager, as far as Megatron's recomputation asks it: FP8 is off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def _recomputation_on_cpu(megatron_random) -> None:
    """Selective recomputation (``CheckpointWithoutOutput``) saves and restores the CUDA RNG state, and
    takes its FP8 path whatever it is given (its ``fp8 is not None``), which names Transformer Engine's
    FP8 state manager and contexts: no CUDA RNG state here, and those names say FP8 is off."""
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: None
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    if not megatron_random.HAVE_TE:
        megatron_random.FP8GlobalStateManager = _Fp8Off
        megatron_random.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
        megatron_random.fp8_autocast = lambda **kwargs: contextlib.nullcontext()


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
