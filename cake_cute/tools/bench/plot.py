"""The PNG of a sweep, and ``benchmarks/plot.py`` (table + PNG from results files; no torch, no GPU).

Two panels, fwd and bwd; y = tbps / copy_tbps; one colour per implementation, residual off solid and on
dashed. x is H on a log2 axis, with one line per T when a grid has several T per H (the training grid);
x is T when every row has the same H (the small grid).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .results import OPS, format_table, impl_rank, load_json, merge_rows, write_json

EXIT_NO_MATPLOTLIB = 2
MATPLOTLIB_HINT = (
    "matplotlib is not installed: pip install matplotlib (it comes with pip install -e '.[dev]')"
)
IMPL_COLORS = {
    "cake_cute": "tab:red",
    "torch": "tab:blue",
    "compile": "tab:green",
    "liger": "tab:purple",
    "quack": "tab:orange",
}
OP_BYTES = {"fwd": "x(+res)+w in, y(+h)+rstd out", "bwd": "g+x(+g_res) in, dx out"}
MARKERS = ("o", "s", "^", "D", "v", "P")


def axes_of(rows: list[dict]) -> tuple[str, str | None]:
    """(x field, line-splitting field or None): H with a line per T, or T when every row has one H."""
    hidden = {r["H"] for r in rows}
    if len(hidden) == 1:
        return "T", None
    several_t = any(len({r["T"] for r in rows if r["H"] == h}) > 1 for h in hidden)
    return "H", ("T" if several_t else None)


def plottable(doc: dict) -> list[dict]:
    """Rows with a device-copy fraction (error rows leave a gap in their line)."""
    return [r for r in doc.get("rows", []) if not r.get("error") and r.get("tbps") and r.get("copy_tbps")]


def _series(rows: list[dict], split: str | None) -> dict[tuple, list[tuple[int, float]]]:
    """(op, impl, dtype, residual, split value) -> sorted (x, fraction of copy) points."""
    xkey, _ = axes_of(rows)
    series: dict[tuple, list] = {}
    for r in rows:
        key = (r["op"], r["impl"], r["dtype"], bool(r.get("residual")), r[split] if split else None)
        series.setdefault(key, []).append((r[xkey], r["tbps"] / r["copy_tbps"]))
    return {k: sorted(v) for k, v in series.items()}


def _label(impl: str, dtype: str, residual: bool, split: str | None, value, several_dtypes: bool) -> str:
    return (
        impl
        + (f" {dtype}" if several_dtypes else "")
        + (f" {split}={value}" if split else "")
        + (" +residual" if residual else "")
    )


def _tick(value: int, xkey: str) -> str:
    return f"{value // 1024}K" if xkey == "H" and value >= 1024 and value % 1024 == 0 else str(value)


def draw(doc: dict, rows: list[dict], png: Path) -> None:
    """Draw the two panels of ``rows`` into ``png`` (matplotlib must be importable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xkey, split = axes_of(rows)
    dtypes = sorted({r["dtype"] for r in rows})
    split_values = sorted({r[split] for r in rows}) if split else [None]
    xs = sorted({r[xkey] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    series = _series(rows, split)
    for (op, impl, dtype, residual, value), points in sorted(
        series.items(), key=lambda kv: impl_rank(kv[0][1])
    ):
        ax = axes[OPS.index(op)]
        marker_index = split_values.index(value) if split else dtypes.index(dtype)
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            linestyle="--" if residual else "-",
            marker=MARKERS[marker_index % len(MARKERS)],
            markersize=4,
            color=IMPL_COLORS.get(impl, "tab:gray"),
            label=_label(impl, dtype, residual, split, value, len(dtypes) > 1),
        )
    for ax, op in zip(axes, OPS):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([_tick(v, xkey) for v in xs], rotation=45 if len(xs) > 6 else 0)
        ax.minorticks_off()
        ax.set_xlabel("hidden size H" if xkey == "H" else "rows T")
        ax.set_title(f"{op}  (bytes: {OP_BYTES[op]})", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
    axes[0].set_ylabel("TB/s ÷ device-copy TB/s")
    axes[0].set_ylim(bottom=0)
    labels = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(list(labels.values()), list(labels), loc="center right", fontsize=8, frameon=False)
    fig.suptitle(
        f"RMSNorm {'/'.join(dtypes)} vs device copy — {doc.get('gpu', '?')} — {doc.get('date', '?')} — "
        f"commit {doc.get('commit', '?')}"
    )
    fig.tight_layout(rect=(0, 0, 0.84, 0.95))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)


def plot_results(doc: dict | Path, png: Path) -> bool:
    """Draw ``doc`` (a results document or the path of its JSON) into ``png``.

    Returns
    -------
    bool
        False, with a note on stderr, when matplotlib is missing or no row can be plotted.
    """
    if not isinstance(doc, dict):
        doc = load_json(Path(doc))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"note: plot skipped: {MATPLOTLIB_HINT}", file=sys.stderr)
        return False
    rows = plottable(doc)
    if not rows:
        print("note: no successful rows to plot; plot skipped", file=sys.stderr)
        return False
    draw(doc, rows, Path(png))
    print(f"plot written to {png}")
    return True


def merged_document(docs: list[dict], paths: list[Path]) -> dict:
    """One document from several (later files win on equal rows), e.g. a sweep split over commands."""
    doc = dict(docs[-1])
    rows: list[dict] = []
    for d in docs:
        rows = merge_rows(rows, d["rows"])
    doc["rows"] = rows
    if len(docs) > 1:
        doc["merged_from"] = [str(path) for path in paths]
        doc["notes"] = [n for d in docs for n in d.get("notes", [])]
        doc["complete"] = all(d.get("complete", True) for d in docs)
        commits = sorted({str(d.get("commit")) for d in docs})
        if len(commits) > 1:
            print(f"warning: merging results of different commits {commits}", file=sys.stderr)
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/plot.py",
        description="Print and plot cake-cute bench results JSON files (no GPU needed).",
    )
    p.add_argument("json", type=Path, nargs="+", help="results JSON written by cake-cute bench")
    p.add_argument("-o", "--output", type=Path, help="PNG path (default: the (merged) JSON path with .png)")
    p.add_argument("--write-json", type=Path, help="write the merged results to this JSON file")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/plot.py results.json [more.json ...] [-o out.png] [--write-json merged.json]``.

    Returns
    -------
    int
        0; 2 for a file that is not a results file, or when the PNG is asked for without matplotlib
        (checked before anything is read); 1 when no row can be plotted.
    """
    args = build_parser().parse_args(argv)
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                f"benchmarks/plot.py: {MATPLOTLIB_HINT}; or pass --no-plot for the table alone",
                file=sys.stderr,
            )
            return EXIT_NO_MATPLOTLIB
    try:
        docs = [load_json(path) for path in args.json]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = merged_document(docs, args.json)
    if args.write_json:
        write_json(args.write_json, doc)
        print(f"merged results written to {args.write_json} ({len(doc['rows'])} rows)")
    if not args.no_table:
        print(f"{doc.get('gpu', '?')}  {doc.get('date', '?')}  commit {doc.get('commit', '?')}")
        print(format_table(doc["rows"]))
    if args.no_plot:
        return 0
    return (
        0 if plot_results(doc, args.output or (args.write_json or args.json[-1]).with_suffix(".png")) else 1
    )
