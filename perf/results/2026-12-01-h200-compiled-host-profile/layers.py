"""Decompose the compiled step's host cost: each layer of the custom-op path timed alone, and a
torch.profiler table of the compiled step (cake vs torch), T=16, H=4096 bf16."""
import time, statistics, sys
import torch
import cake_cute
from cake_cute import ops, cake_rmsnorm, native
from torch.profiler import profile, ProfilerActivity
H, T = 4096, 16
dev = "cuda"
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(H, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
def per_call(f, n=500):
    for _ in range(30): f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) / n * 1e6)
    return round(statistics.median(ms), 2)
cake_rmsnorm(x, w, 1e-6)  # registers the signature
xd, wd = x.detach(), w.detach()
rstd = torch.empty(T, device=dev)
with torch.no_grad():
    rows = {
      "native.forward": lambda: native.fast.forward(xd, wd, 1e-6, None, 0.0),
      "cake_rmsnorm_train_forward": lambda: ops.cake_rmsnorm_train_forward(xd, wd, 1e-6),
      "op rmsnorm_fwd (no grad)": lambda: torch.ops.cake_cute.rmsnorm_fwd(xd, wd, 1e-6, None, 0.0, True),
      "op rmsnorm_fwd.default": lambda: torch.ops.cake_cute.rmsnorm_fwd.default(xd, wd, 1e-6, None, 0.0, True),
      "F.rms_norm": lambda: torch.nn.functional.rms_norm(xd, (H,), wd, 1e-6),
      "empty_like x2": lambda: (torch.empty_like(xd), torch.empty_like(xd)),
    }
    _, r1, _ = torch.ops.cake_cute.rmsnorm_fwd(xd, wd, 1e-6, None, 0.0, True)
    rows["native.backward"] = lambda: native.fast.backward(g, xd, wd, r1, None, 0.0, torch.bfloat16, True)
    rows["op rmsnorm_bwd.default"] = lambda: torch.ops.cake_cute.rmsnorm_bwd.default(g, xd, wd, r1, None, 0.0, True)
    for k, f in rows.items():
        print(f"{k:32s} {per_call(f):8.2f} us", flush=True)
def cake(x, w): return cake_rmsnorm(x, w, 1e-6)
def ref(x, w): return torch.nn.functional.rms_norm(x, (H,), w, 1e-6)
for name, f in (("cake", cake), ("torch", ref)):
    cf = torch.compile(f, dynamic=False)
    step = lambda: torch.autograd.grad(cf(x, w), (x, w), g)
    def fwd():
        with torch.no_grad(): cf(x, w)
    print(name, "compiled step", per_call(step), "fwd", per_call(fwd), "eager step",
          per_call(lambda: torch.autograd.grad(f(x, w), (x, w), g)), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50): step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
