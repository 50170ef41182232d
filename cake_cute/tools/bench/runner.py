"""One sweep on a GPU: inputs per shape (rotated input sets), one row per (impl, op, residual), the copy
ceiling per (op, residual), and the results file rewritten after every shape."""

from __future__ import annotations

import datetime as _dt
import gc
import statistics
import time
from pathlib import Path

from ...vocab import dtype_bytes, torch_dtype
from .cases import RESIDUAL_MODES, ceiling_target, grid_shapes, model_bytes
from .peers import FACTORIES, Impl, is_sticky_cuda_error, versions
from .results import (
    TIMING_METHOD,
    default_json_path,
    format_table,
    git_commit,
    load_json,
    merge_rows,
    write_json,
)
from .timing import DeviceTimer, Rotation, buffer_sets_for, tbps

MEASURED_FIELDS = ("us", "gpu_us", "host_us", "tbps", "frac_copy", "first_call_s", "bwd_method", "kernel_us")


def _short(exc: BaseException, limit: int = 400) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:limit]}"


class Sweep:
    """The state of one sweep: arguments, timer, rows so far, notes, and the error that stopped it."""

    def __init__(self, args, torch, device=None):
        self.args = args
        self.torch = torch
        self.device = torch.device(device or "cuda")
        self.timer = DeviceTimer(torch, self.device)
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.fatal: str | None = None
        self.rotate = args.grid != "small"  # small shapes are L2-resident by nature, and reported so
        self.impls: list[Impl] = []
        self.done = self.total = 0  # rows measured so far, rows in the sweep (for the progress lines)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)

    # ---- inputs ------------------------------------------------------------------------------------
    def input_sets(self, T: int, H: int, dtype: str, residual: bool) -> list[dict]:
        """Enough independent (x, w, g[, residual, g_residual]) sets that together exceed the L2."""
        torch, tdt = self.torch, torch_dtype(dtype)
        per_set = (4 if residual else 2) * T * H * dtype_bytes(dtype)
        sets = []
        for _ in range(buffer_sets_for(per_set, self.timer.l2_bytes, self.rotate)):
            t = {
                "x": torch.randn(T, H, device=self.device, dtype=tdt).requires_grad_(),
                "w": (1 + 0.1 * torch.randn(H, device=self.device)).to(tdt).requires_grad_(),
                "g": torch.randn(T, H, device=self.device, dtype=tdt),
            }
            if residual:
                t["r"] = torch.randn(T, H, device=self.device, dtype=tdt).requires_grad_()
                t["gh"] = torch.randn(T, H, device=self.device, dtype=tdt)
            sets.append(t)
        return sets

    # ---- one row -----------------------------------------------------------------------------------
    def _forward_calls(self, impl: Impl, sets: list[dict]):
        rotation = Rotation(len(sets))

        def call(_):
            t = sets[rotation.next()]
            return impl.forward(t["x"], t["w"], t.get("r"))

        return call, None, None

    def _backward_calls(self, impl: Impl, sets: list[dict], row: dict):
        """(call, setup, method): replay of one retained graph per set, or a fresh untimed forward before
        each timed backward."""
        torch = self.torch
        rotation = Rotation(len(sets))

        def inputs(t):
            return (t["x"], t["w"]) + ((t["r"],) if "r" in t else ())

        def grads(t):
            return (t["g"],) + ((t["gh"],) if "r" in t else ())

        graphs = [impl.forward(t["x"], t["w"], t.get("r")) for t in sets]

        def replay(_):
            k = rotation.next()
            return torch.autograd.grad(graphs[k], inputs(sets[k]), grads(sets[k]), retain_graph=True)

        try:
            for _ in range(2 * len(sets)):  # every graph twice: a replay must work too
                replay(None)
            torch.cuda.synchronize()
            return replay, None, "retain_graph"
        except RuntimeError as e:
            if is_sticky_cuda_error(e):
                raise
            self.note(
                f"{impl.name} bwd {row['dtype']} T={row['T']} H={row['H']}: retain_graph replay failed "
                f"({_short(e, 160)}); timed with an untimed fresh forward before every call"
            )
        graphs.clear()

        def setup():
            k = rotation.next()
            return k, impl.forward(sets[k]["x"], sets[k]["w"], sets[k].get("r"))

        def fresh(arg):
            k, outs = arg
            return torch.autograd.grad(outs, inputs(sets[k]), grads(sets[k]))

        return fresh, setup, "fresh_forward_per_call"

    def _time_row(self, impl: Impl, op: str, sets: list[dict], row: dict) -> None:
        torch, args = self.torch, self.args
        start = time.perf_counter()
        if op == "fwd":
            call, setup, method = self._forward_calls(impl, sets)
            outs = call(None)
            if len(outs) != (2 if "r" in sets[0] else 1):
                raise RuntimeError(f"forward returned {len(outs)} outputs")
            del outs
        else:
            call, setup, method = self._backward_calls(impl, sets, row)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - start, 3)
        for _ in range(max(args.warmup, len(sets))):  # every set at least once
            call(setup() if setup else None)
        torch.cuda.synchronize()
        us = statistics.median(self.timer.wall_us(call, args.reps, setup))
        gpu_us = self.timer.device_us(call, args.prof_reps, setup)
        row.update(us=round(us, 3), gpu_us=round(gpu_us, 3), host_us=round(us - gpu_us, 3))
        row["tbps"] = tbps(row["bytes"], gpu_us)
        if not self.rotate:  # calls of a few microseconds: their kernels' own time too
            row["kernel_us"] = round(self.timer.kernel_us(call, args.prof_reps, setup), 3)
        if op == "bwd":
            row["bwd_method"] = method

    def measure(self, impl: Impl, op: str, residual: bool, dtype: str, shape, sets, copy: dict) -> dict:
        """One row; a peer failing on a shape is a result (an ``error`` field), not a crash."""
        torch = self.torch
        T, H = shape
        row = {"impl": impl.name, "op": op, "residual": residual, "dtype": dtype, "T": T, "H": H}
        row.update(bytes=model_bytes(op, residual, T, H, dtype), buffer_sets=len(sets), gpu_method="events")
        target = ceiling_target(op, row["bytes"])
        if target is not None:
            row["target_frac_copy"] = target
        try:
            self._time_row(impl, op, sets, row)
            row.update(copy)
            row["frac_copy"] = float(f"{row['tbps'] / copy['copy_tbps']:.4g}")
        except Exception as e:
            for k in MEASURED_FIELDS:
                row.pop(k, None)
            row["error"] = _short(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                gc.collect()
                torch.cuda.empty_cache()
            self.check_context(e, row["error"])
        finally:
            if op == "bwd":
                for t in sets:
                    impl.after_backward(t)
        return row

    def check_context(self, exc: BaseException, message: str) -> None:
        """After an error: stop the sweep (``fatal``) when the CUDA context cannot be used any more."""
        if is_sticky_cuda_error(exc):
            self.fatal = message
            return
        try:
            self.torch.cuda.synchronize()
        except Exception as e:
            self.fatal = _short(e)


def precompile_cake(sweep: Sweep, shapes, res_modes) -> float:
    """Compile the sweep's cake kernels before any peer is imported (quack patches CuTe classes)."""
    import cake_cute

    torch, start = sweep.torch, time.perf_counter()
    for dt in sweep.args.dtype:
        for H in sorted({h for _, h in shapes}):
            for res in res_modes:
                x = torch.randn(2, H, device=sweep.device, dtype=torch_dtype(dt), requires_grad=True)
                w = torch.ones(H, device=sweep.device, dtype=torch_dtype(dt), requires_grad=True)
                r = torch.randn_like(x, requires_grad=True) if res else None
                try:
                    out = cake_cute.cake_rmsnorm(x, w, sweep.args.eps, residual=r)
                    out = out if isinstance(out, tuple) else (out,)
                    torch.autograd.grad(out, (x, w), grad_outputs=tuple(torch.ones_like(o) for o in out))
                except Exception as e:
                    sweep.note(f"cake precompile {dt} H={H} residual={res} failed: {_short(e, 200)}")
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, 2)


