"""``cake-cute bench`` / ``python perf/sweep.py``: per-shape performance sweep of cake_cute's RMSNorm
against torch eager, torch.compile, Liger and quack (whichever are importable), with a device-copy
ceiling measured in the same run. Writes a JSON file, prints a table and (with matplotlib) a PNG.

Everything at module level is standard library only, so the table / JSON / plot helpers work on a
machine without torch or a GPU (``perf/plot.py`` loads this file directly). torch, cake_cute and the
peers are imported inside the GPU code path. The method is described in ``perf/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STANDARD_HIDDEN = (1024, 2048, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072)
SMALL_TOKENS = (1, 16, 256)
SMALL_HIDDEN = (4096,)
DEFAULT_ELEMENTS = 1 << 27
PEERS = ("torch", "compile", "liger", "quack")
IMPLS = ("cake_cute",) + PEERS
OPS = ("fwd", "bwd")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RESIDUAL_MODES = {"off": (False,), "on": (True,), "both": (False, True)}

# Device activities that count towards gpu_us (chrome-trace categories written by kineto).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# torch.cuda._sleep launches ``at::cuda::(anonymous namespace)::spin_kernel``: a kernel no RMSNorm
# implementation launches, used to bracket each profiled call on the device timeline.
MARKER_NAME = "spin_kernel"
_MARKER_CYCLES = 1000

TIMING_METHOD = {
    "us": "median over --reps calls of CUDA-event time around ONE call through the public autograd path, "
    "GPU idle before each call (synchronize), so host work (validation, dispatch, launch) is included; "
    "bwd = torch.autograd.grad(outputs, (x, w[, residual]), fixed upstream grads, retain_graph=True) "
    "on a graph built once outside the timed region",
    "gpu_us": "median over --prof-reps calls of the summed device durations (kernels, memcpy, memset) that one "
    "call launches, from torch.profiler (ProfilerActivity.CUDA); each call is bracketed by marker "
    "kernels (torch.cuda._sleep) that are excluded; if the profiler fails, CUDA events instead "
    "(row field gpu_method says which)",
    "host_us": "us - gpu_us",
    "bytes": "fwd: read x (+residual) and w, write y (+h_new) and rstd (4 bytes/row); "
    "bwd: read g and x (+g_residual), write dx (w, rstd and dw are not counted)",
    "tbps": "bytes / gpu_us / 1e6 (TB/s)",
    "copy_tbps": "device-to-device copy of bytes/2 into another buffer (read + write = bytes), device time "
    "from torch.profiler exactly like gpu_us; the faster of cudaMemcpyAsync (tensor.copy_) and "
    "an elementwise copy kernel (torch.neg on an fp32 view)",
}


# --------------------------------------------------------------------------------------------------
# Pure helpers (no torch): byte model, argument parsing, shapes, table, JSON, plot, trace parsing.
# --------------------------------------------------------------------------------------------------


def model_bytes(
    op: str, residual: bool, tokens: int, hidden: int, dtype: str = "bf16", w_dtype: str | None = None
) -> int:
    """Bytes an ideal kernel moves (see TIMING_METHOD["bytes"])."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    act = tokens * hidden * DTYPE_BYTES[dtype]
    if op == "fwd":
        w_bytes = hidden * DTYPE_BYTES[w_dtype or dtype]
        return (4 if residual else 2) * act + w_bytes + 4 * tokens
    if op == "bwd":
        return (4 if residual else 3) * act
    raise ValueError(f"op must be 'fwd' or 'bwd', got {op!r}")


def parse_count(text: str) -> int:
    """'134217728', '2^27', '2**27', '1<<27', '128M' (binary suffixes K/M/G) -> int > 0."""
    t = str(text).strip().lower().replace("_", "").replace(" ", "")
    value = None
    if m := re.fullmatch(r"(\d+)(?:\^|\*\*)(\d+)", t):
        value = int(m.group(1)) ** int(m.group(2))
    elif m := re.fullmatch(r"(\d+)<<(\d+)", t):
        value = int(m.group(1)) << int(m.group(2))
    elif m := re.fullmatch(r"(\d+)([kmg]?)", t):
        value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive count like 134217728, 2^27 or 128M, got {text!r}"
        )
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [parse_count(p) for p in str(text).split(",") if p.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive ints: {e}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _choice_list(choices, *, allow_none=False, allow_all=False):
    def parse(text: str) -> list[str]:
        items = [p.strip().lower() for p in str(text).split(",") if p.strip()]
        if allow_none and items == ["none"]:
            return []
        if allow_all and items == ["all"]:
            return list(choices)
        bad = [i for i in items if i not in choices]
        if bad or not items:
            extra = (", 'none'" if allow_none else "") + (", 'all'" if allow_all else "")
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(choices)}{extra}; got {text!r}"
            )
        return list(dict.fromkeys(items))  # keep order, drop repeats

    return parse


