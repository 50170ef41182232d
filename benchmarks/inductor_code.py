"""The Triton code torch.compile generates for the sweep's compile peer at one head-dim shape: the
forward and the backward of the FP32 reference (``tools.bench.peers``), compiled the way the sweep
compiles it (static shapes, fullgraph), written to one text file per shape (a record, not a module), so
that its kernels can be read next to cake_cute's. The rows per program that inductor's autotuner picks at
run time are not in the code.

    python benchmarks/inductor_code.py OUT_DIR [--hidden 64] [--rows 2^16] [--dtype bf16] [--residual]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cake_cute.tools.bench.cases import parse_count_list
from cake_cute.vocab import DTYPE_NAMES, torch_dtype

EPS = 1e-6


def generated_code(torch, hidden: int, rows: int, dtype: str, residual: bool) -> list[str]:
    """The source of every module inductor wrote for one forward and backward call at (rows, H)."""
    from torch._inductor.utils import run_and_get_code

    from cake_cute.tools.bench.peers import FACTORIES

    peer = FACTORIES["compile"](torch, EPS)
    dt = torch_dtype(dtype)
    x = torch.randn(rows, hidden, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=dt, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True) if residual else None

    def step():
        out = peer.forward(x, w, r)
        torch.autograd.backward(out, [torch.randn_like(o) for o in out])

    _, code = run_and_get_code(step)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=parse_count_list, default=[64])
    p.add_argument("--rows", type=parse_count_list, default=[1 << 16])
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16")
    p.add_argument("--residual", action="store_true")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/inductor_code.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "residual" if args.residual else "plain"
    for hidden in args.hidden:
        for rows in args.rows:
            code = generated_code(torch, hidden, rows, args.dtype, args.residual)
            path = args.out / f"inductor-{args.dtype}-{mode}-H{hidden}-T{rows}.txt"
            path.write_text("\n\n# ---- next module ----\n\n".join(code))
            print(f"{path}: {len(code)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