def _implementations(sweep: Sweep) -> list[Impl]:
    impls = []
    for name in ([] if sweep.args.no_cake else ["cake_cute"]) + list(sweep.args.vs):
        try:
            impls.append(FACTORIES[name](sweep.torch, sweep.args.eps))
        except Exception as e:
            sweep.note(f"{name}: skipped, import failed ({_short(e, 200)})")
    return impls


def _progress(sweep: Sweep, row: dict, seconds: float) -> str:
    if row.get("error"):
        msg = "error: " + row["error"][:150]
    else:
        msg = f"us {row['us']:.1f}  gpu_us {row['gpu_us']:.1f}  {row['tbps']:.2f} TB/s"
        msg += f" ({100 * row['frac_copy']:.0f}% of copy, {row['buffer_sets']} input sets)"
    residual = "on " if row["residual"] else "off"
    return (
        f"[{sweep.done:>3}/{sweep.total}] {row['impl']:<9} {row['op']} res={residual} {row['dtype']} "
        f"H={row['H']:<6} T={row['T']:<6} {msg}  [{seconds:.1f} s]"
    )


def _copy_ceilings(sweep: Sweep, dtype: str, shape, residual: bool) -> dict:
    T, H = shape
    return {
        op: sweep.timer.copy_ceiling(
            model_bytes(op, residual, T, H, dtype),
            sweep.args.prof_reps,
            sweep.rotate,
            kernel_time=not sweep.rotate,
        )
        for op in sweep.args.ops
    }


