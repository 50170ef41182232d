"""Result rows of a sweep: the row schema, the printed table, and the JSON file (one row per line).

Standard library only, so results can be read, merged and printed without torch or a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

OPS = ("fwd", "bwd")
PEERS = ("torch", "compile", "liger", "quack")
IMPLS = ("cake_cute", *PEERS)
REPO = Path(__file__).resolve().parents[3]
# Every row has these; a row that measured has numbers in the last four, an error row has "error".
ROW_KEY_FIELDS = ("impl", "op", "residual", "dtype", "T", "H")
ROW_NUMBER_FIELDS = ("gpu_us", "tbps", "copy_tbps", "frac_copy")

TIMING_METHOD = {
    "us": "median over --reps calls of CUDA-event time around ONE call through the public autograd path, "
    "GPU idle before each call (synchronize), so host work (validation, dispatch, launch) is included; "
    "bwd = torch.autograd.grad(outputs, (x, w[, residual]), fixed upstream grads, retain_graph=True) "
    "on a graph built once outside the timed region",
    "gpu_us": "median over --prof-reps calls of the device time of everything one call launches: CUDA "
    "events recorded around the call while a spin kernel holds the stream, so the call's kernels are "
    "all queued before the start event fires and no host time is included (a call whose host side "
    "outlasts the spin is measured again with a longer spin); the calls rotate through buffer_sets "
    "input sets whose bytes exceed twice the L2, so no input is L2-resident (except --grid small)",
    "host_us": "us - gpu_us",
    "kernel_us": "--grid small only: mean over --prof-reps calls of the summed profiler (CUPTI) durations "
    "of the kernels and copies one call launches, without the gaps between gpu_us's events and the "
    "first and last kernel; copy_kernel_us: the same for the faster copy of the ceiling",
    "bytes": "fwd: read x (+residual) and w, write y (+h_new) and rstd (4 bytes/row); "
    "bwd: read g and x (+g_residual), write dx (w, rstd and dw are not counted)",
    "tbps": "bytes / gpu_us / 1e6 (TB/s)",
    "target_frac_copy": "rows whose call moves >= 32 MiB only: the fraction of the copy the call is held to "
    "(0.95 fwd, 0.90 bwd); the table marks a row below it with '<'",
    "copy_tbps": "device-to-device copy of bytes/2 into another buffer (read + write = bytes), timed "
    "exactly like gpu_us with the same rotation; the faster of cudaMemcpyAsync (tensor.copy_) and an "
    "elementwise copy kernel (torch.neg on an fp32 view)",
}


def slugify(text: str) -> str:
    """A GPU name as a file-name part: ``NVIDIA H200`` -> ``nvidia-h200``."""
    s = re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")
    return s or "unknown-gpu"


def default_json_path(
    gpu: str, date: str, grid: str = "standard", dtypes: tuple[str, ...] = ("bf16",), root: Path | None = None
) -> Path:
    """``<date>-<gpu>[-<grid>][-<dtypes>].json`` in the ``evidence`` folder of the repository, or of the
    working directory when installed."""
    if root is None:
        root = REPO if (REPO / "evidence").is_dir() and (REPO / "pyproject.toml").is_file() else Path.cwd()
    suffix = {"standard": "", "small": "-small", "training": "-training-shapes", "headdim": "-headdim"}[grid]
    if list(dtypes) != ["bf16"]:
        suffix += "-" + "-".join(dtypes)
    return Path(root) / "evidence" / f"{date}-{slugify(gpu)}{suffix}.json"


def _git(*args: str) -> str | None:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    """``$CAKE_CUTE_COMMIT``, else the checkout's short ``HEAD`` (+ ``-dirty``), else ``unknown``."""
    if os.environ.get("CAKE_CUTE_COMMIT"):
        return os.environ["CAKE_CUTE_COMMIT"]
    try:
        commit = _git("rev-parse", "--short", "HEAD") if (REPO / ".git").exists() else None
        if commit:
            return commit + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def row_key(row: dict) -> tuple:
    """What a row measured: (impl, op, residual, dtype, T, H); --append and merges replace on it."""
    return tuple(bool(row.get(k)) if k == "residual" else row.get(k) for k in ROW_KEY_FIELDS)


def schema_problems(row: dict) -> list[str]:
    """What a result row lacks: a key field, or (unless it is an error row) a number field."""
    missing = [k for k in ROW_KEY_FIELDS if k not in row]
    if "error" not in row:
        missing += [k for k in ROW_NUMBER_FIELDS if not isinstance(row.get(k), (int, float))]
    return [f"missing {k}" for k in missing]


def impl_rank(impl: str) -> int:
    """cake_cute first, then the peers in their usual order, then anything else."""
    return IMPLS.index(impl) if impl in IMPLS else len(IMPLS)


def sort_rows(rows: list[dict]) -> list[dict]:
    """Rows by dtype, op (fwd first), residual, H, T and implementation."""
    return sorted(
        rows,
        key=lambda r: (
            r.get("dtype", ""),
            OPS.index(r["op"]) if r.get("op") in OPS else 9,
            bool(r.get("residual")),
            r.get("H", 0),
            r.get("T", 0),
            impl_rank(r.get("impl", "")),
        ),
    )


def _fmt(value, spec: str) -> str:
    if value is None:
        width = re.match(r"\d*", spec).group(0)
        return "-".rjust(int(width)) if width else "-"
    return format(value, spec)


def _target_mark(row: dict) -> str:
    """' <0.95' after a row below the copy fraction it is held to, ' >=0.95' after one that meets it."""
    target, frac = row.get("target_frac_copy"), row.get("frac_copy")
    if target is None or frac is None:
        return ""
    return f" {'<' if frac < target else '>='}{target:.2f}"


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
            + _target_mark(r)
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
    """A results document; ValueError for a JSON file that is not one (no ``rows`` list)."""
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
