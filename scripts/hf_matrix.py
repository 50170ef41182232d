"""The Hugging Face family table: runs the conformance matrix (``tests/test_hf_conformance_cpu.py``) and
writes family x check, read from the run's JUnit XML, to the installed transformers version's section of
``docs/hf_families.md``; then classifies every decoder-layer class of that transformers that sits beside an
RMSNorm by the fusion templates. The other versions' sections are kept: run it once in the environment
of each declared transformers version (``scripts/hf_versions.sh`` does) to fill the file.

    python scripts/hf_matrix.py                       # run the matrix, write this version's section
    python scripts/hf_matrix.py --junit run.xml       # from an earlier run's --junitxml
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MATRIX = "tests/test_hf_conformance_cpu.py"

# (test function, parameter variant or None, column heading)
CHECKS = (
    ("test_swap_and_fuse_counts", None, "swap + fuse counts"),
    ("test_fp32_matches_the_untouched_model", None, "fp32 vs untouched"),
    ("test_bf16", None, "bf16"),
    ("test_autocast", None, "autocast, fp32 weights"),
    ("test_checkpointing", "non_reentrant", "checkpointing"),
    ("test_checkpointing", "reentrant", "checkpointing, reentrant"),
    ("test_save_and_load", None, "save / load"),
    ("test_compile", None, "compile fullgraph"),
)
_CASE = re.compile(r"^(?P<test>\w+)\[(?P<params>[^\]]+)\]$")


def outcomes(junit: Path) -> dict[tuple[str, str, str | None], str]:
    """{(test, family, variant): "passed" / "failed" / "skipped"} from a pytest JUnit XML file."""
    results = {}
    for case in ET.parse(junit).iter("testcase"):
        match = _CASE.match(case.get("name", ""))
        if match is None:
            continue
        family, *variant = match["params"].split("-")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        results[(match["test"], family, variant[0] if variant else None)] = outcome
    return results


_MARKS = {"passed": "✓", "failed": "✗ failed", "skipped": "skipped"}


def _cell(results, test, family, variant, refused: bool) -> str:
    outcome = results.get((test, family, variant))
    if outcome is not None:
        return _MARKS[outcome]
    return "nothing to fuse" if refused else "not in the CI subset"


def family_rows(results) -> list[str]:
    """The markdown rows of the family table: template, counts and one cell per check."""
    sys.path.insert(0, str(ROOT))
    from cake_cute.hf.plans import _layer_plan
    from tests.test_hf_conformance_cpu import FAMILIES, LAYERS, tiny

    rows = []
    for name, family in FAMILIES.items():
        try:
            layer = tiny(name).model.layers[0]
        except pytest.skip.Exception as skipped:  # absent from this transformers, or not runnable
            rows.append(f"| {name} | – | {skipped.msg} |" + " |" * (len(CHECKS) + 2))
            continue
        try:
            template, fused = _described(_layer_plan(type(layer))), str(2 * LAYERS)
        except ValueError:
            template, fused = "post-norm: refused", "0"
        cells = [
            _cell(results, test, name, variant, family.refusal is not None) for test, variant, _ in CHECKS
        ]
        swapped = f"{family.norms_per_layer}·L + 1"
        rows.append(
            f"| {name} | `{type(layer).__name__}` | {template} | {swapped} | {fused} | "
            + " | ".join(cells)
            + " |"
        )
    return rows


def _described(plan) -> str:
    """The template a plan matched and the parts of the forward around it (branch ops, the 4.x forms)."""
    ops = [f"`{b.attr or 'view'}`" for b in (plan.attention_branch, plan.mlp_branch) if b.kind != "identity"]
    parts = [f"branch ops {', '.join(ops)}"] if ops else []
    if plan.mlp_output != "plain":
        parts.append(f"router logits: {plan.mlp_output}")
    if plan.outputs is not None:
        parts.append("outputs tuple")
    if plan.setup is not None:
        parts.append("setup statements")
    return plan.template + (f" ({'; '.join(parts)})" if parts else "")


def scanned_rows() -> list[str]:
    """One row per decoder-layer class of the installed transformers whose modeling module defines an
    RMSNorm class: the template it matches, or why it is refused."""
    import transformers.models

    from cake_cute.hf.plans import _layer_plan

    rows = []
    for info in sorted(pkgutil.iter_modules(transformers.models.__path__), key=lambda i: i.name):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # no modeling module, or one that needs an optional dependency
            continue
        classes = {
            n: c for n, c in vars(module).items() if inspect.isclass(c) and c.__module__ == module.__name__
        }
        if not any(n.endswith("RMSNorm") for n in classes):
            continue
        for class_name, cls in classes.items():
            if not class_name.endswith("DecoderLayer") or "forward" not in vars(cls):
                continue
            try:
                verdict = _layer_plan(cls).template
            except ValueError as e:
                reason = str(e).split(": ", 1)[1].split("; use swap_rmsnorm")[0]
                verdict = "refused: " + re.sub(r" \(/[^)]*\)", "", reason)  # no install paths in the docs
            verdict = verdict.replace("|", "\\|").replace("\n", " ")
            rows.append(f"| {info.name} | `{class_name}` | {verdict} |")
    return rows


HEADER = (
    "# Hugging Face families: what cake_cute's swap and fusion do\n"
    "\n"
    "One section per transformers version the package declares (the oldest and the newest are run in CI "
    "by `scripts/hf_versions.sh`), each generated by `python scripts/hf_matrix.py` in that version's "
    f"environment from a run of `{MATRIX}`. Tiny random-weight models: L = 2 layers, hidden 64, vocab 128, "
    "8 tokens. ✓: the test passed; what each check compares and its tolerance is in the test file's "
    "docstring. The GPU subset is `tests/test_gpu_hf_conformance.py`.\n"
)
SECTION = "## transformers "


def render(results) -> str:
    """The installed transformers version's section of ``docs/hf_families.md``."""
    import torch
    import transformers

    headings = ["family", "decoder layer", "template", "norms swapped", "adds fused / step"]
    headings += [heading for _, _, heading in CHECKS]
    lines = [
        f"{SECTION}{transformers.__version__}",
        "",
        f"torch {torch.__version__}, {datetime.date.today().isoformat()}, CPU.",
        "",
        "| " + " | ".join(headings) + " |",
        "|" + "---|" * len(headings),
        *family_rows(results),
        "",
        f"### Every decoder layer of transformers {transformers.__version__} beside an RMSNorm",
        "",
        "The template each class's forward matches (`cake_cute.hf.templates.TEMPLATES`), read from its "
        "source; a refused class runs with `swap_rmsnorm` alone. Not run, only classified.",
        "",
        "| model | decoder layer | fusion |",
        "|---|---|---|",
        *scanned_rows(),
        "",
    ]
    return "\n".join(lines)


