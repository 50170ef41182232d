#!/usr/bin/env python
"""``python perf/dw_modes.py [--json F]``: the backward with ``deterministic=True`` (partial rows + a
fixed-order reduction kernel) against ``deterministic=False`` (atomic dW, one launch), bf16.

For each (T, H, residual) and mode it records, with the timing primitives of ``cake-cute bench``:
* ``gpu_us``: device time of one functional call with a caller workspace (torch.profiler sum of the
  kernels the call launches), the kernels' cost alone;
* ``gpu_us_no_ws``: the same without a workspace (the atomic mode then zeroes a fresh accumulator:
  one memset more);
* ``us``: wall time of ``torch.autograd.grad`` through ``cake_rmsnorm`` (CUDA events around one call
  on an idle GPU, host work included), as in the sweep;
* ``dw_max_rel_diff``: max |dw_false - dw_true| / max |dw_true| over the runs (FP32 rounding only).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import _use_source_tree  # noqa: E402

TOKENS = (16, 256, 4096, 32768)
HIDDEN = (4096, 16384)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--hidden", default=",".join(map(str, HIDDEN)))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--prof-reps", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    _use_source_tree()
    import torch

    import cake_cute
    from cake_cute import bench

    runner = bench._Runner(bench.parse_args(["--prof-reps", str(args.prof_reps)]), torch)
    dev = torch.device("cuda")
    rows = []
    print(f"{'T':>6} {'H':>6} {'res':>3} {'mode':>13} {'gpu_us':>8} {'no_ws':>8} {'us':>8} {'dw diff':>9}")
    for H in map(int, args.hidden.split(",")):
        for T in map(int, args.tokens.split(",")):
            for residual in (False, True):
                x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
                w = (torch.randn(H, device=dev) * 0.5 + 1).to(torch.bfloat16)
                g = torch.randn_like(x)
                gr = torch.randn_like(x) if residual else None
                h, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
                ws = cake_cute.cake_rmsnorm_train_backward_workspace(T, H, dev, residual=residual)
                reference = cake_cute.cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=gr)[1]
                for deterministic in (True, False):
                    def functional(_, workspace=ws, deterministic=deterministic):
                        return cake_cute.cake_rmsnorm_train_backward(
                            g, h, w, rstd, g_residual=gr, workspace=workspace, deterministic=deterministic)

                    def no_workspace(_, deterministic=deterministic):
                        return cake_cute.cake_rmsnorm_train_backward(
                            g, h, w, rstd, g_residual=gr, deterministic=deterministic)

                    diffs = []
                    for _ in range(5):
                        dw = functional(None)[1]
                        diffs.append(((dw - reference).abs().max() / reference.abs().max()).item())
                    xa = x.clone().requires_grad_()
                    wa = w.clone().requires_grad_()
                    ra = torch.randn_like(x).requires_grad_() if residual else None
                    outs = cake_cute.cake_rmsnorm(xa, wa, 1e-6, residual=ra, deterministic=deterministic)
                    outs = outs if residual else (outs,)
                    grads = (g, gr) if residual else (g,)
                    inputs = (xa, wa, ra) if residual else (xa, wa)

                    def autograd_call(_, outs=outs, inputs=inputs, grads=grads):
                        return torch.autograd.grad(outs, inputs, grad_outputs=grads, retain_graph=True)

                    for fn in (functional, no_workspace, autograd_call):
                        for _ in range(5):
                            fn(None)
                    torch.cuda.synchronize()
                    row = {
                        "T": T, "H": H, "residual": residual, "dtype": "bf16", "deterministic": deterministic,
                        "gpu_us": round(runner.device_us(functional, args.prof_reps)[0], 3),
                        "gpu_us_no_ws": round(runner.device_us(no_workspace, args.prof_reps)[0], 3),
                        "us": round(statistics.median(runner.time_us(autograd_call, args.reps)), 3),
                        "dw_max_rel_diff": max(diffs),
                    }
                    rows.append(row)
                    mode = "deterministic" if deterministic else "atomic"
                    print(f"{T:>6} {H:>6} {'on' if residual else 'off':>3} {mode:>13} {row['gpu_us']:>8.2f} "
                          f"{row['gpu_us_no_ws']:>8.2f} {row['us']:>8.2f} {row['dw_max_rel_diff']:>9.2e}", flush=True)
                del x, w, g, gr, h, rstd, ws, outs, inputs, xa, wa, ra
    doc = {"gpu": torch.cuda.get_device_name(0), "commit": bench.git_commit(), "date": _dt.date.today().isoformat(),
           "method": __doc__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
