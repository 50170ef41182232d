"""The re-reading gated backward at ring depths 0 (the L2 re-read), 2 and 3, at 11ada5b (whose
``gated_config.REREAD_RING_DEPTH`` it sets): every depth's dx, dz and dw against depth 0's bitwise, then
the backward's device time as a fraction of a copy (``benchmarks/gated_bench.py``'s method), the depths
interleaved. Run from the project root on a GPU with ``OUT`` set; writes ``$OUT/ring_ab.json``."""

import json
import os
import sys

import torch

from cake_cute import compile_cache
from cake_cute.gated_ops import gated_rmsnorm_backward, gated_rmsnorm_forward
from cake_cute.kernels import gated_config
from cake_cute.tools.bench.timing import DeviceTimer, buffer_sets_for
from cake_cute.vocab import dtype_name

sys.path.insert(0, "benchmarks")
import gated_bench  # noqa: E402

CHECKED = (
    (129, 8192, 8192, False),
    (1000, 16384, 8192, False),
    (77, 8192, 8192, True),
    (3, 6144, 6144, True),
)
TIMED = ((8192, 8192, 8192), (16384, 8192, 8192), (4096, 65536, 8192))


def set_depth(depth: int) -> None:
    gated_config.REREAD_RING_DEPTH = depth
    gated_config.gated_backward_config.cache_clear()
    compile_cache.clear_memory()


def backward_outputs(rows, hidden, group, dtype, norm_before_gate):
    torch.manual_seed(0)
    x, z, g = (torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(3))
    w = torch.randn(hidden, device="cuda", dtype=dtype) * 0.5 + 1
    options = dict(group_size=group, norm_before_gate=norm_before_gate)
    _, rstd = gated_rmsnorm_forward(x, z, w, 1e-6, **options)
    return gated_rmsnorm_backward(g, x, z, w, rstd, **options)


def checks() -> list[dict]:
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, hidden, group, norm_before_gate in CHECKED:
            set_depth(0)
            reference = backward_outputs(rows, hidden, group, dtype, norm_before_gate)
            for depth in (2, 3):
                set_depth(depth)
                got = backward_outputs(rows, hidden, group, dtype, norm_before_gate)
                config = gated_config.gated_backward_config(dtype_name(dtype), hidden, group)
                out.append(
                    dict(check="bitwise vs depth 0", dtype=str(dtype), rows=rows, hidden=hidden, group=group,
                         nbg=norm_before_gate, depth=depth, config=config.describe(),
                         equal=all(torch.equal(a, b) for a, b in zip(reference, got)))
                )  # fmt: skip
                print(json.dumps(out[-1]), flush=True)
    return out


def timings() -> list[dict]:
    timer = DeviceTimer(torch, torch.device("cuda"))
    out = []
    for rows, hidden, group in TIMED:
        inputs = gated_bench._sets(
            rows, hidden, torch.bfloat16, buffer_sets_for(6 * rows * hidden, timer.l2_bytes)
        )
        copy = timer.copy_ceiling(gated_bench.nbytes("backward", rows, hidden, group, 2), 20)["copy_gpu_us"]
        for depth in (0, 3, 2, 0, 3):
            set_depth(depth)
            cake = gated_bench.Cake(hidden, group, False, torch.bfloat16)
            us = gated_bench.time_impl(timer, cake, inputs, 20)["backward"]
            out.append(dict(rows=rows, hidden=hidden, group=group, depth=depth, bwd_us=round(us, 2),
                            copy_us=round(copy, 2), fraction=round(copy / us, 3)))  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    results = checks() + timings()
    with open(os.path.join(os.environ["OUT"], "ring_ab.json"), "w") as f:
        f.write(json.dumps(results, indent=1))