def build_parser(prog: str = "cake-cute bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="RMSNorm training performance sweep: cake_cute vs torch eager, torch.compile, Liger and "
        "quack, with a device-copy ceiling. See perf/README.md for the method and the JSON fields.",
    )
    p.add_argument(
        "--hidden",
        type=_int_list,
        default=None,
        help="comma-separated hidden sizes (default: 1024,2048,4096,5120,7168,8192,16384,32768,"
        "65536,131072; with --small: 4096)",
    )
    p.add_argument(
        "--tokens",
        type=parse_count,
        default=None,
        help="rows T for every hidden size (default: elements // H; with --small: 1,16,256)",
    )
    p.add_argument(
        "--elements",
        type=parse_count,
        default=DEFAULT_ELEMENTS,
        help="T*H per shape when --tokens is not given (default 2^27)",
    )
    p.add_argument(
        "--dtype",
        type=_choice_list(tuple(DTYPE_BYTES)),
        default=["bf16"],
        help="comma-separated activation dtypes out of bf16,fp16,fp32 (default bf16); w has the same dtype",
    )
    p.add_argument(
        "--residual",
        choices=tuple(RESIDUAL_MODES),
        default="both",
        help="residual-add mode: off, on or both (default both)",
    )
    p.add_argument(
        "--vs",
        type=_choice_list(PEERS, allow_none=True, allow_all=True),
        default=list(PEERS),
        help="peers to compare against: comma-separated subset of torch,compile,liger,quack, "
        "'all' or 'none' (default all); peers that fail to import are skipped with a note",
    )
    p.add_argument("--no-cake", action="store_true", help="do not time cake_cute (peers only)")
    p.add_argument("--ops", type=_choice_list(OPS), default=list(OPS), help="fwd,bwd (default both)")
    p.add_argument(
        "--small",
        action="store_true",
        help="small-batch shapes: T in 1,16,256 at H=4096 (L2-resident by nature)",
    )
    p.add_argument(
        "--json", type=Path, default=None, help="output JSON (default perf/results/<date>-<gpu>[-small].json)"
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="merge into an existing --json file: rows with the same (impl, op, residual, dtype, T, H) "
        "are replaced, others kept (to split a sweep across several commands)",
    )
    p.add_argument("--plot", type=Path, default=None, help="output PNG (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--reps", type=int, default=30, help="timed calls per row for us (default 30)")
    p.add_argument("--prof-reps", type=int, default=10, help="profiled calls per row for gpu_us (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before measuring (default 3, min 1)")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("reps", "prof_reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first call compiles)")
    if not args.eps > 0:
        parser.error("--eps must be > 0")
    return args


