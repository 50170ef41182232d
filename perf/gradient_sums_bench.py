#!/usr/bin/env python
"""``python perf/gradient_sums_bench.py OUT.json``: the backward of a gradient given as 2-3 summands
(``cake_rmsnorm_train_backward([g0, g1, g2], ...)``, what ``cake_cute.graph_passes`` compiles to)
against what a compiled graph runs without the pass: inductor's fused add of the summands, then the
one-g backward. bf16, T in (2048, 8192), H in (2048, 4096, 8192), plain and residual, one process.

Device time per call as the sweep measures it (``DeviceTimer.device_us``: events around the call behind
a spin kernel, so no host time; the median; inputs rotated through enough sets that none is
L2-resident), with the same bytes checked bitwise first: dx and dw of both ways must be
equal. Rows: ``{impl: "parts" | "add+bwd", parts, residual, T, H, gpu_us, bytes, tbps}``; bytes count
what each way must move at least (parts: n summands + h (+ g_residual) read, dx written; add+bwd: the
add reads n and writes one, the backward reads g and h (+ g_residual) and writes dx).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402


def measure(tokens: int, hidden: int, parts: int, residual: bool, compiled_sum, reps: int) -> list[dict]:
    from cake_cute import cake_rmsnorm_train_backward
    from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for

    def rand(*shape):
        return torch.randn(*shape, device="cuda").to(torch.bfloat16)

    element = 2 * tokens * hidden
    extra = element if residual else 0
    timer = DeviceTimer(torch, torch.device("cuda"))
    sets = buffer_sets_for((parts + 2) * element + extra, timer.l2_bytes)
    inputs = [
        (
            [rand(tokens, hidden) for _ in range(parts)],
            rand(tokens, hidden),
            rand(tokens, hidden) if residual else None,
        )
        for _ in range(sets)
    ]
    w, rstd = rand(hidden), torch.rand(tokens, device="cuda") + 0.5

    def folded(index):
        summands, h, g_res = inputs[index]
        return cake_rmsnorm_train_backward(summands, h, w, rstd, g_residual=g_res)

    def unfolded(index):
        summands, h, g_res = inputs[index]
        return cake_rmsnorm_train_backward(compiled_sum(summands), h, w, rstd, g_residual=g_res)

    for a, b in zip(folded(0), unfolded(0)):
        if not torch.equal(a, b):
            raise AssertionError(f"T={tokens} H={hidden} parts={parts} residual={residual}: results differ")
    rows = []
    for impl, fn, nbytes in (
        ("parts", folded, (parts + 2) * element + extra),
        ("add+bwd", unfolded, (parts + 1) * element + 3 * element + extra),
    ):
        rotation = Rotation(sets)
        timer.device_us(fn, 3, rotation.next)  # warm-up
        us = timer.device_us(fn, reps, rotation.next)
        row = dict(impl=impl, parts=parts, residual=residual, T=tokens, H=hidden)
        rows.append({**row, "gpu_us": round(us, 2), "bytes": nbytes, "tbps": round(nbytes / us / 1e6, 3)})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[2048, 8192])
    p.add_argument("--hidden", type=lambda s: [int(h) for h in s.split(",")], default=[2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    _use_source_tree()
    from cake_cute.reference import summed_gradient

    # inductor's fused add of the summands (FP32 from the left, rounded once), one graph per count
    compiled_sum = torch.compile(summed_gradient, dynamic=True)
    rows = [
        row
        for tokens in args.tokens
        for hidden in args.hidden
        for parts in (2, 3)
        for residual in (False, True)
        for row in measure(tokens, hidden, parts, residual, compiled_sum, args.reps)
    ]
    write_results(args.out, "perf/gradient_sums_bench.py", torch.cuda.get_device_name(), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
