#!/usr/bin/env python
"""``python benchmarks/qk_launch.py OUT.json``: what one launch for the q and k norms of an attention layer
could save over the two launches a model makes today.

A launch that normalizes q and k together moves the bytes of both calls (plus a second weight of
head_dim elements) in one kernel, so its device time can at best be that of one call over their rows
together: this script times, per (tokens, q heads, kv heads, head_dim), the two calls (q's rows with
q's weight, then k's with k's) against one call over a tensor holding both sets of rows, forward alone
and forward + backward through autograd (``cake_rmsnorm``; the backward's dw is what a fused launch
would also return, two of them). Each figure is a median over input sets rotated past the L2
(``tools.bench.timing``): ``device_us`` (events behind a spin: device time, gaps between kernels
included), ``kernel_us`` (the profiler's kernel durations summed), and ``wall_us`` (from an idle GPU,
the host's dispatch included), with the device copy of the same bytes for scale.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
from pathlib import Path

import torch

from cake_cute import cake_rmsnorm
from cake_cute.tools.bench.results import git_commit
from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for

EPS = 1e-6
REPS = 30
# (q heads, kv heads): Qwen3-1.7B / -4B, Qwen3-8B / -14B; head_dim 64 (OLMo-style), 128 (Qwen3), 256 (Gemma3)
HEADS = ((16, 8), (32, 8))
HEAD_DIMS = (64, 128, 256)
TOKENS = (1024, 8192, 32768)


def _tensor(rows: int, dim: int, dtype, grad: bool):
    return torch.randn(rows, dim, device="cuda", dtype=dtype).requires_grad_(grad)


def _inputs(rows_q: int, rows_k: int, dim: int, dtype, backward: bool) -> dict:
    """One input set: q and k rows with their weights and gradients, and the same rows in one tensor."""
    return {
        "q": _tensor(rows_q, dim, dtype, backward),
        "k": _tensor(rows_k, dim, dtype, backward),
        "qk": _tensor(rows_q + rows_k, dim, dtype, backward),
        "wq": torch.rand(dim, device="cuda", dtype=dtype).add_(0.5).requires_grad_(backward),
        "wk": torch.rand(dim, device="cuda", dtype=dtype).add_(0.5).requires_grad_(backward),
        "gq": torch.randn(rows_q, dim, device="cuda", dtype=dtype),
        "gk": torch.randn(rows_k, dim, device="cuda", dtype=dtype),
        "gqk": torch.randn(rows_q + rows_k, dim, device="cuda", dtype=dtype),
    }


def _two_launches(s: dict, backward: bool):
    yq, yk = cake_rmsnorm(s["q"], s["wq"], EPS), cake_rmsnorm(s["k"], s["wk"], EPS)
    if backward:
        torch.autograd.backward([yq, yk], [s["gq"], s["gk"]])
    return yq, yk


def _one_launch(s: dict, backward: bool):
    y = cake_rmsnorm(s["qk"], s["wq"], EPS)
    if backward:
        torch.autograd.backward([y], [s["gqk"]])
    return y


def _bytes(rows: int, dim: int, itemsize: int, backward: bool) -> int:
    """Bytes a norm call moves over ``rows``: x in, y out (forward); g and x in, dx out (backward)."""
    per_op = rows * dim * itemsize
    return 2 * per_op + (3 * per_op if backward else 0)


def _times(timer: DeviceTimer, fn, sets: list[dict], backward: bool) -> dict:
    """``device_us``, ``kernel_us`` and ``wall_us`` of ``fn`` over the rotated input ``sets``."""
    rotation = Rotation(len(sets))

    def call(_):
        s = sets[rotation.next()]
        for name in ("q", "k", "qk", "wq", "wk"):
            s[name].grad = None
        return fn(s, backward)

    for _ in range(len(sets)):
        call(None)
    return {
        "device_us": round(timer.device_us(call, REPS), 3),
        "kernel_us": round(timer.kernel_us(call, REPS), 3),
        "wall_us": round(statistics.median(timer.wall_us(call, REPS)), 3),
    }


def measure(timer: DeviceTimer, tokens: int, heads: tuple[int, int], dim: int, dtype) -> list[dict]:
    """Rows for one shape: forward and forward + backward, two launches against one."""
    rows_q, rows_k = tokens * heads[0], tokens * heads[1]
    rows = []
    for backward in (False, True):
        nbytes = _bytes(rows_q + rows_k, dim, dtype.itemsize, backward)
        sets = [
            _inputs(rows_q, rows_k, dim, dtype, backward)
            for _ in range(buffer_sets_for(nbytes, timer.l2_bytes))
        ]
        copy = timer.copy_ceiling(nbytes, REPS)
        row = {
            "tokens": tokens,
            "q_heads": heads[0],
            "kv_heads": heads[1],
            "head_dim": dim,
            "dtype": str(dtype).removeprefix("torch."),
            "op": "fwd+bwd" if backward else "fwd",
            "bytes": nbytes,
            "copy_tbps": copy["copy_tbps"],
            "copy_us": round(nbytes / copy["copy_tbps"] / 1e6, 3),
            "buffer_sets": len(sets),
        }
        for name, fn in (("two", _two_launches), ("one", _one_launch)):
            row |= {f"{name}_{k}": v for k, v in _times(timer, fn, sets, backward).items()}
        row["saving_device"] = round(1 - row["one_device_us"] / row["two_device_us"], 4)
        row["saving_kernel"] = round(1 - row["one_kernel_us"] / row["two_kernel_us"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    options = parser.parse_args()
    dtype = getattr(torch, options.dtype)
    timer = DeviceTimer(torch, torch.device("cuda"))
    document = {
        "date": _dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "reps": REPS,
        "rows": [],
    }
    for dim in HEAD_DIMS:
        for heads in HEADS:
            for tokens in TOKENS:
                document["rows"] += measure(timer, tokens, heads, dim, dtype)
                options.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
