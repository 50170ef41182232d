"""Hash the SASS of a representative kernel matrix, to show that a refactor left the machine code alone.

    python scripts/sass_hashes.py dump OUT.json [--jobs N]   # compile the matrix into a temporary cache
    python scripts/sass_hashes.py dump OUT.json --kinds fwd,gated_bwd --hidden 7,4096   # a part of it
    python scripts/sass_hashes.py compare BEFORE.json AFTER.json

The matrix: forward and backward x {sm_90a, sm_100a} x {bf16, fp32} x H x residual off/on, the
memory-efficient backward x arch x dtype x a few H x residual off/on, the dW
reduction x arch x output dtype x H, the forwards to FP8 (both recipes, bf16) x arch x a few H x
residual off/on, their persistent kernels (bf16 and fp32, plain mode, two H), and the gated forward,
its statistics alone and the gated backward x arch x dtype x (H, group size, form) x gate activation
(SiLU, sigmoid): norm then gate from an unvectorized H = 7 to the widest segment, gate then norm with
one group and with several (up to H = 65536). Each variant is compiled through the package's own
cache, its cubin cut out of the exported object (``cake_cute.tools.cubin.fatbin_from_object``) and
disassembled with ``cuobjdump -sass``. The hash covers the instruction stream (addresses, opcodes,
operands, encodings) with the kernel symbol names replaced by a placeholder, so a renamed Python class
or method does not count as a change while any changed instruction does. ``compare`` prints every
label whose hash differs and exits 1 if any does. ``--match``, ``--kinds`` and ``--hidden`` dump a
part of the matrix (456 variants in all); ``compare`` then compares the labels of the smaller dump.

The script runs against whichever ``cake_cute`` the interpreter imports, so the same file measures an
older checkout (``git worktree add``) and the current one.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import NamedTuple

ARCHS = ("sm_90a", "sm_100a")
DTYPES = ("bf16", "fp32")
HIDDEN = (1, 7, 1024, 4096, 5120, 7168, 8192, 16384, 65536, 131072)
FROM_OUTPUT_HIDDEN = (7, 1024, 7168, 65536, 131072)  # 131072 fp32 keeps dW in shared memory
QUANT_KINDS = ("fwd_mxfp8", "fwd_1x128")
QUANT_HIDDEN = (4096, 5120, 7168, 65536)
PERSISTENT_QUANT_HIDDEN = (2048, 4096)  # plain mode only
GATED_KINDS = ("gated_fwd", "gated_rstd", "gated_bwd")
GATE_ACTIVATIONS = ("silu", "sigmoid")
# Norm then gate, the row one group: short rows several to a CTA, one CTA per row, and the backward's
# segments wider than 4096 (over a cluster). Gate then norm: (H, group size), one group per row and
# several.
NORM_THEN_GATE_HIDDEN = (7, 128, 4096, 8192)
GATE_THEN_NORM_GROUPS = ((4096, 4096), (1024, 128), (65536, 8192))
_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)


class Variant(NamedTuple):
    """One row of the matrix; for "dw" the dtype is the output's."""

    kind: str
    arch: str
    dtype: str
    hidden: int
    residual: bool = False
    memory_efficient: bool = False  # "bwd" only
    group_size: int = 0  # the gated kinds only
    norm_before_gate: bool = True  # the gated kinds only
    activation: str = "silu"  # the gated kinds only


def matrix() -> list[Variant]:
    rows = []
    for kind in ("fwd", "bwd"):
        for arch in ARCHS:
            for dtype in DTYPES:
                for hidden in HIDDEN:
                    rows += [Variant(kind, arch, dtype, hidden, residual) for residual in (False, True)]
    rows += [
        Variant("bwd", arch, dtype, hidden, residual, memory_efficient=True)
        for arch in ARCHS
        for dtype in DTYPES
        for hidden in FROM_OUTPUT_HIDDEN
        for residual in (False, True)
    ]
    rows += [Variant("dw", arch, dtype, hidden) for arch in ARCHS for dtype in DTYPES for hidden in HIDDEN]
    rows += [
        Variant(kind, arch, "bf16", hidden, residual)
        for kind in QUANT_KINDS
        for arch in ARCHS
        for hidden in QUANT_HIDDEN
        for residual in (False, True)
    ]
    rows += [
        Variant(f"{kind}_persistent", arch, dtype, hidden)
        for kind in QUANT_KINDS
        for arch in ARCHS
        for dtype in DTYPES
        for hidden in PERSISTENT_QUANT_HIDDEN
    ]
    gated_cases = [(hidden, hidden, True) for hidden in NORM_THEN_GATE_HIDDEN]
    gated_cases += [(hidden, group_size, False) for hidden, group_size in GATE_THEN_NORM_GROUPS]
    rows += [
        Variant(kind, arch, dtype, hidden, group_size=group, norm_before_gate=nbg, activation=activation)
        for activation in GATE_ACTIVATIONS
        for kind in GATED_KINDS
        for arch in ARCHS
        for dtype in DTYPES
        for hidden, group, nbg in gated_cases
    ]
    return rows


