"""Device time of one call with the L2 defeated, and the device-copy ceiling of the same bytes.

* ``gpu_us``: a spin kernel holds the stream while the host queues the start event, the call and the
  end event, so the events bracket the call's device work alone. If the spin ended before the host
  finished queuing, the call is measured again with a spin twice as long.
* L2: calls rotate through input sets whose bytes together exceed ``L2_FACTOR`` times the L2, so every
  figure is an HBM figure.
* ``copy_tbps``: the same bytes copied device to device, timed the same way with the same rotation.
* ``kernel_us`` (small grid): the profiler's summed durations of the kernels one call launches,
  without the gaps ``gpu_us`` keeps around them, which dominate calls of a few microseconds.

torch is passed in, so this module imports on a machine without torch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

L2_FACTOR = 2  # the rotation's bytes exceed twice the L2: LRU-like replacement keeps none of a set
MAX_BUFFER_SETS = 64
SPIN_CYCLES = 1 << 21  # about 1 ms at 2 GHz: longer than the host side of any call measured
MAX_SPIN_CYCLES = 1 << 27
CLOCK_WARMUP_S = 0.5


def tbps(nbytes: int, us: float) -> float:
    """TB/s of ``nbytes`` moved in ``us`` microseconds, to 5 significant digits."""
    return float(f"{nbytes / us / 1e6:.5g}")


def buffer_sets_for(set_bytes: int, l2_bytes: int, rotate: bool = True) -> int:
    """How many input sets of ``set_bytes`` to rotate so none is L2-resident in its turn (1 without
    ``rotate``)."""
    if not rotate or set_bytes <= 0:
        return 1
    return min(MAX_BUFFER_SETS, max(1, math.ceil(L2_FACTOR * l2_bytes / set_bytes)))


def gpu_events(torch, run: Callable[[], object]) -> list:
    """The profiler's GPU events (kernels and copies) of ``run()``."""
    profiler = torch.profiler
    with profiler.profile(activities=[profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


class Rotation:
    """Hands out set indices round-robin across every call, so each set is reused ``n - 1`` calls later."""

    def __init__(self, n: int):
        self.n = n
        self.calls = 0

    def next(self) -> int:
        index = self.calls % self.n
        self.calls += 1
        return index


class LateHostError(RuntimeError):
    """The host side of a call outlasted the longest spin: its device time cannot be isolated."""


class DeviceTimer:
    """Per-call timings on one device; ``setup()`` prepares a call's ``arg`` outside the timed region."""

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self.spin_cycles = SPIN_CYCLES
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size

    def _events(self):
        return tuple(self.torch.cuda.Event(enable_timing=True) for _ in range(2))

    def wall_us(self, call: Callable, reps: int, setup: Callable | None = None) -> list[float]:
        """Per-call time from an idle GPU: host work (checks, dispatch, launches) included."""
        cuda = self.torch.cuda
        start, end = self._events()
        times = []
        for _ in range(reps):
            arg = setup() if setup is not None else None
            cuda.synchronize()
            start.record()
            result = call(arg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
            del result, arg
        return times

    def _device_once(self, call: Callable, arg) -> float:
        cuda = self.torch.cuda
        start, end = self._events()
        while True:
            cuda.synchronize()
            cuda._sleep(self.spin_cycles)
            start.record()
            result = call(arg)
            end.record()
            host_late = start.query()  # the spin is over although the host may still have been queuing
            end.synchronize()
            del result
            if not host_late:
                return start.elapsed_time(end) * 1e3
            if self.spin_cycles >= MAX_SPIN_CYCLES:
                raise LateHostError(f"the host side of one call outlasted a {self.spin_cycles}-cycle spin")
            self.spin_cycles *= 2

    def device_us(self, call: Callable, reps: int, setup: Callable | None = None) -> float:
        """Median device time of one call in µs; LateHostError when the host outlasts the spin."""
        times = []
        for _ in range(reps):
            times.append(self._device_once(call, setup() if setup is not None else None))
        return statistics.median(times)

    def kernel_us(self, call: Callable, reps: int, setup: Callable | None = None) -> float:
        """Mean device time of the kernels (and copies) of one call in µs, from the profiler."""
        args = [setup() if setup is not None else None for _ in range(reps)]
        self.torch.cuda.synchronize()

        def calls():
            for arg in args:
                call(arg)

        return sum(e.time_range.elapsed_us() for e in gpu_events(self.torch, calls)) / reps

    def copy_ceiling(self, nbytes: int, reps: int, rotate: bool = True, kernel_time: bool = False) -> dict:
        """The device-copy ceiling for ``nbytes`` moved, as row fields (``copy_tbps``, the faster of a memcpy
        and a copy kernel, and the details)."""
        torch = self.torch
        half = max(16, (nbytes // 2) // 16 * 16)
        sets = buffer_sets_for(nbytes, self.l2_bytes, rotate)
        pairs = [
            (
                torch.zeros(half, dtype=torch.uint8, device=self.device),
                torch.empty(half, dtype=torch.uint8, device=self.device),
            )
            for _ in range(sets)
        ]
        floats = [(src.view(torch.float32), dst.view(torch.float32)) for src, dst in pairs]
        rotation = Rotation(sets)

        def memcpy(_):
            src, dst = pairs[rotation.next()]
            return dst.copy_(src)

        def kernel(_):
            src, dst = floats[rotation.next()]
            return torch.neg(src, out=dst)

        result = {"copy_bytes": 2 * half, "copy_buffer_sets": sets}
        calls = {"memcpy": memcpy, "kernel": kernel}
        for label, call in calls.items():
            for _ in range(sets):
                call(None)
            us = self.device_us(call, reps)
            result[f"copy_{label}_tbps"] = tbps(2 * half, us)
        best = max(result["copy_memcpy_tbps"], result["copy_kernel_tbps"])
        if kernel_time:
            faster = "memcpy" if best == result["copy_memcpy_tbps"] else "kernel"
            result["copy_kernel_us"] = round(self.kernel_us(calls[faster], reps), 3)
        result["copy_gpu_us"] = round(2 * half / best / 1e6, 3)
        result["copy_tbps"] = best
        return result

    def warm_clocks(self) -> None:
        """Copies for about half a second, so the first row does not meet idle clocks."""
        torch = self.torch
        src = torch.empty(1 << 28, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        start = time.perf_counter()
        while time.perf_counter() - start < CLOCK_WARMUP_S:
            for _ in range(20):
                dst.copy_(src)
            torch.cuda.synchronize()