def merged(document: str, section: str) -> str:
    """``document`` (the file as it is, possibly empty or from before the per-version layout) with
    ``section`` in place of the section of the same transformers version, the sections ordered by
    version and ``HEADER`` first.

    Parameters
    ----------
    document : str
        The current contents of ``docs/hf_families.md``.
    section : str
        ``render``'s output: starts with ``SECTION`` and the version.

    Returns
    -------
    str
        The new contents.
    """
    from packaging.version import Version

    sections = {}
    for part in ("\n" + document).split("\n" + SECTION)[1:]:
        version, _, _ = part.partition("\n")
        sections[version.strip()] = SECTION + part.rstrip("\n") + "\n"
    version = section[len(SECTION) :].partition("\n")[0].strip()
    sections[version] = section.rstrip("\n") + "\n"
    ordered = sorted(sections, key=Version)
    return HEADER + "".join("\n" + sections[v] for v in ordered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "hf_families.md")
    parser.add_argument("--junit", type=Path, help="an existing JUnit XML of the matrix (skips the run)")
    args = parser.parse_args()
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "matrix.xml"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, f"--junitxml={junit}"],
            cwd=ROOT,
            check=False,  # a failing check is a ✗ in the table, not a missing table
        )
    document = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(merged(document, render(outcomes(junit))))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
