"""Where a compiled step's host time goes (cake_cute custom ops under torch.compile), H200."""
import cProfile, pstats, time, statistics, io
import torch
import cake_cute
from cake_cute import ops, cake_rmsnorm

H, T = 4096, 16
dev = "cuda"
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(H, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, H, device=dev, dtype=torch.bfloat16)

def cake(x, w): return cake_rmsnorm(x, w, 1e-6)
def ref(x, w): return torch.nn.functional.rms_norm(x, (H,), w, 1e-6)

def per_call(f, n=300):
    for _ in range(30): f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(ms)

for name, f in (("cake", cake), ("torch", ref)):
    cf = torch.compile(f, dynamic=False)
    print(name, "eager", round(per_call(lambda: torch.autograd.grad(f(x, w), (x, w), g)), 1),
          "compiled", round(per_call(lambda: torch.autograd.grad(cf(x, w), (x, w), g)), 1), flush=True)

counts = {"fwd_python": 0, "bwd_python": 0}
orig_f, orig_b = ops.train_forward_python, ops._backward
def cf_(*a, **k): counts["fwd_python"] += 1; return orig_f(*a, **k)
def cb_(*a, **k): counts["bwd_python"] += 1; return orig_b(*a, **k)
ops.train_forward_python, ops._backward = cf_, cb_
cf = torch.compile(cake, dynamic=False)
for _ in range(20): torch.autograd.grad(cf(x, w), (x, w), g)
counts = dict.fromkeys(counts, 0)
for _ in range(100): torch.autograd.grad(cf(x, w), (x, w), g)
print("python-path calls in 100 compiled steps:", counts, "native:", cake_cute.native.fast is not None, flush=True)
ops.train_forward_python, ops._backward = orig_f, orig_b
pr = cProfile.Profile(); pr.enable()
for _ in range(200): torch.autograd.grad(cf(x, w), (x, w), g)
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(35); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20); print(s.getvalue()[:6000])
