"""The Python blocks of README.md and docs/*.md marked ``<!-- gpu -->`` run as written on the GPU (the
convention: ``tests/_doc_blocks.py``)."""

from __future__ import annotations

import pytest

from ._doc_blocks import python_blocks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block", python_blocks("gpu"), ids=lambda b: b.id)
def test_gpu_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.id, "exec"), {"__name__": "__doc_block__"})
