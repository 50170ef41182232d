#!/usr/bin/env python
"""``python benchmarks/memory_bench.py OUT.json``: the backward of the memory-efficient mode (the norm
saves its output y and recomputes xhat = y / (w + weight_offset)) against the default mode's (the norm
saves its input), each as a fraction of a device copy of the bytes it must move.

Both backwards read g and one saved [T, H] tensor (x or h_new by default, y in the mode), read
g_residual in residual mode, and write dx: ``(3 [+ 1]) * T * H * act_bytes + 4 * T`` bytes, the same for
both. ``fraction`` = (device time of a copy of those bytes) / (device time of the backward): 1.0 runs at
the copy's speed. The backward runs through autograd (``torch.autograd.grad`` of y, and of h_new
in residual mode, for x and w; the forward run untimed before each call), so its time is the
backward kernel, the dW reduction and dW's cast to w's dtype, for both modes alike. Device times are
medians of ``--reps`` calls (``cake_cute.tools.bench.timing.DeviceTimer``: a spin kernel hides the
host; inputs rotate through enough sets to exceed twice the L2).

    python benchmarks/memory_bench.py results.json [--dtypes bf16,fp16,fp32] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cake_cute import cake_rmsnorm
from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for
from cake_cute.vocab import DTYPE_NAMES, torch_dtype

EPS = 1e-6
# (T, H): every call moves at least 64 MB in bf16.
SHAPES = [
    (8192, 2048),
    (16384, 2048),
    (8192, 4096),
    (16384, 4096),
    (32768, 4096),
    (8192, 8192),
    (4096, 16384),
]
MODES = {"default": False, "memory_efficient": True}


def backward_bytes(rows: int, hidden: int, element: int, residual: bool) -> int:
    return (4 if residual else 3) * rows * hidden * element + 4 * rows


class Case:
    """Rotated input sets of one (T, H, dtype, residual) and the backward of one mode over them."""

    def __init__(self, rows, hidden, dtype, residual, sets):
        def tensor():
            return torch.randn(rows, hidden, device="cuda", dtype=dtype)

        self.residual = residual
        self.w = (torch.randn(hidden, device="cuda", dtype=dtype) * 0.5 + 1).requires_grad_()
        self.sets = [self._set(tensor, residual) for _ in range(sets)]
        self.rotation = Rotation(sets)

    @staticmethod
    def _set(tensor, residual):
        """(x asking for its gradient, residual, g, g_residual); no residual tensors in plain mode."""
        extra = tensor if residual else (lambda: None)
        return tensor().requires_grad_(), extra(), tensor(), extra()

    def forward(self, memory_efficient: bool):
        """(outputs, their gradients, the inputs asking for one) of the next set's forward."""
        x, residual, g, g_residual = self.sets[self.rotation.next()]
        out = cake_rmsnorm(x, self.w, EPS, residual=residual, memory_efficient=memory_efficient)
        if self.residual:
            return list(out), [g, g_residual], [x, self.w]
        return [out], [g], [x, self.w]

    @staticmethod
    def backward(call):
        # autograd.grad, not backward: no accumulation into .grad, and retain_graph because the timer
        # runs a call again when the host was late the first time.
        outputs, grads, inputs = call
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=True)

    def time(self, timer, memory_efficient: bool, reps: int) -> float:
        for _ in range(len(self.sets)):  # compiles, caches, every set touched once
            self.backward(self.forward(memory_efficient))
        return timer.device_us(self.backward, reps, setup=lambda: self.forward(memory_efficient))


def run(dtypes, reps) -> list[dict]:
    timer = DeviceTimer(torch, torch.device("cuda"))
    timer.warm_clocks()
    rows_out = []
    for dtype in dtypes:
        element = torch.tensor([], dtype=dtype).element_size()
        for rows, hidden in SHAPES:
            for residual in (False, True):
                nbytes = backward_bytes(rows, hidden, element, residual)
                case = Case(rows, hidden, dtype, residual, buffer_sets_for(nbytes, timer.l2_bytes))
                copy_us = timer.copy_ceiling(nbytes, reps)["copy_gpu_us"]
                times = {mode: case.time(timer, on, reps) for mode, on in MODES.items()}
                row = {
                    "rows": rows,
                    "hidden": hidden,
                    "dtype": str(dtype).removeprefix("torch."),
                    "residual": residual,
                    "bytes": nbytes,
                    "copy_us": round(copy_us, 2),
                    **{f"{mode}_us": round(us, 2) for mode, us in times.items()},
                    **{f"{mode}_fraction_of_copy": round(copy_us / us, 3) for mode, us in times.items()},
                    "memory_efficient_over_default": round(times["memory_efficient"] / times["default"], 3),
                }
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                del case
                torch.cuda.empty_cache()
    return rows_out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where the JSON results go")
    parser.add_argument("--dtypes", default="bf16", help=f"comma-separated, from {', '.join(DTYPE_NAMES)}")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per median")
    args = parser.parse_args(argv)
    dtypes = [torch_dtype(name) for name in args.dtypes.split(",")]
    results = run(dtypes, args.reps)
    environment = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    args.output.write_text(json.dumps({"environment": environment, "rows": results}, indent=1) + "\n")
    print(f"wrote {len(results)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
