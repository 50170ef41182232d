"""One call of one implementation under Nsight Compute: ``python benchmarks/ncu_call.py IMPL OP DTYPE H T
RESIDUAL`` (IMPL a name of ``cake_cute.tools.bench.peers.FACTORIES``, OP fwd or bwd, RESIDUAL 0 or 1). Warm-up
calls (compiles included) run first; only the profiled call lies between ``cudaProfilerStart`` and
``cudaProfilerStop``, so ``ncu --profile-from-start off`` sees its kernels alone (the backward's: the forward
runs before the range)."""

import sys

import torch

from cake_cute.tools.bench.peers import FACTORIES

impl_name, op, dtype_name, hidden, rows, residual = sys.argv[1:7]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
hidden, rows, residual = int(hidden), int(rows), residual == "1"
impl = FACTORIES[impl_name](torch, 1e-6)


def leaves():
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True) if residual else None
    w = torch.rand(hidden, device="cuda", dtype=dtype).add_(0.5).requires_grad_()
    return x, w, r


def one_call(profiled: bool) -> None:
    x, w, r = leaves()
    grads = [torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(2 if residual else 1)]
    if op == "fwd":  # with autograd recording, as the sweep times it
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.profiler.start()
        impl.forward(x, w, r)
    else:
        outs = impl.forward(x, w, r)
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.profiler.start()
        torch.autograd.backward(outs, grads[: len(outs)])
    torch.cuda.synchronize()
    if profiled:
        torch.cuda.profiler.stop()


for _ in range(3):
    one_call(False)
one_call(True)
