"""Plain-mode backward with forced (stages, CTAs per SM) combos: device us via profiler; bitwise check.
argv: act H[,H..] combo... where combo is S:c (c = CTAs per SM, 0 = from the smem formula)."""

import os
import sys

import torch
from cake_cute.kernels import config

import cake_cute
from cake_cute import bench, compile_cache, dispatch, ops, validation

runner = bench._Runner(bench.parse_args(["--prof-reps", "8"]), torch)
dev = torch.device("cuda")
facts = validation.device_facts(dev)
root = os.environ["STAGES_CACHE"]


def ctas(t, arch, act, res, S, forced):
    if forced:
        return forced
    by_smem = config.SMEM_PER_SM // (
        config.backward_smem_bytes(t, act, res, S) + config.SMEM_RESERVED_PER_CTA
    )
    return max(
        1,
        min(
            by_smem,
            config.MAX_THREADS_PER_SM // t.threads_per_cta,
            config.backward_min_ctas_per_sm(t, arch),
            config.MAX_CTAS_PER_SM,
        ),
    )


act = sys.argv[1]
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[act]
combos = [tuple(map(int, c.split(":"))) for c in sys.argv[3:]]
for H in map(int, sys.argv[2].split(",")):
    T = int(os.environ.get("T", 0)) or (1 << 27) // H
    x = torch.randn(T, H, device=dev, dtype=dt)
    w = torch.randn(H, device=dev, dtype=dt)
    g = torch.randn_like(x)
    h, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
    ref = None
    t = config.backward_tiling(H, act)
    for S, forced in combos:
        dispatch.backward_stages = lambda tt, a, r, S=S: S
        dispatch.backward_ctas_per_sm = lambda tt, arch, a, r, S=S, f=forced: ctas(tt, arch, a, r, S, f)
        for f in (dispatch.backward_programs, dispatch.backward_launch, ops._backward_plan):
            f.cache_clear()
        compile_cache.clear_memory()
        os.environ["CAKE_CUTE_CACHE_DIR"] = f"{root}/S{S}"
        ws = cake_cute.cake_rmsnorm_train_backward_workspace(T, H, dev)
        fn = lambda _: cake_cute.cake_rmsnorm_train_backward(g, h, w, rstd, workspace=ws)
        try:
            out = fn(None)
            torch.cuda.synchronize()
            progs = dispatch.backward_launch(T, H, act, False, facts)[0]
            same = ""
            if ref is None:
                ref = (out, progs)
            elif ref[1] == progs:
                same = "bitwise=" + str(
                    bool(torch.equal(ref[0][0], out[0]) and torch.equal(ref[0][1], out[1]))
                )
            for _ in range(3):
                fn(None)
            torch.cuda.synchronize()
            us = runner.device_us(fn, 8)[0]
            nb = T * H * config.DTYPE_BYTES[act] * 3
            print(
                f"{act} H={H} T={T} S={S} {t.describe()} ctas/SM={ctas(t, facts.arch, act, False, S, forced)} programs={progs} us={us:.2f} TB/s={nb / us / 1e6:.3f} {same}",
                flush=True,
            )
        except Exception as e:
            print("FAILED", H, S, type(e).__name__, str(e)[:300], flush=True)
    del x, g, h, rstd, ws