def label(row: Variant) -> str:
    """``kind-arch-dtype-H``, then what else names the variant: ``-res``, ``-fromy`` (the memory-efficient
    backward), ``-L<group size>-nbg`` or ``-gbn`` (the gated kinds' form), ``-sigmoid`` (the gated
    kinds' gate activation, when not SiLU)."""
    text = f"{row.kind}-{row.arch}-{row.dtype}-H{row.hidden}" + ("-res" if row.residual else "")
    if row.memory_efficient:  # the label older dumps used
        text += "-fromy"
    if row.kind in GATED_KINDS:
        text += f"-L{row.group_size}-" + ("nbg" if row.norm_before_gate else "gbn")
        text += "" if row.activation == "silu" else f"-{row.activation}"
    return text


def make_spec(row: Variant):
    """The package's spec for one row of the matrix (the current API, else the one before it)."""
    try:
        from cake_cute.runtime.specs import KernelSpec, ReduceSpec
    except ImportError:  # the layout before the restructure: one spec class, dw's dtype in act_dtype
        from cake_cute.runtime.cache import KernelSpec

        if row.kind == "dw":
            return KernelSpec("dw", row.arch, row.dtype, "fp32", row.hidden)
        return KernelSpec(row.kind, row.arch, row.dtype, row.dtype, row.hidden, row.residual)
    if row.kind == "dw":
        return ReduceSpec(row.arch, row.dtype, row.hidden)
    if row.kind in GATED_KINDS:
        from cake_cute.runtime.specs import GatedSpec

        # Named only when not SiLU: a package from before the sigmoid gate has no such field.
        activation = {} if row.activation == "silu" else {"activation": row.activation}
        return GatedSpec(
            row.kind,
            row.arch,
            row.dtype,
            row.dtype,
            row.hidden,
            row.group_size,
            row.norm_before_gate,
            **activation,
        )
    spec = KernelSpec(row.kind, row.arch, row.dtype, row.dtype, row.hidden, row.residual)
    if not row.memory_efficient:
        return spec
    # The field's name before the memory-efficient mode kept one name down to the spec: from_output.
    field = "memory_efficient" if hasattr(spec, "memory_efficient") else "from_output"
    return dataclasses.replace(spec, **{field: True})


def normalized_sass(sass: str) -> tuple[str, list[str]]:
    """The SASS text with every kernel symbol name replaced by ``<kernel>``, and those names."""
    names = sorted(set(_FUNCTION.findall(sass)), key=len, reverse=True)
    for name in names:
        sass = sass.replace(name, "<kernel>")
    return sass, sorted(names)


def sass_of(row: Variant) -> dict:
    from cake_cute.runtime.cache import get_kernel, object_path

    try:
        from cake_cute.tools.cubin import fatbin_from_object, find_tool
    except ImportError:  # before the tools moved into their subpackage
        from cake_cute.cubin import fatbin_from_object, find_tool

    spec = make_spec(row)
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
        "label": label(row),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "instructions": instructions,
        "kernels": names,
    }


def selected(match: str | None, kinds: set[str] | None, hidden: set[int] | None) -> list[Variant]:
    """The rows of the matrix whose label contains ``match``, of one of ``kinds`` and with one of the
    ``hidden`` sizes (None: no restriction)."""
    return [
        row
        for row in matrix()
        if (match is None or match in label(row))
        and (kinds is None or row.kind in kinds)
        and (hidden is None or row.hidden in hidden)
    ]


def dump(out: Path, jobs: int, rows: list[Variant]) -> None:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CAKE_CUTE_CACHE_DIR"] = cache  # a fresh cache: every variant is compiled here
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            results = list(pool.map(sass_of, rows))
    out.write_text(json.dumps({r["label"]: r for r in results}, indent=1, sort_keys=True) + "\n")
    print(f"{len(results)} variants -> {out}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    if len(b) < len(a):  # a partial run (--match, --kinds, --hidden) is compared on its own labels
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
    d.add_argument("--kinds", help="only these kinds, comma-separated, e.g. fwd,bwd,gated_fwd,gated_bwd")
    d.add_argument("--hidden", help="only these H, comma-separated, e.g. 7,4096,65536")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        kinds = set(args.kinds.split(",")) if args.kinds else None
        hidden = {int(h) for h in args.hidden.split(",")} if args.hidden else None
        dump(args.out, args.jobs, selected(args.match, kinds, hidden))
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
