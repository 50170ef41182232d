"""Try backward tilings / register budgets for one H (device time via profiler)."""

import os
import sys
from dataclasses import replace

import torch
from cake_cute.kernels import config

import cake_cute
from cake_cute import bench, compile_cache, dispatch, ops

runner = bench._Runner(bench.parse_args(["--prof-reps", "8"]), torch)
dev = torch.device("cuda")
H = int(sys.argv[1])
act = "bf16"
base = config.backward_tiling(H, act)
orig_budget = config.backward_register_budget
variants = [(base, None)]
for spec in sys.argv[2:]:
    tpr, vpt, rows, budget = map(int, spec.split(","))
    variants.append((replace(base, threads_per_row=tpr, vecs_per_thread=vpt, rows_per_cta=rows), budget))
T = (1 << 27) // H
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
w = torch.randn(H, device=dev, dtype=torch.bfloat16)
g = torch.randn_like(x)
h, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
for res in (False, True):
    gr = torch.randn_like(x) if res else None
    for tiling, budget in variants:
        dispatch.backward_tiling = lambda hh, a, t=tiling: t
        config.backward_register_budget = (lambda t, arch, b=budget: b) if budget else orig_budget
        for f in (dispatch.backward_programs, dispatch.backward_launch, ops._backward_plan):
            f.cache_clear()
        compile_cache.clear_memory()
        orig_get = compile_cache.get_kernel
        fn = lambda _: cake_cute.cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=gr)
        try:
            compile_cache._memory.clear()
            ws = None
            os.environ["CAKE_CUTE_CACHE_DIR"] = f"/tmp/tune/{tiling.describe().replace(' ', '_')}_{budget}"
            for _ in range(3):
                fn(None)
            torch.cuda.synchronize()
            us = runner.device_us(fn, 8)[0]
            nb = T * H * 2 * (4 if res else 3)
            progs = dispatch.backward_launch(T, H, act, res, cake_cute.validation.device_facts(dev))
            print(
                f"H={H} res={res} {tiling.describe()} budget={budget} programs={progs} us={us:.1f} TB/s={nb / us / 1e6:.3f}",
                flush=True,
            )
        except Exception as e:
            print("FAILED", tiling.describe(), budget, type(e).__name__, str(e)[:300], flush=True)
