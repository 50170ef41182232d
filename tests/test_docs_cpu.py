"""The docs cannot drift from the code: every Python block of README.md and docs/*.md runs (on the CPU
here, the GPU ones in ``test_gpu_docs.py``) or says why not, and every signature the pages print is the
code's (``inspect.signature``): the API tables' of README.md and docs/SPEC.md, the signature blocks', and
every prose code span ``name(..., *, ...)`` (a bare ``*`` makes it a signature, not a call). The
convention a page follows is ``tests/_doc_blocks.py``'s docstring.
"""

from __future__ import annotations

import pytest

import cake_cute

from ._doc_blocks import (
    PAGES,
    ROOT,
    blocks,
    keyword_only_signatures,
    mismatches,
    printed_calls,
    python_blocks,
    signature_target,
    table_signatures,
)

README, SPEC = ROOT / "README.md", ROOT / "docs" / "SPEC.md"
PUBLIC = set(cake_cute.__all__)
README_LIMIT = 15_000  # bytes: details belong in docs/


def test_every_fence_names_its_language():
    unnamed = [b.id for b in blocks() if not b.language]
    assert not unnamed, f"fences without a language (tests/_doc_blocks.py says why): {unnamed}"


def test_every_comment_before_a_fence_is_a_marker_of_a_python_block():
    """A comment just before a fence is one of the markers, spelled exactly, and marks a Python block
    (the others never run): a misspelt marker would otherwise leave a block to run unmarked."""
    wrong = [
        f"{b.id}: {b.comment}"
        for b in blocks()
        if b.comment is not None and (b.marker is None or b.language != "python")
    ]
    assert not wrong, f"not a marker of a Python block (tests/_doc_blocks.py lists them): {wrong}"


@pytest.mark.parametrize("block", python_blocks(None), ids=lambda b: b.id)
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.id, "exec"), {"__name__": "__doc_block__"})


def _signature_cases():
    for block in python_blocks("signature"):
        calls = printed_calls(block.text)
        assert calls, f"{block.id}: a signature block without a call"
        for name, parameters in calls:
            yield pytest.param(block.module, name, parameters, id=f"{block.id}:{name}")


@pytest.mark.parametrize(("module", "name", "parameters"), list(_signature_cases()))
def test_signature_block_is_the_code(module, name, parameters):
    target = signature_target(name, module)
    assert target is not None, f"{module} has no {name}"
    assert not mismatches(parameters, target), mismatches(parameters, target)


PRINTED = [
    *table_signatures(README, "API", PUBLIC),
    *table_signatures(SPEC, "Public API (module `cake_cute`)", PUBLIC),
    *(printed for page in PAGES for printed in keyword_only_signatures(page)),
]


@pytest.mark.parametrize("printed", PRINTED, ids=lambda p: p.id)
def test_printed_signature_is_the_code(printed):
    target = signature_target(printed.name or printed.subject, subject=printed.subject)
    assert target is not None, f"cake_cute has no {printed.name or printed.subject}"
    norm_forward = (printed.name or "").endswith("forward")
    problems = mismatches(printed.parameters, target, forward_of_a_norm=norm_forward)
    assert not problems, problems


def test_the_spec_prints_every_signature_whole():
    """The contract lists every parameter (the README may end a long list with ``...``)."""
    spec = [p for p in PRINTED if p.page == SPEC]
    assert spec and not [p.id for p in spec if p.parameters.rstrip().endswith("...")]


def test_the_api_tables_print_the_main_entries():
    """The signatures the tables must hold (so that a row rewritten without one shows)."""
    for page in (README, SPEC):
        documented = {p.name or p.subject for p in PRINTED if p.page == page}
        for name in ("cake_rmsnorm", "cake_rmsnorm_train_forward", "cake_rmsnorm_train_backward", "forward"):
            assert name in documented, (page.name, name)


def test_the_norm_modules_forward_is_printed_with_torch_213s_name():
    forwards = [p for p in PRINTED if p.name == "forward" and p.subject == "CakeRMSNorm"]
    assert len(forwards) == 2 and all(p.parameters.startswith("x, ") for p in forwards)


def test_the_readme_stays_short():
    assert len(README.read_bytes()) < README_LIMIT
