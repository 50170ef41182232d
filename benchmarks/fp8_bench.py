#!/usr/bin/env python
"""``python benchmarks/fp8_bench.py OUT.json [--grid standard,training] [--hidden H,...]
[--recipes mxfp8,1x128] [--dtype bf16] [--impls cake_cute,cake_cute+compile,cake_cute+torchao] [--check]
[--tilings H=TPR,VPT,CLUSTER[,ROWS] ...] [--choices [H:]CHOICE=VALUE[,CHOICE=VALUE] ...] [--reps N]
[--append]``

The fused RMSNorm -> block-scaled e4m3 forward (impl ``cake_cute``) against cake's forward followed by
a separate quantize of y: torchao's MX quantizer when importable (``cake_cute+torchao``, MXFP8 only)
and a torch.compile'd quantize of y (``cake_cute+compile``, both recipes). One GPU, forward only.

``--check`` first compares the fused op's output bytes with the torch reference (``fp8_numerics``, fed
the kernel's own rstd; rstd itself against FP64) at a few shapes per dtype, recipe, mode and y output,
wide rows and every ``--tilings`` candidate included, on weights spanning 2^-130 .. 2^100 (fp16:
2^-24 .. 2^15) so that the scales cover the E8M0 range, with an all-zero row and rows holding an
infinity and a NaN. Any mismatch stops the run (exit 1) before anything is timed.

``--hidden``: only the grids' shapes of these H (say, the variants a kernel change touched).

``--tilings``: candidate tilings of the quantizing forward (rows per CTA 1 unless given), and
``--choices``: candidate values of its other config choices (``config.CHOICES["quant"]``:
``min_ctas_per_sm`` (a register hint), ``amax_scatter``; integers or true/false), for the
shapes of one H or, without ``H:``, every shape; each candidate is timed at its shapes in the selected
grids, in both modes, next to the default through ``config.overridden("quant", ...)``, and with
``--check`` checked at the check shapes of its H (every H of the dtype without one). Candidate rows
carry ``candidate: true``; their config text names what differs. Candidates compile in this process,
one after another.

Timing (``cake_cute.tools.bench.timing``, the sweep's method): the device time of one call, a spin
kernel holding the stream while the host queues it, median of ``--reps`` calls. The calls rotate
through ``buffer_sets_for(bytes)`` input sets; each set keeps its outputs until its next turn and
drops them just before it (``rotating_call``), so writes rotate over as many buffers as reads and
neither is L2-resident. The copy ceiling is ``DeviceTimer.copy_ceiling`` of the fused op's bytes:
the same bytes read and written, with the same rotation of sources and destinations, timed the same
way (the faster of cudaMemcpy and a copy kernel).

Rows: ``{impl, recipe, residual, dtype, T, H, config, gpu_us, bytes, tbps, frac_copy, copy_gpu_us,
buffer_sets}``; ``bytes`` is always the fused op's minimal traffic (read x [+ residual], write e4m3
data, scales, rstd [+ h_new]), so the rows of one shape compare times directly; ``frac_copy`` = the
copy's time / the row's time.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from contextlib import nullcontext
from dataclasses import replace
from functools import cache
from pathlib import Path

import torch
from results_doc import kept_rows, write_results

from cake_cute import cake_rmsnorm_fp8, cake_rmsnorm_train_forward, fp8, fp8_numerics, validation
from cake_cute.calls import fp8_call
from cake_cute.kernels.config import CHOICES, overridden
from cake_cute.kernels.quant_config import QUANT_RECIPES, quant_forward_config
from cake_cute.reference import forward_reference
from cake_cute.runtime import launch_plan
from cake_cute.runtime.device import device_arch, device_facts
from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for
from cake_cute.vocab import DTYPE_NAMES, torch_dtype

EPS = 1e-6
STANDARD = [(2**27 // h, h) for h in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)]
TRAINING = [(t, h) for t in (2048, 4096, 8192, 16384) for h in (2048, 4096, 8192)]
IMPLS = ("cake_cute", "cake_cute+compile", "cake_cute+torchao")
CHECK_SHAPES = {  # (T, H) per dtype: narrow, ragged, one-CTA and cluster rows, a 2-element vector
    "bf16": [(257, 4096), (129, 4097), (64, 12288), (33, 16384), (17, 32768), (9, 65536), (5, 131072)]
    + [(65, 16386)],
    "fp16": [(257, 4096), (33, 16384)],
    "fp32": [(257, 4096), (33, 16384), (9, 65536)],
}
WEIGHT_EXPONENTS = {"fp16": (-24.0, 15.0)}  # fp16's range; bf16 and fp32 take the default below
DEFAULT_WEIGHT_EXPONENTS = (-130.0, 100.0)


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


def rotating_call(fn, sets: list[tuple]):
    """``call(_)`` for ``DeviceTimer``: ``fn(*sets[k])`` for the next set k of a ``Rotation``. Set k's
    outputs are kept until its next turn and dropped just before it, so each call writes where the
    set's last call wrote, ``len(sets) - 1`` calls ago, as the copy ceiling's destinations rotate."""
    rotation = Rotation(len(sets))
    kept = [None] * len(sets)

    def call(_):
        k = rotation.next()
        kept[k] = None
        kept[k] = fn(*sets[k])

    return call


def parse_tiling(text: str, dtype: str, arch: str):
    """``H=TPR,VPT,CLUSTER[,ROWS]`` -> (H, a RowTiling): the default quant tiling of H with those
    choices (ROWS: rows per CTA, 1 if not given)."""
    hidden, _, choices = text.partition("=")
    try:
        tpr, vpt, cluster, *rows = (int(v) for v in choices.split(","))
        hidden = int(hidden)
        if len(rows) > 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"a tiling is H=TPR,VPT,CLUSTER[,ROWS] (e.g. 16384=512,4,1), got {text!r}") from None
    default = quant_forward_config(arch, dtype, hidden, "mxfp8").tiling
    tiling = replace(
        default,
        threads_per_row=tpr,
        vecs_per_thread=vpt,
        cluster_n=cluster,
        rows_per_cta=rows[0] if rows else 1,
    )
    if tpr * vpt * cluster * tiling.vec < hidden:
        raise ValueError(f"{text}: {tpr} x {vpt} x {cluster} vectors of {tiling.vec} do not cover H")
    return hidden, tiling


def parse_choices(text: str) -> tuple[int | None, dict]:
    """``[H:]CHOICE=VALUE[,CHOICE=VALUE ...]`` -> (H or None for every H, the override choices); values
    are integers or true/false, choices those of ``config.CHOICES["quant"]`` but the tiling."""
    where, _, items = text.rpartition(":")
    choices = {}
    try:
        hidden = int(where) if where else None
        for item in items.split(","):
            name, _, value = item.partition("=")
            if name not in CHOICES["quant"] or name == "tiling":
                raise ValueError
            choices[name] = value == "true" if value in ("true", "false") else int(value)
    except ValueError:
        raise ValueError(
            f"choices are [H:]CHOICE=VALUE[,...] (e.g. 65536:amax_scatter=false,min_ctas_per_sm=4) of "
            f"{', '.join(c for c in CHOICES['quant'] if c != 'tiling')}, got {text!r}"
        ) from None
    return hidden, choices


def applies(hidden: int | None, shape_hidden: int) -> bool:
    return hidden is None or hidden == shape_hidden


def quant_choices(arch: str, dtype: str, hidden: int, choices: dict | None):
    """A context in which the quantizing forward of H uses ``choices`` (``config.overridden``'s, e.g.
    ``tiling=``; None: its default config)."""
    return nullcontext() if not choices else overridden("quant", arch, dtype, hidden, **choices)


def config_text(arch: str, dtype: str, hidden: int, recipe: str, rows: int, residual: bool) -> str:
    """The config of the quantizing forward that runs ``rows`` rows on this GPU: its tiling, its
    register hint where one is set, ``no-scatter`` where its amax reduce-scatter is off, and
    ``persistent N/SM`` where persistent programs run it (``launch_plan.fp8_forward_programs``)."""
    facts = device_facts(torch.device("cuda"))
    persistent = launch_plan.fp8_forward_programs(rows, hidden, dtype, residual, facts) > 0
    config = quant_forward_config(arch, dtype, hidden, recipe, persistent)
    hint = f" min_ctas/SM={config.min_ctas_per_sm}" if config.min_ctas_per_sm else ""
    programs = f" persistent {config.programs_per_sm}/SM" if persistent else ""
    return config.tiling.describe() + hint + ("" if config.amax_scatter else " no-scatter") + programs


# ---------------------------------------------------------------------------------------------- check


def _check_inputs(rows: int, hidden: int, dtype: str, residual: bool):
    """x of rows of very different magnitudes (an all-zero row, one with an infinity, one with a
    NaN), w spanning the dtype's exponent range along H, and a residual."""
    act = torch_dtype(dtype)
    magnitude = torch.logspace(-8, 8, rows, base=2.0, device="cuda").reshape(rows, 1)
    x = (torch.randn(rows, hidden, device="cuda") * magnitude).to(act)
    x[1] = 0
    x[2, hidden // 3] = float("inf")
    x[3, hidden // 2] = float("nan")
    low, high = WEIGHT_EXPONENTS.get(dtype, DEFAULT_WEIGHT_EXPONENTS)
    w = torch.exp2(torch.linspace(low, high, hidden, device="cuda")).to(act)
    r = torch.randn(rows, hidden, device="cuda", dtype=act) if residual else None
    return x, w, r


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any two NaNs match (the hardware's and torch's NaN payloads may
    differ); e4m3 data goes through ``fp8_numerics.canonical_nan_bytes`` instead."""
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and torch.equal(
        a.view(torch.uint8).reshape(a.shape + (-1,))[~nan], b.view(torch.uint8).reshape(b.shape + (-1,))[~nan]
    )


def check_case(dtype: str, recipe: str, residual: bool, emit_y: bool, rows: int, hidden: int) -> list[str]:
    """What differs between the fused op and the reference at one case (empty when nothing)."""
    x, w, r = _check_inputs(rows, hidden, dtype, residual)
    out = cake_rmsnorm_fp8(x, w, EPS, residual=r, recipe=recipe, emit_y=emit_y)
    h = x if r is None else (x.float() + r.float()).to(x.dtype)
    wrong = []
    if r is not None and not same_bits(out.h_new, h):
        wrong.append("h_new")
    _, rstd64, _ = forward_reference(h, w, EPS)
    rstd64 = rstd64.reshape(-1)
    finite = torch.isfinite(rstd64)
    if not torch.allclose(out.rstd[finite].double(), rstd64[finite], rtol=1e-5, atol=0):
        wrong.append("rstd")
    data, scales, y, _, _ = fp8_numerics.rmsnorm_fp8_reference(h, w, EPS, None, recipe, emit_y, rstd=out.rstd)
    if not torch.equal(fp8_numerics.canonical_nan_bytes(out.data), fp8_numerics.canonical_nan_bytes(data)):
        wrong.append("data")
    if not same_bits(out.scales, scales):
        wrong.append("scales")
    if emit_y and not same_bits(out.y, y):
        wrong.append("y")
    return wrong


def check(recipes, tilings, choices, args) -> int:
    """Every check case, under the default configs, then under each candidate tiling and each
    candidate of ``--choices`` at the check shapes of its H (in ``args.dtype``); prints one line per
    failing case and a summary; returns the number of failures."""
    cases = [
        (dtype, recipe, residual, emit_y, rows, hidden, None)
        for dtype, shapes in CHECK_SHAPES.items()
        for rows, hidden in shapes
        for recipe in recipes
        for residual in (False, True)
        for emit_y in (False, True)
    ]
    cases += [
        (args.dtype, recipe, residual, False, 33, hidden, {"tiling": tiling})
        for hidden, tiling in tilings
        for recipe in recipes
        for residual in (False, True)
    ]
    cases += [
        (args.dtype, recipe, residual, False, rows, hidden, candidate)
        for only, candidate in choices
        for rows, hidden in CHECK_SHAPES[args.dtype]
        if applies(only, hidden)
        for recipe in recipes
        for residual in (False, True)
    ]
    failures = 0
    for dtype, recipe, residual, emit_y, rows, hidden, choices in cases:
        with quant_choices(args.arch, dtype, hidden, choices):
            wrong = check_case(dtype, recipe, residual, emit_y, rows, hidden)
            config = config_text(args.arch, dtype, hidden, recipe, rows, residual)
        if wrong:
            failures += 1
            print(
                f"CHECK FAILED {dtype} {recipe} residual={residual} emit_y={emit_y} T={rows} H={hidden} "
                f"[{config}]: {', '.join(wrong)}",
                flush=True,
            )
    print(f"check: {len(cases) - failures} of {len(cases)} cases bitwise equal to the reference", flush=True)
    return failures


# --------------------------------------------------------------------------------------------- timing


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


def impls(recipe: str, names) -> dict:
    """{impl name: f(x, w, residual)} for ``recipe``, of those in ``names`` that can run."""

    def fused(x, w, r):
        return fp8.fp8_forward(fp8_call(x, w, EPS, r, recipe, False, 0.0, on_gpu=True))

    def then(quantize):
        def unfused(x, w, r):
            outs = cake_rmsnorm_train_forward(x, w, EPS, residual=r)
            return quantize(outs[0]), outs[1:]

        return unfused

    found = {"cake_cute": fused}
    if "cake_cute+compile" in names:
        found["cake_cute+compile"] = then(_compiled_quantize(recipe))
    torchao = _torchao_quantize() if recipe == "mxfp8" and "cake_cute+torchao" in names else None
    if torchao is not None:
        found["cake_cute+torchao"] = then(torchao)
    return {name: fn for name, fn in found.items() if name in names}


def bench_shape(timer, args, recipe, residual, rows, hidden, candidates) -> list[dict]:
    """The rows of one shape: every impl under the default config, then the fused op under each
    candidate (``config.overridden`` choices of this H); one copy ceiling for all of them."""
    arch, dtype = args.arch, torch_dtype(args.dtype)
    nbytes = fused_bytes(rows, hidden, dtype.itemsize, recipe, residual)
    copy = timer.copy_ceiling(nbytes, args.reps)
    w = torch.rand(hidden, dtype=dtype, device="cuda") + 0.5
    sets = [
        (
            torch.randn(rows, hidden, dtype=dtype, device="cuda"),
            w,
            torch.randn(rows, hidden, dtype=dtype, device="cuda") if residual else None,
        )
        for _ in range(buffer_sets_for(nbytes, timer.l2_bytes))
    ]
    runs = [(name, fn, None) for name, fn in impls(recipe, args.impls).items()]
    if "cake_cute" in args.impls:
        runs += [("cake_cute", impls(recipe, ("cake_cute",))["cake_cute"], c) for c in candidates]
    out = []
    for name, fn, choices in runs:
        with quant_choices(arch, args.dtype, hidden, choices):
            config = config_text(arch, args.dtype, hidden, recipe, rows, residual)
            call = rotating_call(fn, sets)
            try:
                for _ in range(len(sets) + 2):  # compiles, then every set once
                    call(None)
                us = timer.device_us(call, args.reps)
            except Exception as exc:  # an impl that cannot run here is reported, not fatal
                print(f"{name} {recipe} T={rows} H={hidden}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            del call
        row = dict(impl=name, recipe=recipe, residual=residual, dtype=args.dtype, T=rows, H=hidden)
        row.update(config=config if name == "cake_cute" else None, gpu_us=round(us, 3), bytes=nbytes)
        row.update(tbps=round(nbytes / us / 1e6, 4), frac_copy=round(copy["copy_gpu_us"] / us, 4))
        row.update(copy_gpu_us=copy["copy_gpu_us"], buffer_sets=len(sets))
        if choices is not None:
            row["candidate"] = True
        out.append(row)
    del sets
    torch.cuda.empty_cache()
    return out


def prewarm(args, recipes, shapes) -> None:
    """Compile the default variants the run needs in parallel worker processes (candidate tilings,
    which live in this process's override table, compile in-process on their first call)."""
    from cake_cute.tools.warmup import variant_specs, warm

    arch = [args.arch]
    timed = sorted({h for _, h in shapes})
    specs = fp8.fp8_variant_specs(arch, [args.dtype], timed, recipes=recipes, emit_ys=(False,))
    specs += variant_specs(arch, [args.dtype], timed)
    if args.check:
        for dtype, check_shapes in CHECK_SHAPES.items():
            specs += fp8.fp8_variant_specs(
                arch, [dtype], sorted({h for _, h in check_shapes}), recipes=recipes
            )
    result = warm(list(dict.fromkeys(specs)), jobs=os.cpu_count(), progress=io.StringIO())
    for outcome in result.failed:
        print(f"warmup failed: {outcome.spec.name()}: {outcome.error}", file=sys.stderr)
    print(result.summary(), flush=True)


def print_table(rows: list[dict]) -> None:
    """One line per row, then how many of the fused op's default rows reach 0.9 of the copy."""
    head = ("impl", "recipe", "res", "T", "H", "us", "copy us", "frac")
    print("\n{:18} {:6} {:>3} {:>6} {:>6} {:>8} {:>8} {:>6}  config".format(*head))
    for r in rows:
        config = (r["config"] or "") + (" (candidate)" if "candidate" in r else "")
        cells = (r["impl"], r["recipe"], "res" if r["residual"] else "-", r["T"], r["H"])
        cells += (r["gpu_us"], r["copy_gpu_us"], r["frac_copy"], config)
        print("{:18} {:6} {:>3} {:>6} {:>6} {:>8.2f} {:>8.2f} {:>6.3f}  {}".format(*cells))
    fused = [r for r in rows if r["impl"] == "cake_cute" and "candidate" not in r]
    reached = sum(r["frac_copy"] >= 0.9 for r in fused)
    print(f"cake_cute at >= 0.9 of the copy: {reached} of {len(fused)} rows", flush=True)
    for tokens, hidden, config, us in fastest_configs(rows):
        print(
            f"T={tokens} H={hidden}: fastest config over every recipe and mode: {config} ({us:.1f} us in all)"
        )


def fastest_configs(rows: list[dict]) -> list[tuple[int, int, str, float]]:
    """Per shape (T, H) with candidate rows: the fused op's config of least total time over the
    (recipe, mode) cases every config of that shape was timed in, and that total."""
    times: dict[tuple, dict[str, dict[tuple, float]]] = {}
    candidates = {(r["T"], r["H"]) for r in rows if "candidate" in r}
    for r in rows:
        if r["impl"] == "cake_cute" and (r["T"], r["H"]) in candidates:
            case = (r["recipe"], r["residual"])
            times.setdefault((r["T"], r["H"]), {}).setdefault(r["config"], {})[case] = r["gpu_us"]
    fastest = []
    for (tokens, hidden), per_config in sorted(times.items()):
        common = set.intersection(*(set(cases) for cases in per_config.values()))
        totals = {config: sum(cases[c] for c in common) for config, cases in per_config.items()}
        fastest.append((tokens, hidden, *min(totals.items(), key=lambda kv: kv[1])))
    return fastest


def grid_shapes(grids: str, hidden: str | None = None) -> list[tuple[int, int]]:
    """The (T, H) shapes of the comma-separated ``grids`` in order, each once; with ``hidden``
    (comma-separated), only those of these H.

    Raises
    ------
    ValueError
        An unknown grid, or an H that none of the grids' shapes has.
    """
    named = {"standard": STANDARD, "training": TRAINING}
    unknown = sorted(set(grids.split(",")) - set(named))
    if unknown:
        raise ValueError(f"--grid: unknown {', '.join(unknown)}; choose from {', '.join(named)}")
    shapes = list(dict.fromkeys(s for g in grids.split(",") for s in named[g]))
    if hidden is None:
        return shapes
    wanted = {int(h) for h in hidden.split(",")}
    missing = sorted(wanted - {h for _, h in shapes})
    if missing:
        raise ValueError(f"--hidden: no shape of the grids {grids} has H = {missing}")
    return [(t, h) for t, h in shapes if h in wanted]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--grid", default="standard,training", help="standard, training or both")
    parser.add_argument("--hidden", help="only the grids' shapes of these H (comma-separated)")
    parser.add_argument("--recipes", default=",".join(fp8_numerics.RECIPES))
    parser.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"some of {', '.join(IMPLS)}")
    parser.add_argument("--check", action="store_true", help="bitwise check against the reference first")
    parser.add_argument(
        "--tilings", nargs="*", default=[], help="candidate quant tilings, H=TPR,VPT,CLUSTER[,ROWS]"
    )
    parser.add_argument(
        "--choices", nargs="*", default=[], help="candidate quant config choices, [H:]CHOICE=VALUE[,...]"
    )
    parser.add_argument("--reps", type=int, default=20, help="timed calls per row (median)")
    parser.add_argument("--append", action="store_true", help="keep the rows already in OUT (split runs)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    args.impls = args.impls.split(",")
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(IMPLS)}")
    recipes = args.recipes.split(",")
    for recipe in recipes:
        validation.check_recipe(recipe)
    args.arch = device_arch(torch.device("cuda"))
    try:
        tilings = [parse_tiling(t, args.dtype, args.arch) for t in args.tilings]
        choices = [parse_choices(t) for t in args.choices]
        shapes = grid_shapes(args.grid, args.hidden)
    except ValueError as exc:
        parser.error(str(exc))
    prewarm(args, recipes, shapes)
    if args.check and check(recipes, tilings, choices, args):
        return 1
    timer = DeviceTimer(torch, torch.device("cuda"))
    timer.warm_clocks()
    rows = []
    for recipe in recipes:
        for residual in (False, True):
            for t, h in shapes:
                mine = [{"tiling": c} for hidden, c in tilings if hidden == h]
                mine += [candidate for only, candidate in choices if applies(only, h)]
                rows += bench_shape(timer, args, recipe, residual, t, h, mine)
    print_table(rows)
    rows = kept_rows(args.out, args.append) + rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    write_results(args.out, "benchmarks/fp8_bench.py", device, rows, reps=args.reps, l2_bytes=timer.l2_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