def shape_rows(sweep: Sweep, dtype: str, shape, res_modes) -> None:
    """Every row of one (dtype, T, H): input sets, copy ceilings, then each implementation and op."""
    ops = sweep.args.ops
    for res in res_modes:
        try:
            sets = sweep.input_sets(*shape, dtype, res)
            copies = _copy_ceilings(sweep, dtype, shape, res)
        except Exception as e:
            sweep.note(
                f"T, H = {shape} {dtype} residual={res}: inputs or copy ceiling failed ({_short(e, 200)})"
            )
            sweep.done += len(sweep.impls) * len(ops)
            sweep.check_context(e, _short(e))
            continue
        for impl in sweep.impls:
            for op in ops:
                if sweep.fatal:
                    return
                start = time.perf_counter()
                row = sweep.measure(impl, op, res, dtype, shape, sets, copies[op])
                sweep.rows.append(row)
                sweep.done += 1
                print(_progress(sweep, row, time.perf_counter() - start), flush=True)
        del sets
        gc.collect()
        sweep.torch.cuda.empty_cache()


def results_document(sweep: Sweep, header: dict, old_rows: list[dict], t_start: float) -> dict:
    """The JSON document: the run's facts, method, notes and rows (merged with --append)."""
    args = sweep.args
    return {
        **header,
        "grid": args.grid,
        "complete": sweep.fatal is None and sweep.done == sweep.total,
        "versions": versions(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "impls": [i.name for i in sweep.impls],
        "notes": sweep.notes,
        "method": TIMING_METHOD,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "rows": merge_rows(old_rows, sweep.rows),
    }


def _header(sweep: Sweep) -> dict:
    torch = sweep.torch
    props = torch.cuda.get_device_properties(sweep.device)
    return {
        "gpu": props.name,
        "commit": git_commit(),
        "date": _dt.date.today().isoformat(),
        "sm": f"sm_{props.major}{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def run(args, torch, t_start: float, device=None) -> int:
    """The whole sweep: rows, table, JSON and PNG.

    Returns
    -------
    int
        0; 1 when nothing could be benchmarked or a CUDA error stopped the sweep early.
    """
    from .plot import plot_results

    sweep = Sweep(args, torch, device)
    header = _header(sweep)
    json_path = args.json or default_json_path(header["gpu"], header["date"], args.grid, tuple(args.dtype))
    shapes = {dt: grid_shapes(args.grid, dt, args.hidden, args.tokens, args.elements) for dt in args.dtype}
    res_modes = RESIDUAL_MODES[args.residual]
    torch.manual_seed(args.seed)
    print(
        f"cake-cute bench: {header['gpu']} ({header['sm']}, {header['sm_count']} SMs, L2 "
        f"{header['l2_bytes'] >> 20} MiB), torch {header['torch']}, commit {header['commit']}",
        flush=True,
    )
    print(f"grid {args.grid}: shapes (T, H) {shapes}; residual {args.residual}; ops {args.ops}", flush=True)
    if not args.no_cake:
        header["cake_precompile_s"] = precompile_cake(
            sweep, sorted({s for v in shapes.values() for s in v}), res_modes
        )
    sweep.impls = _implementations(sweep)
    if not sweep.impls:
        print("error: nothing to benchmark (every implementation was skipped)")
        return 1
    sweep.timer.warm_clocks()
    old_rows = load_json(json_path)["rows"] if args.append and json_path.exists() else []
    sweep.total = sum(len(v) for v in shapes.values()) * len(res_modes) * len(sweep.impls) * len(args.ops)
    for dt in args.dtype:
        for shape in shapes[dt]:
            if not sweep.fatal:
                shape_rows(sweep, dt, shape, res_modes)
                write_json(
                    json_path, results_document(sweep, header, old_rows, t_start)
                )  # survives a timeout
    if sweep.fatal:
        sweep.note(f"sweep stopped early after a CUDA error that poisons the context: {sweep.fatal}")
    doc = results_document(sweep, header, old_rows, t_start)
    write_json(json_path, doc)
    print("\n" + format_table(sweep.rows))
    print(f"results written to {json_path} ({len(sweep.rows)} rows, {time.perf_counter() - t_start:.0f} s)")
    if not args.no_plot:
        plot_results(doc, args.plot or json_path.with_suffix(".png"))
    return 1 if sweep.fatal else 0
