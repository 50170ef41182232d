"""Small T: device time of the backward (both modes) for forced program counts."""

import sys

import torch
from cake_cute.kernels.config import backward_tiling

import cake_cute
from cake_cute import bench, dispatch, ops

runner = bench._Runner(bench.parse_args(["--prof-reps", "10"]), torch)
dev = torch.device("cuda")
orig = dispatch.backward_launch
H = int(sys.argv[1])
for T in map(int, sys.argv[2].split(",")):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(H, device=dev, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    h, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
    rpc = backward_tiling(H, "bf16").rows_per_cta
    default = orig(T, H, "bf16", False, cake_cute.validation.device_facts(dev))[0]
    for P in sorted(
        {default, max(1, default // 2), max(1, default // 4), max(1, default // 8), max(1, default // 16)},
        reverse=True,
    ):
        dispatch.backward_launch = lambda r, hh, a, res, f, P=P: (P, P * rpc)
        ops._backward_plan.cache_clear()
        out = []
        for det in (True, False):
            ws = cake_cute.cake_rmsnorm_train_backward_workspace(T, H, dev)
            fn = lambda _: cake_cute.cake_rmsnorm_train_backward(
                g, h, w, rstd, workspace=ws, deterministic=det
            )
            for _ in range(5):
                fn(None)
            torch.cuda.synchronize()
            out.append(runner.device_us(fn, 10)[0])
        print(f"H={H} T={T} programs={P} det={out[0]:.2f} atomic={out[1]:.2f}", flush=True)
    dispatch.backward_launch = orig
    ops._backward_plan.cache_clear()
