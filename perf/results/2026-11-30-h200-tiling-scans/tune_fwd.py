"""Try forward tilings for one H (device time via profiler). args: H tpr,vpt,rows ..."""

import os
import sys
from dataclasses import replace

import torch
from cake_cute.kernels import config

import cake_cute
from cake_cute import bench, compile_cache, dispatch

runner = bench._Runner(bench.parse_args(["--prof-reps", "8"]), torch)
dev = torch.device("cuda")
H = int(sys.argv[1])
act = "bf16"
base = config.forward_tiling(H, act)
variants = [base] + [
    replace(base, threads_per_row=a, vecs_per_thread=b, rows_per_cta=c)
    for a, b, c in (map(int, s.split(",")) for s in sys.argv[2:])
]
T = (1 << 27) // H
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
w = torch.randn(H, device=dev, dtype=torch.bfloat16)
r = torch.randn_like(x)
for res in (False, True):
    for tiling in variants:
        dispatch.forward_tiling = lambda hh, a, t=tiling: t
        compile_cache.clear_memory()
        os.environ["CAKE_CUTE_CACHE_DIR"] = f"/tmp/tunef/{tiling.describe().replace(' ', '_')}"
        fn = lambda _: cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6, residual=r if res else None)
        try:
            for _ in range(3):
                fn(None)
            torch.cuda.synchronize()
            us = runner.device_us(fn, 8)[0]
            nb = T * H * 2 * (4 if res else 2) + T * 4 + H * 2
            print(f"fwd H={H} res={res} {tiling.describe()} us={us:.1f} TB/s={nb / us / 1e6:.3f}", flush=True)
        except Exception as e:
            print("FAILED", tiling.describe(), type(e).__name__, str(e)[:300], flush=True)
