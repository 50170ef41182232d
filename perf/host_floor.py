#!/usr/bin/env python
"""``python perf/host_floor.py [--json F]``: what the host side of one call costs, ours and the floors
under it, bf16, H = 4096, T in (1, 256, 32768).

Every case is timed two ways:
* ``single_event_us``: as the sweep's ``us`` -- synchronize, CUDA event, one call, CUDA event; median;
* ``loop_perf_counter_us``: back-to-back calls timed with ``time.perf_counter`` on the host, the host
  cost per call once the GPU runs behind (equal to the device time when the GPU is the bottleneck).

The floors: the events alone, two ``torch.empty`` (the outputs any forward allocates), one native
kernel launch, torch's own fused ``F.rms_norm``, an ``autograd.Function`` that only allocates its
outputs (the least any autograd-visible op costs), the raw TVM-FFI launch of our compiled forward, and
``torch.autograd.grad`` through that trivial Function (the least any backward through the engine costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import _use_source_tree  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args(argv)
    _use_source_tree()
    import torch

    import cake_cute
    from cake_cute.compile_cache import kernel
    from cake_cute.device import device_arch
    from cake_cute.tools.bench.results import git_commit

    dev = torch.device("cuda")
    arch = device_arch(dev)

    def single(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(20):
            fn()
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
            del result
        return statistics.median(times)

    def loop(fn, n=3000):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        return elapsed / n * 1e6

    class AllocateOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y, rstd = torch.empty_like(x), torch.empty(x.shape[0], device=x.device)
            ctx.save_for_backward(x, w, rstd)
            return y

        @staticmethod
        def backward(ctx, g):
            x, w, _ = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(w)

    H = 4096

    def cases_for(T: int) -> dict:
        """The timed callables at T rows (a function, so each closure binds this T's tensors)."""
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        xd, wd = x.detach(), w.detach()
        yd, rd = cake_cute.cake_rmsnorm_train_forward(xd, wd, 1e-6)
        launch = kernel("fwd", arch, "bf16", "bf16", H, False, 0.0)
        y_trivial = AllocateOnly.apply(x, w)
        y_torch = torch.nn.functional.rms_norm(x, (H,), w, 1e-6)
        y_cake = cake_cute.cake_rmsnorm(x, w, 1e-6)
        return {
            "events only": lambda: None,
            "torch.empty x2": lambda: (torch.empty_like(xd), torch.empty(T, device=dev)),
            "torch.neg (one native kernel)": lambda: torch.neg(xd),
            "F.rms_norm, no grad": lambda: torch.nn.functional.rms_norm(xd, (H,), wd, 1e-6),
            "F.rms_norm, autograd": lambda: torch.nn.functional.rms_norm(x, (H,), w, 1e-6),
            "autograd.Function that only allocates": lambda: AllocateOnly.apply(x, w),
            "raw TVM-FFI launch of our forward": lambda: launch(xd, None, wd, yd, None, rd, 1e-6),
            "cake functional forward": lambda: cake_cute.cake_rmsnorm_train_forward(xd, wd, 1e-6),
            "cake forward through autograd": lambda: cake_cute.cake_rmsnorm(x, w, 1e-6),
            "cake functional backward": lambda: cake_cute.cake_rmsnorm_train_backward(g, xd, wd, rd),
            "autograd.grad, Function that only allocates": lambda: torch.autograd.grad(
                y_trivial, (x, w), g, retain_graph=True
            ),
            "autograd.grad, F.rms_norm": lambda: torch.autograd.grad(y_torch, (x, w), g, retain_graph=True),
            "autograd.grad, cake": lambda: torch.autograd.grad(y_cake, (x, w), g, retain_graph=True),
        }

    rows = []
    for T in (1, 256, 32768):
        cases = cases_for(T)
        for name, fn in cases.items():
            row = {
                "T": T,
                "H": H,
                "case": name,
                "single_event_us": round(single(fn), 2),
                "loop_perf_counter_us": round(loop(fn), 2),
            }
            rows.append(row)
            single_us, loop_us = row["single_event_us"], row["loop_perf_counter_us"]
            print(f"T={T:6d} {name:45s} single {single_us:8.2f}  loop {loop_us:8.2f}", flush=True)
    if args.json:
        doc = {
            "gpu": torch.cuda.get_device_name(0),
            "commit": git_commit(),
            "method": __doc__,
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