def sweep_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(T, H) pairs in sweep order."""
    if args.small:
        hidden = args.hidden or list(SMALL_HIDDEN)
        tokens = [args.tokens] if args.tokens else list(SMALL_TOKENS)
        return [(t, h) for h in hidden for t in tokens]
    hidden = args.hidden or list(STANDARD_HIDDEN)
    shapes = []
    for h in hidden:
        t = args.tokens if args.tokens else args.elements // h
        if t >= 1:
            shapes.append((t, h))
    return shapes


def slugify(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")
    return s or "unknown-gpu"


def default_json_path(gpu: str, date: str, small: bool = False, root: Path | None = None) -> Path:
    if root is None:
        repo = Path(__file__).resolve().parents[1]
        root = repo if (repo / "perf").is_dir() and (repo / "pyproject.toml").is_file() else Path.cwd()
    name = f"{date}-{slugify(gpu)}{'-small' if small else ''}.json"
    return Path(root) / "perf" / "results" / name


def git_commit() -> str:
    """``$CAKE_CUTE_COMMIT`` when set (a copy of the tree on another machine may carry a stale .git),
    else ``git rev-parse --short HEAD`` (+ ``-dirty``) of the checkout the package sits in."""
    if os.environ.get("CAKE_CUTE_COMMIT"):
        return os.environ["CAKE_CUTE_COMMIT"]
    repo = Path(__file__).resolve().parents[1]
    try:
        if not (repo / ".git").exists():
            raise OSError("not a git checkout")
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            commit = out.stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if dirty.returncode == 0 and dirty.stdout.strip():
                commit += "-dirty"
            return commit
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def row_key(row: dict) -> tuple:
    return (
        row.get("impl"),
        row.get("op"),
        bool(row.get("residual")),
        row.get("dtype"),
        row.get("T"),
        row.get("H"),
    )


def _impl_rank(impl: str) -> int:
    return IMPLS.index(impl) if impl in IMPLS else len(IMPLS)


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(
        rows,
        key=lambda r: (
            r.get("dtype", ""),
            OPS.index(r["op"]) if r.get("op") in OPS else 9,
            bool(r.get("residual")),
            r.get("H", 0),
            r.get("T", 0),
            _impl_rank(r.get("impl", "")),
        ),
    )


def _fmt(value, spec: str) -> str:
    if value is None:
        width = re.match(r"\d*", spec).group(0)
        return "-".rjust(int(width)) if width else "-"
    return format(value, spec)


def format_table(rows: list[dict]) -> str:
    """Compact fixed-width table (one line per row; error rows show the error)."""
    head = (
        f"{'impl':<9} {'op':<3} {'res':<3} {'dtype':<5} {'H':>7} {'T':>7} {'us':>10} {'gpu_us':>10} "
        f"{'TB/s':>6} {'copyTB/s':>8} {'%copy':>6} {'host_us':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in sort_rows(rows):
        lead = (
            f"{r.get('impl', '?'):<9} {r.get('op', '?'):<3} {'on' if r.get('residual') else 'off':<3} "
            f"{r.get('dtype', '?'):<5} {r.get('H', 0):>7} {r.get('T', 0):>7} "
        )
        if r.get("error"):
            lines.append(lead + "error: " + " ".join(str(r["error"]).split())[:70])
            continue
        frac = r.get("frac_copy")
        lines.append(
            lead + f"{_fmt(r.get('us'), '10.1f')} {_fmt(r.get('gpu_us'), '10.1f')} "
            f"{_fmt(r.get('tbps'), '6.2f')} {_fmt(r.get('copy_tbps'), '8.2f')} "
            f"{_fmt(None if frac is None else 100 * frac, '6.1f')} {_fmt(r.get('host_us'), '8.1f')}"
        )
    return "\n".join(lines)


def dumps_results(doc: dict) -> str:
    """JSON text of a results document with one row per line (diff- and grep-friendly)."""
    head = {k: v for k, v in doc.items() if k != "rows"}
    rows = doc.get("rows", [])
    text = json.dumps(head, indent=1)
    body = ",\n".join("  " + json.dumps(r) for r in rows)
    rows_text = ' "rows": [\n' + body + "\n ]" if rows else ' "rows": []'
    if head:
        return text[:-2] + ",\n" + rows_text + "\n}\n"
    return "{\n" + rows_text + "\n}\n"


def write_json(path: Path, doc: dict) -> None:
    """Atomic write (a partial file never replaces a good one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps_results(doc))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_json(path: Path) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not a cake-cute bench results file (no 'rows' list)")
    return doc


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of ``new`` replace rows of ``old`` with the same key; order: old keys first, then new."""
    merged = {row_key(r): r for r in old}
    for r in new:
        merged[row_key(r)] = r
    return list(merged.values())


_IMPL_COLORS = {
    "cake_cute": "tab:red",
    "torch": "tab:blue",
    "compile": "tab:green",
    "liger": "tab:purple",
    "quack": "tab:orange",
}


def plot_results(doc, png: Path) -> bool:
    """Two panels (fwd, bwd): x = H (log2), y = tbps / copy_tbps, a line per implementation; residual off
    solid, on dashed. When every row has the same H (small-batch sweep) x is T instead. Returns False (with a
    note) when matplotlib is missing or there is nothing to plot."""
    if not isinstance(doc, dict):
        doc = load_json(Path(doc))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "note: matplotlib is not installed; plot skipped. Render it on any machine with matplotlib: "
            "python perf/plot.py <results.json>",
            file=sys.stderr,
        )
        return False
    rows = [r for r in doc.get("rows", []) if not r.get("error") and r.get("tbps") and r.get("copy_tbps")]
    if not rows:
        print("note: no successful rows to plot; plot skipped", file=sys.stderr)
        return False
    hs = sorted({r["H"] for r in rows})
    multi_t_per_h = any(len({r["T"] for r in rows if r["H"] == h}) > 1 for h in hs)
    xkey = "T" if (len(hs) == 1 or multi_t_per_h) else "H"
    split_h = xkey == "T" and len(hs) > 1
    dtypes = sorted({r["dtype"] for r in rows})
    impls = sorted({r["impl"] for r in rows}, key=_impl_rank)
    extra = sorted({r["impl"] for r in rows} - set(_IMPL_COLORS))
    colors = dict(_IMPL_COLORS)
    for i, name in enumerate(extra):
        colors[name] = f"C{(i + 5) % 10}"
    markers = ["o", "s", "^", "D"]

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    xs_all = sorted({r[xkey] for r in rows})
    for ax, op in zip(axes, OPS):
        for impl in impls:
            for di, dt in enumerate(dtypes):
                for res in (False, True):
                    for h in hs if split_h else [None]:
                        sel = [
                            r
                            for r in rows
                            if r["op"] == op
                            and r["impl"] == impl
                            and r["dtype"] == dt
                            and bool(r.get("residual")) == res
                            and (h is None or r["H"] == h)
                        ]
                        if not sel:
                            continue
                        pts = sorted((r[xkey], r["tbps"] / r["copy_tbps"]) for r in sel)
                        label = (
                            impl
                            + (f" {dt}" if len(dtypes) > 1 else "")
                            + (f" H={h}" if h else "")
                            + (" +residual" if res else "")
                        )
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            linestyle="--" if res else "-",
                            marker=markers[di % len(markers)],
                            markersize=4,
                            color=colors[impl],
                            label=label,
                        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels(
            [f"{v // 1024}K" if xkey == "H" and v >= 1024 and v % 1024 == 0 else str(v) for v in xs_all],
            rotation=45 if len(xs_all) > 6 else 0,
        )
        ax.minorticks_off()
        ax.set_xlabel("hidden size H" if xkey == "H" else "rows T")
        ax.set_title(
            f"{op}  (bytes: {'x(+res)+w in, y(+h)+rstd out' if op == 'fwd' else 'g+x(+g_res) in, dx out'})",
            fontsize=10,
        )
        ax.grid(True, which="major", alpha=0.3)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
    axes[0].set_ylabel("TB/s ÷ device-copy TB/s")
    axes[0].set_ylim(bottom=0)
    handles, labels = [], []
    for ax in axes:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(hnd)
                labels.append(lab)
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(
        f"RMSNorm {'/'.join(dtypes)} vs device copy — {doc.get('gpu', '?')} — {doc.get('date', '?')} — "
        f"commit {doc.get('commit', '?')}"
    )
    fig.tight_layout(rect=(0, 0, 0.84, 0.95))
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)
    print(f"plot written to {png}")
    return True


def per_call_device_us(events, n_calls: int, marker: str = MARKER_NAME) -> list[float]:
    """Per-call device time from one profiler session in which every call was bracketed by two marker
    kernels. ``events``: (name, start_us, duration_us) of device activities. Returns ``n_calls`` sums of the
    durations of the non-marker activities that start between the two markers of each call."""
    evs = sorted(((str(n), float(ts), float(d)) for n, ts, d in events), key=lambda e: e[1])
    marks = [e for e in evs if marker in e[0]]
    if len(marks) != 2 * n_calls:
        raise RuntimeError(
            f"profiler trace has {len(marks)} marker kernels, expected {2 * n_calls}; "
            "cannot attribute device time to calls"
        )
    work = [e for e in evs if marker not in e[0]]
    out = []
    for i in range(n_calls):
        lo, hi = marks[2 * i][1], marks[2 * i + 1][1]
        out.append(sum(d for _, ts, d in work if lo < ts < hi))
    return out


def device_events_from_trace(path) -> list[tuple[str, float, float]]:
    """(name, ts_us, dur_us) of kernels, memcpys and memsets in a chrome trace written by torch.profiler."""
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        if str(e.get("cat", "")).lower() in DEVICE_CATEGORIES:
            out.append((str(e.get("name", "")), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
    return out


def plot_main(argv: list[str] | None = None) -> int:
    """``python perf/plot.py results.json [more.json ...] [-o out.png] [--write-json merged.json]``: table + PNG
    from results JSON files (no GPU, no torch). Several files are merged (later files win on equal rows), e.g.
    a sweep split over several commands."""
    p = argparse.ArgumentParser(
        prog="perf/plot.py", description="Plot (and print) cake-cute bench results JSON files."
    )
    p.add_argument(
        "json", type=Path, nargs="+", help="results JSON written by cake-cute bench / perf/sweep.py"
    )
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="PNG path (default: the (merged) JSON path with .png)"
    )
    p.add_argument("--write-json", type=Path, default=None, help="write the merged results to this JSON file")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    args = p.parse_args(argv)
    try:
        docs = [load_json(path) for path in args.json]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = dict(docs[-1])
    rows: list[dict] = []
    for d in docs:
        rows = merge_rows(rows, d["rows"])
    doc["rows"] = rows
    if len(docs) > 1:
        doc["merged_from"] = [str(path) for path in args.json]
        doc["notes"] = [n for d in docs for n in d.get("notes", [])]
        doc["complete"] = all(d.get("complete", True) for d in docs)
        commits = sorted({str(d.get("commit")) for d in docs})
        if len(commits) > 1:
            print(f"warning: merging results of different commits {commits}", file=sys.stderr)
    if args.write_json:
        write_json(args.write_json, doc)
        print(f"merged results written to {args.write_json} ({len(rows)} rows)")
    if not args.no_table:
        print(f"{doc.get('gpu', '?')}  {doc.get('date', '?')}  commit {doc.get('commit', '?')}")
        print(format_table(rows))
    if args.no_plot:
        return 0
    ok = plot_results(doc, args.output or (args.write_json or args.json[-1]).with_suffix(".png"))
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------------
# GPU side. Everything below imports torch lazily.
# --------------------------------------------------------------------------------------------------


class _Impl:
    """An implementation under test: ``forward(x, w, residual)`` returns a tuple (y,) or (y, h_new) with
    autograd, x / w / residual being leaves that require grad."""

    name = "?"

    def forward(self, x, w, residual):  # pragma: no cover - GPU only
        raise NotImplementedError

    def after_backward(self, tensors) -> None:  # pragma: no cover - GPU only
        pass


class _Cake(_Impl):
    name = "cake_cute"

    def __init__(self, torch, eps):
        import cake_cute

        self._fn = cake_cute.cake_rmsnorm
        self._eps = eps

    def forward(self, x, w, residual):
        out = self._fn(x, w, self._eps, residual=residual)
        return out if isinstance(out, tuple) else (out,)


class _TorchEager(_Impl):
    name = "torch"

    def __init__(self, torch, eps):
        self._rms_norm = torch.nn.functional.rms_norm
        self._eps = eps

    def forward(self, x, w, residual):
        if residual is None:
            return (self._rms_norm(x, (x.shape[-1],), w, self._eps),)
        h = x + residual
        return self._rms_norm(h, (h.shape[-1],), w, self._eps), h


class _TorchCompile(_Impl):
    """torch.compile(dynamic=False, fullgraph=True) of an FP32 reference; one compiled graph per
    (shape, dtype, residual) and a dynamo reset when it changes, so guards never accumulate."""

    name = "compile"

    def __init__(self, torch, eps):
        import torch._dynamo  # a lazy submodule: make torch._dynamo.config reachable
        import triton  # noqa: F401  (inductor's GPU backend; fail early with a clear skip note)

        self._torch = torch
        for mod, names, value in (
            (torch._dynamo.config, ("recompile_limit", "cache_size_limit"), 64),
            (torch._dynamo.config, ("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4096),
        ):
            for n in names:
                if hasattr(mod, n):
                    setattr(mod, n, value)
        try:  # donated buffers forbid backward(retain_graph=True) on the compiled graph
            import torch._functorch.config as fconfig

            if hasattr(fconfig, "donated_buffer"):
                fconfig.donated_buffer = False
        except Exception:
            pass

        def plain(x, w):
            xf = x.float()
            rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            return (xf * rstd * w.float()).to(x.dtype)

        def with_residual(x, r, w):
            h = x + r
            hf = h.float()
            rstd = torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
            return (hf * rstd * w.float()).to(x.dtype), h

        self._plain, self._with_residual = plain, with_residual
        self._key = None
        self._fn = None

    def forward(self, x, w, residual):
        key = (tuple(x.shape), x.dtype, w.dtype, residual is not None)
        if key != self._key:
            self._fn = None
            self._torch._dynamo.reset()
            src = self._plain if residual is None else self._with_residual
            self._fn = self._torch.compile(src, dynamic=False, fullgraph=True)
            self._key = key
        if residual is None:
            return (self._fn(x, w),)
        return self._fn(x, residual, w)


class _Liger(_Impl):
    """Liger-Kernel's Triton RMSNorm with the defaults of its modules: LigerRMSNorm (casting 'llama',
    in_place=True: dx overwrites dy) and LigerFusedAddRMSNorm (in_place=False) for the residual mode."""

    name = "liger"

    def __init__(self, torch, eps):
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        self._plain = LigerRMSNormFunction
        self._fused = LigerFusedAddRMSNormFunction
        self._eps = eps

    def forward(self, x, w, residual):
        if residual is None:
            # (X, W, eps, offset, casting_mode, in_place)
            return (self._plain.apply(x, w, self._eps, 0.0, "llama", True),)
        # (X, R, W, eps, offset, casting_mode, in_place) -> (Y, S = X + R)
        return tuple(self._fused.apply(x, residual, w, self._eps, 0.0, "llama", False))

    def after_backward(self, tensors):
        # in_place=True wrote dx into the upstream gradient: give the next rows fresh values
        tensors["g"].normal_()


class _Quack(_Impl):
    name = "quack"

    def __init__(self, torch, eps):
        import inspect

        from quack.rmsnorm import rmsnorm

        self._fn = rmsnorm
        self._eps = eps
        self._has_prenorm = "prenorm" in inspect.signature(rmsnorm).parameters

    def forward(self, x, w, residual):
        if residual is None:
            return (self._fn(x, w, eps=self._eps),)
        if not self._has_prenorm:
            raise RuntimeError("this quack version's rmsnorm() has no prenorm= (cannot return h_new)")
        out = self._fn(x, w, residual=residual, eps=self._eps, prenorm=True)
        return tuple(out)


_FACTORIES = {
    "cake_cute": _Cake,
    "torch": _TorchEager,
    "compile": _TorchCompile,
    "liger": _Liger,
    "quack": _Quack,
}
_DIST_NAMES = {
    "liger": "liger-kernel",
    "quack": "quack-kernels",
    "cake_cute": "cake-cute",
    "triton": "triton",
    "cutlass": "nvidia-cutlass-dsl",
}


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for key, dist in _DIST_NAMES.items():
        try:
            out[key] = metadata.version(dist)
        except Exception:
            pass
    return out


def _is_sticky_cuda_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(
        s in text
        for s in (
            "illegal memory access",
            "unspecified launch failure",
            "illegal instruction",
            "misaligned address",
            "device-side assert",
            "an illegal",
            "cuda error: launch",
        )
    )


class _Runner:  # pragma: no cover - needs a GPU
    def __init__(self, args, torch, device=None):
        self.args = args
        self.torch = torch
        self.device = torch.device(device or "cuda")
        self.notes: list[str] = []
        self.rows: list[dict] = []
        self.fatal: str | None = None
        self.profiler_failures = 0
        self.dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    # ---- timing primitives -------------------------------------------------------------------------
    def _marker(self):
        self.torch.cuda._sleep(_MARKER_CYCLES)

    def time_us(self, call, reps, setup=None) -> list[float]:
        torch = self.torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            arg = setup() if setup is not None else None
            torch.cuda.synchronize()
            start.record()
            res = call(arg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
            del res, arg
        return times

    def profile_us(self, call, reps, setup=None) -> list[float]:
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with tempfile.TemporaryDirectory(prefix="cake-bench-") as d:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    arg = setup() if setup is not None else None
                    torch.cuda.synchronize()
                    self._marker()
                    res = call(arg)
                    self._marker()
                    torch.cuda.synchronize()
                    del res, arg
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            events = device_events_from_trace(path)
        return per_call_device_us(events, reps)

    def device_us(self, call, reps, setup=None) -> tuple[float, str]:
        """(median device us per call, method). torch.profiler normally; if it cannot attribute device time
        (no CUPTI, dropped events) CUDA events instead: back-to-back calls / reps, or per call when each
        call needs an untimed setup (then host time is included)."""
        torch = self.torch
        if self.profiler_failures < 3:
            try:
                return statistics.median(self.profile_us(call, reps, setup)), "profiler"
            except Exception as e:
                if _is_sticky_cuda_error(e):
                    raise
                self.profiler_failures += 1
                self._note(
                    f"torch.profiler failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); this row's "
                    "gpu_us comes from CUDA events"
                    + ("; profiler disabled from now on" if self.profiler_failures >= 3 else "")
                )
        if setup is None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                call(None)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / reps, "events_back_to_back"
        return statistics.median(self.time_us(call, reps, setup)), "events_per_call"

    # ---- copy ceiling ------------------------------------------------------------------------------
    def copy_ceiling(self, nbytes: int) -> dict:
        torch = self.torch
        half = max(16, (nbytes // 2) // 16 * 16)
        src = torch.zeros(half, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        sf, df = src.view(torch.float32), dst.view(torch.float32)
        result = {"copy_bytes": 2 * half}
        best = None
        for label, call in (
            ("memcpy", lambda _: dst.copy_(src)),
            ("kernel", lambda _: torch.neg(sf, out=df)),
        ):
            for _ in range(3):
                call(None)
            us, method = self.device_us(call, self.args.prof_reps)
            result["copy_method"] = method
            result[f"copy_{label}_tbps"] = round(2 * half / us / 1e6, 4) if us > 0 else None
            if us > 0 and (best is None or us < best):
                best = us
        result["copy_gpu_us"] = None if best is None else round(best, 3)
        result["copy_tbps"] = None if best is None else round(2 * half / best / 1e6, 4)
        return result

    # ---- one row -----------------------------------------------------------------------------------
    def measure(
        self, impl: _Impl, op: str, residual: bool, dtype: str, T: int, H: int, t: dict, copy: dict
    ) -> dict:
        torch = self.torch
        args = self.args
        nbytes = model_bytes(op, residual, T, H, dtype)
        row = {
            "impl": impl.name,
            "op": op,
            "residual": residual,
            "dtype": dtype,
            "T": T,
            "H": H,
            "bytes": nbytes,
        }
        x, w, r = t["x"], t["w"], (t["r"] if residual else None)
        inputs = (x, w) + ((r,) if residual else ())
        grads = (t["g"],) + ((t["gh"],) if residual else ())
        try:
            if op == "fwd":

                def call(_):
                    return impl.forward(x, w, r)

                t0 = time.perf_counter()
                out = call(None)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 3)
                if len(out) != len(grads):
                    raise RuntimeError(f"forward returned {len(out)} outputs, expected {len(grads)}")
                del out
                for _ in range(args.warmup - 1):
                    call(None)
                setup = None
            else:
                outs = impl.forward(x, w, r)
                if len(outs) != len(grads):
                    raise RuntimeError(f"forward returned {len(outs)} outputs, expected {len(grads)}")

                def call(_):
                    return torch.autograd.grad(outs, inputs, grad_outputs=grads, retain_graph=True)

                def setup():
                    return impl.forward(x, w, r)

                def call_fresh(o):
                    return torch.autograd.grad(o, inputs, grad_outputs=grads)

                t0 = time.perf_counter()
                try:
                    call(None)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t0, 3)
                    call(None)  # a second replay of the same graph must work too
                    torch.cuda.synchronize()
                    row["bwd_method"] = "retain_graph"
                    setup = None
                except RuntimeError as e:  # graph cannot be replayed: rebuild it (untimed) before every call
                    if _is_sticky_cuda_error(e):
                        raise
                    outs = None
                    call = call_fresh
                    t0 = time.perf_counter()
                    call(setup())  # raises again if the implementation itself cannot run this shape
                    torch.cuda.synchronize()
                    row.setdefault("first_call_s", round(time.perf_counter() - t0, 3))
                    row["bwd_method"] = "fresh_forward_per_call"
                    self._note(
                        f"{impl.name} bwd {dtype} T={T} H={H} residual={residual}: retain_graph replay "
                        f"failed ({type(e).__name__}: {' '.join(str(e).split())[:160]}); timed with a fresh "
                        "untimed forward before every call"
                    )
                for _ in range(max(0, args.warmup - 2)):
                    call(setup() if setup else None)
            torch.cuda.synchronize()
            us = statistics.median(self.time_us(call, args.reps, setup))
            gpu_us, row["gpu_method"] = self.device_us(call, args.prof_reps, setup)
            row["us"] = round(us, 3)
            row["gpu_us"] = round(gpu_us, 3)
            row["host_us"] = round(us - gpu_us, 3)
            row["tbps"] = round(nbytes / gpu_us / 1e6, 4) if gpu_us > 0 else None
            row.update(copy)
            if row["tbps"] is not None and copy.get("copy_tbps"):
                row["frac_copy"] = round(row["tbps"] / copy["copy_tbps"], 4)
        except Exception as e:  # a peer failing on a shape is a result, not a crash
            for k in (
                "us",
                "gpu_us",
                "host_us",
                "tbps",
                "frac_copy",
                "first_call_s",
                "bwd_method",
                "gpu_method",
            ):
                row.pop(k, None)
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
            if isinstance(e, torch.cuda.OutOfMemoryError):
                gc.collect()
                torch.cuda.empty_cache()
            if _is_sticky_cuda_error(e):
                self.fatal = row["error"]
            else:
                try:
                    torch.cuda.synchronize()
                except Exception as e2:
                    self.fatal = f"{type(e2).__name__}: {e2}"
        finally:
            outs = out = call = setup = call_fresh = None  # drop graphs before the next row
            if op == "bwd":
                try:
                    impl.after_backward(t)
                except Exception:
                    pass
        return row

    def _note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)


def _gpu_main(args, torch, t_start: float, device=None) -> int:  # pragma: no cover - needs a GPU
    runner = _Runner(args, torch, device)
    dev = runner.device
    props = torch.cuda.get_device_properties(0)
    gpu = torch.cuda.get_device_name(0)
    date = _dt.date.today().isoformat()
    commit = git_commit()
    json_path = args.json or default_json_path(gpu, date, args.small)
    png_path = None if args.no_plot else (args.plot or json_path.with_suffix(".png"))
    shapes = sweep_shapes(args)
    res_modes = RESIDUAL_MODES[args.residual]
    torch.manual_seed(args.seed)
    print(
        f"cake-cute bench: {gpu} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), "
        f"torch {torch.__version__}, commit {commit}",
        flush=True,
    )
    print(
        f"shapes (T, H): {shapes}; dtypes {args.dtype}; residual {args.residual}; ops {args.ops}; "
        f"reps {args.reps}, profiled {args.prof_reps}, warm-up {args.warmup}",
        flush=True,
    )

    impl_names = ([] if args.no_cake else ["cake_cute"]) + list(args.vs)
    if not args.no_cake:
        # Compile every cake kernel of the sweep before any peer is imported (quack patches CuTe classes
        # process-wide on import); the time is reported separately from the timed rows.
        t0 = time.perf_counter()
        try:
            import cake_cute

            for dt in args.dtype:
                for H in sorted({h for _, h in shapes}):
                    for res in res_modes:
                        x = torch.randn(2, H, device=dev, dtype=runner.dtypes[dt], requires_grad=True)
                        w = torch.ones(H, device=dev, dtype=runner.dtypes[dt], requires_grad=True)
                        r = torch.randn_like(x, requires_grad=True) if res else None
                        try:
                            out = cake_cute.cake_rmsnorm(x, w, args.eps, residual=r)
                            out = out if isinstance(out, tuple) else (out,)
                            torch.autograd.grad(
                                out, (x, w), grad_outputs=tuple(torch.ones_like(o) for o in out)
                            )
                        except Exception as e:
                            runner._note(
                                f"cake precompile {dt} H={H} residual={res} failed: {type(e).__name__}: "
                                f"{str(e)[:200]}"
                            )
            torch.cuda.synchronize()
        except Exception as e:
            runner._note(f"cake_cute import/precompile failed: {type(e).__name__}: {e}")
        precompile_s = round(time.perf_counter() - t0, 2)
        print(f"cake kernels ready in {precompile_s} s", flush=True)
    else:
        precompile_s = None

    impls: list[_Impl] = []
    for name in impl_names:
        try:
            impls.append(_FACTORIES[name](torch, args.eps))
        except Exception as e:
            runner._note(f"{name}: skipped, import failed ({type(e).__name__}: {str(e)[:200]})")
    if not impls:
        print("error: nothing to benchmark (every implementation was skipped)", file=sys.stderr)
        return 1

    # Warm the clocks up (~0.5 s of copies) before the first measurement.
    buf = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    buf2 = torch.empty_like(buf)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        for _ in range(20):
            buf2.copy_(buf)
        torch.cuda.synchronize()
    del buf, buf2

    old_rows: list[dict] = []
    if args.append and json_path.exists():
        try:
            old_rows = load_json(json_path)["rows"]
            print(f"appending to {json_path} ({len(old_rows)} rows there)")
        except (OSError, ValueError) as e:
            runner._note(f"--append: could not read {json_path} ({e}); writing a new file")

    def doc(complete: bool) -> dict:
        return {
            "gpu": gpu,
            "commit": commit,
            "date": date,
            "rows": merge_rows(old_rows, runner.rows),
            "complete": complete,
            "sm": f"sm_{props.major}{props.minor}",
            "sm_count": props.multi_processor_count,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "versions": _versions(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "impls": [i.name for i in impls],
            "notes": runner.notes,
            "method": TIMING_METHOD,
            "cake_precompile_s": precompile_s,
            "elapsed_s": round(time.perf_counter() - t_start, 1),
        }

    total = len(args.dtype) * len(shapes) * len(res_modes) * len(impls) * len(args.ops)
    done = 0
    for dt in args.dtype:
        tdt = runner.dtypes[dt]
        for T, H in shapes:
            if runner.fatal:
                break
            tensors = {}
            try:
                tensors["x"] = torch.randn(T, H, device=dev, dtype=tdt).requires_grad_()
                tensors["w"] = (1 + 0.1 * torch.randn(H, device=dev)).to(tdt).requires_grad_()
                tensors["g"] = torch.randn(T, H, device=dev, dtype=tdt)
                if True in res_modes:
                    tensors["r"] = torch.randn(T, H, device=dev, dtype=tdt).requires_grad_()
                    tensors["gh"] = torch.randn(T, H, device=dev, dtype=tdt)
            except Exception as e:
                runner._note(f"T={T} H={H} {dt}: could not allocate inputs ({type(e).__name__}: {e})")
                done += len(res_modes) * len(impls) * len(args.ops)
                tensors.clear()
                torch.cuda.empty_cache()
                continue
            for res in res_modes:
                copies = {}
                for op in args.ops:
                    try:
                        copies[op] = runner.copy_ceiling(model_bytes(op, res, T, H, dt))
                    except Exception as e:
                        runner._note(f"copy ceiling {op} T={T} H={H} failed: {type(e).__name__}: {e}")
                        copies[op] = {}
                for impl in impls:
                    for op in args.ops:
                        if runner.fatal:
                            break
                        t0 = time.perf_counter()
                        row = runner.measure(impl, op, res, dt, T, H, tensors, copies[op])
                        runner.rows.append(row)
                        done += 1
                        if row.get("error"):
                            msg = "error: " + row["error"][:150]
                        else:
                            msg = (
                                f"us {row['us']:.1f}  gpu_us {row['gpu_us']:.1f}  {row['tbps']:.2f} TB/s"
                                + (
                                    f" ({100 * row['frac_copy']:.0f}% of copy)"
                                    if row.get("frac_copy")
                                    else ""
                                )
                            )
                        print(
                            f"[{done:>3}/{total}] {impl.name:<9} {op} res={'on ' if res else 'off'} {dt} "
                            f"H={H:<6} T={T:<6} {msg}  [{time.perf_counter() - t0:.1f} s]",
                            flush=True,
                        )
            tensors.clear()
            gc.collect()
            torch.cuda.empty_cache()
            write_json(json_path, doc(False))  # partial results survive a timeout
        if runner.fatal:
            break

    if runner.fatal:
        runner._note(f"sweep stopped early after a CUDA error that poisons the context: {runner.fatal}")
    write_json(json_path, doc(runner.fatal is None))
    print()
    print(format_table(runner.rows))
    for n in runner.notes:
        print(f"note: {n}")
    first = {}
    for r in runner.rows:
        first[r["impl"]] = first.get(r["impl"], 0.0) + (r.get("first_call_s") or 0.0)
    print(
        "first-call (compile/JIT) seconds per implementation: "
        + ", ".join(f"{k} {v:.1f}" for k, v in first.items())
        + ("" if precompile_s is None else f"; cake precompile {precompile_s:.1f}")
    )
    print(f"results written to {json_path} ({len(runner.rows)} rows, {time.perf_counter() - t_start:.0f} s)")
    if png_path is not None:
        try:
            plot_results(doc(runner.fatal is None), png_path)
        except Exception as e:
            print(
                f"note: plotting failed ({type(e).__name__}: {e}); render later with python perf/plot.py "
                f"{json_path}",
                file=sys.stderr,
            )
    return 1 if runner.fatal else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cake-cute bench`` and ``python perf/sweep.py``; returns the exit status."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"cake-cute bench: needs PyTorch with CUDA ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "cake-cute bench: no CUDA GPU is available (torch.cuda.is_available() is False). The sweep "
            "times kernels on an NVIDIA GPU (Hopper or Blackwell for cake_cute); run it on a GPU machine. "
            "To plot an existing results file without a GPU use: python perf/plot.py <results.json>",
            file=sys.stderr,
        )
        return 2
    return _gpu_main(args, torch, t_start)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
