"""Hash the SASS of a representative kernel matrix, to show that a refactor left the machine code alone.

    python scripts/sass_hashes.py dump OUT.json [--jobs N]   # compile the matrix into a temporary cache
    python scripts/sass_hashes.py compare BEFORE.json AFTER.json

The matrix: forward and backward x {sm_90a, sm_100a} x {bf16, fp32} x H x residual off/on, the dW
reduction x arch x output dtype x H, the forwards to FP8 (both recipes, bf16) x arch x a few H x
residual off/on, and their persistent kernels (bf16 and fp32, plain mode, two H). Each variant is
compiled through the package's own cache, its cubin cut out of the exported object
(``cake_cute.tools.cubin.fatbin_from_object``) and disassembled with ``cuobjdump -sass``. The hash
covers the instruction stream (addresses, opcodes, operands, encodings) with the kernel symbol names
replaced by a placeholder, so a renamed Python class or method does not count as a change while any
changed instruction does. ``compare`` prints every label whose hash
differs and exits 1 if any does.

The script runs against whichever ``cake_cute`` the interpreter imports, so the same file measures an
older checkout (``git worktree add``) and the current one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ARCHS = ("sm_90a", "sm_100a")
DTYPES = ("bf16", "fp32")
HIDDEN = (1, 7, 1024, 4096, 5120, 7168, 8192, 16384, 65536, 131072)
QUANT_KINDS = ("fwd_mxfp8", "fwd_1x128")
QUANT_HIDDEN = (4096, 5120, 7168, 65536)
PERSISTENT_QUANT_HIDDEN = (2048, 4096)  # plain mode only
_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)


def matrix() -> list[tuple[str, str, str, int, bool]]:
    """(kind, arch, dtype, H, residual); for "dw" the dtype is the output's."""
    rows = []
    for kind in ("fwd", "bwd"):
        for arch in ARCHS:
            for dtype in DTYPES:
                for hidden in HIDDEN:
                    rows += [(kind, arch, dtype, hidden, residual) for residual in (False, True)]
    rows += [("dw", arch, dtype, hidden, False) for arch in ARCHS for dtype in DTYPES for hidden in HIDDEN]
    rows += [
        (kind, arch, "bf16", hidden, residual)
        for kind in QUANT_KINDS
        for arch in ARCHS
        for hidden in QUANT_HIDDEN
        for residual in (False, True)
    ]
    rows += [
        (f"{kind}_persistent", arch, dtype, hidden, False)
        for kind in QUANT_KINDS
        for arch in ARCHS
        for dtype in DTYPES
        for hidden in PERSISTENT_QUANT_HIDDEN
    ]
    return rows


def label(kind: str, arch: str, dtype: str, hidden: int, residual: bool) -> str:
    return f"{kind}-{arch}-{dtype}-H{hidden}" + ("-res" if residual else "")


def make_spec(kind: str, arch: str, dtype: str, hidden: int, residual: bool):
    """The package's spec for one row of the matrix (the current API, else the one before it)."""
    try:
        from cake_cute.specs import KernelSpec, ReduceSpec
    except ImportError:  # the layout before the restructure: one spec class, dw's dtype in act_dtype
        from cake_cute.compile_cache import KernelSpec

        if kind == "dw":
            return KernelSpec("dw", arch, dtype, "fp32", hidden)
        return KernelSpec(kind, arch, dtype, dtype, hidden, residual)
    if kind == "dw":
        return ReduceSpec(arch, dtype, hidden)
    return KernelSpec(kind, arch, dtype, dtype, hidden, residual)


def normalized_sass(sass: str) -> tuple[str, list[str]]:
    """The SASS text with every kernel symbol name replaced by ``<kernel>``, and those names."""
    names = sorted(set(_FUNCTION.findall(sass)), key=len, reverse=True)
    for name in names:
        sass = sass.replace(name, "<kernel>")
    return sass, sorted(names)


def sass_of(row) -> dict:
    from cake_cute.compile_cache import get_kernel, object_path

    try:
        from cake_cute.tools.cubin import fatbin_from_object, find_tool
    except ImportError:  # before the tools moved into their subpackage
        from cake_cute.cubin import fatbin_from_object, find_tool

    spec = make_spec(*row)
    get_kernel(spec)
    fatbin = fatbin_from_object(object_path(spec).read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.fatbin"
        path.write_bytes(fatbin)
        sass = subprocess.run(
            [str(find_tool("cuobjdump")), "-sass", str(path)], capture_output=True, text=True, check=True
        ).stdout
    text, names = normalized_sass(sass)
    instructions = sum(1 for line in text.splitlines() if re.match(r"^\s*/\*[0-9a-f]{4,}\*/", line))
    return {
        "label": label(*row),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "instructions": instructions,
        "kernels": names,
    }


def dump(out: Path, jobs: int, match: str | None) -> None:
    rows = [row for row in matrix() if match is None or match in label(*row)]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CAKE_CUTE_CACHE_DIR"] = cache  # a fresh cache: every variant is compiled here
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            results = list(pool.map(sass_of, rows))
    out.write_text(json.dumps({r["label"]: r for r in results}, indent=1, sort_keys=True) + "\n")
    print(f"{len(results)} variants -> {out}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    if len(b) < len(a):  # a partial run (--match) is compared on its own labels
        a = {k: v for k, v in a.items() if k in b}
    differ = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'after' if key not in a else 'before'}")
            differ += 1
        elif a[key]["sha256"] != b[key]["sha256"]:
            print(f"{key}: SASS differs ({a[key]['instructions']} -> {b[key]['instructions']} instructions)")
            differ += 1
    renamed = sum(1 for k in set(a) & set(b) if a[k]["kernels"] != b[k]["kernels"])
    print(
        f"{len(set(a) & set(b))} variants compared: {differ} differ in their instruction streams, "
        f"{renamed} have renamed kernel symbols"
    )
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--jobs", type=int, default=2)
    d.add_argument("--match", help="only the variants whose label contains this, e.g. bwd-sm_90a")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.out, args.jobs, args.match)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
