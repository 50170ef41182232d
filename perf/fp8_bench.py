#!/usr/bin/env python
"""``python perf/fp8_bench.py OUT.json [--grid standard,training] [--recipes mxfp8,1x128] [--dtype bf16]
[--append]``

The fused RMSNorm -> block-scaled e4m3 forward (impl ``cake_cute``) against cake's forward followed by
a separate quantize of y: torchao's MX quantizer when importable (``cake_cute+torchao``, MXFP8 only)
and a torch.compile'd quantize of y (``cake_cute+compile``, both recipes). One GPU, forward only.

Timing: each measurement is a CUDA graph of ``CALLS`` calls that cycle through enough input sets
(x, residual) to exceed the L2 several times over, so every call reads from HBM; the graph is replayed
``REPLAYS`` times between CUDA events and the per-call time is the median replay / CALLS. A device copy
(``Tensor.copy_``) of the fused op's bytes is timed the same way.

Rows: ``{impl, recipe, residual, dtype, T, H, gpu_us, bytes, tbps, frac_copy}``; ``bytes`` is always the
fused op's minimal traffic (read x [+ residual], write e4m3 data, scales, rstd [+ h_new]), so the rows
of one shape compare times directly; ``frac_copy`` = the copy's time / the row's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import cache
from pathlib import Path

import torch
from cake_cute.kernels.config import QUANT_RECIPES
from results_doc import kept_rows, write_results

from cake_cute import cake_rmsnorm_train_forward, fp8, fp8_numerics, validation
from cake_cute.vocab import DTYPE_NAMES, torch_dtype

EPS = 1e-6
CALLS = 20
REPLAYS = 15
ROTATION_BYTES = 512 << 20  # several times the H200's 50 MB L2
STANDARD = [(2**27 // h, h) for h in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)]
TRAINING = [(t, h) for t in (2048, 4096, 8192, 16384) for h in (2048, 4096, 8192)]


def fused_bytes(rows: int, hidden: int, act_bytes: int, recipe: str, residual: bool) -> int:
    """Minimal HBM traffic of the fused forward (w is read once, an L2 hit thereafter: not counted)."""
    scale_bytes = 4 if QUANT_RECIPES[recipe][1] else 1
    activations = rows * hidden * act_bytes * (3 if residual else 1)  # x [+ residual, h_new]
    return (
        activations
        + rows * hidden
        + rows * fp8_numerics.scale_blocks(hidden, recipe) * scale_bytes
        + 4 * rows
    )


def graph_us(calls) -> float:
    """Median per-call device time of ``calls`` (a list of no-argument callables) captured as one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()  # warm-up (compiles, allocator pools) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def input_sets(rows, hidden, dtype, residual):
    per_set = rows * hidden * dtype.itemsize * (2 if residual else 1)
    count = max(2, min(CALLS, -(-ROTATION_BYTES // per_set)))
    return [
        (
            torch.randn(rows, hidden, dtype=dtype, device="cuda"),
            torch.randn(rows, hidden, dtype=dtype, device="cuda") if residual else None,
        )
        for _ in range(count)
    ]


@cache
def _compiled_quantize(recipe: str):
    """One torch.compile'd quantize per recipe, shape-polymorphic (dynamic=True), so the sweep's many
    shapes neither recompile it per shape nor hit dynamo's recompile limit and fall back to eager."""
    return torch.compile(lambda y: fp8_numerics.quantize_rows_bytes(y, recipe), dynamic=True)


def _torchao_quantize():
    """torchao's MX quantizer (RCEIL scales) or None when torchao is not importable."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None
    return lambda y: to_mx(y, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)


def impls(recipe: str):
    """{impl name: f(x, w, residual)} for ``recipe``."""

    def fused(x, w, r):
        return fp8.fp8_forward(x, w, EPS, r, recipe, False, 0.0)

    def then(quantize):
        def unfused(x, w, r):
            outs = cake_rmsnorm_train_forward(x, w, EPS, residual=r)
            return quantize(outs[0]), outs[1:]

        return unfused

    found = {"cake_cute": fused, "cake_cute+compile": then(_compiled_quantize(recipe))}
    torchao = _torchao_quantize() if recipe == "mxfp8" else None
    if torchao is not None:
        found["cake_cute+torchao"] = then(torchao)
    return found


def copy_us(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dsts = [torch.empty_like(src) for _ in range(max(2, min(CALLS, -(-ROTATION_BYTES // max(1, nbytes)))))]
    return graph_us([lambda d=d: d.copy_(src) for d in dsts])


def bench_shape(recipe, residual, dtype_name, rows, hidden) -> list[dict]:
    dtype = torch_dtype(dtype_name)
    w = torch.rand(hidden, dtype=dtype, device="cuda") + 0.5
    sets = input_sets(rows, hidden, dtype, residual)
    nbytes = fused_bytes(rows, hidden, dtype.itemsize, recipe, residual)
    copy = copy_us(nbytes)
    rows_out = []
    for name, fn in impls(recipe).items():
        calls = [lambda x=x, r=r, fn=fn: fn(x, w, r) for x, r in (sets * CALLS)[:CALLS]]
        try:
            us = graph_us(calls)
        except Exception as exc:  # an impl that cannot run here is reported, not fatal
            print(f"{name} {recipe} T={rows} H={hidden}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        rows_out.append(
            dict(
                impl=name,
                recipe=recipe,
                residual=residual,
                dtype=dtype_name,
                T=rows,
                H=hidden,
                gpu_us=round(us, 3),
                bytes=nbytes,
                tbps=round(nbytes / us / 1e6, 4),
                frac_copy=round(copy / us, 4),
                copy_us=round(copy, 3),
            )
        )
        print(json.dumps(rows_out[-1]), flush=True)
    del sets
    torch.cuda.empty_cache()
    return rows_out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--grid", default="standard,training", help="standard, training or both")
    parser.add_argument("--recipes", default=",".join(fp8_numerics.RECIPES))
    parser.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)
    parser.add_argument("--append", action="store_true", help="keep the rows already in OUT (split runs)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    grids = {"standard": STANDARD, "training": TRAINING}
    shapes = [s for g in args.grid.split(",") for s in grids[g]]
    rows = []
    for recipe in args.recipes.split(","):
        validation.check_recipe(recipe)
        for residual in (False, True):
            for t, h in dict.fromkeys(shapes):
                rows += bench_shape(recipe, residual, args.dtype, t, h)
    rows = kept_rows(args.out, args.append) + rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    write_results(args.out, "perf/fp8_bench.py", device, rows, calls=CALLS, replays=REPLAYS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
