#!/usr/bin/env python
"""``python benchmarks/sweep.py [options]`` is ``cake-cute bench [options]`` (``cake_cute.tools.bench``): the
per-shape performance sweep (cake_cute vs torch, torch.compile, Liger, quack + a device-copy ceiling).
See benchmarks/README.md.

Works with cake_cute installed (``pip install -e .``) and from a bare source tree (the repository root
goes on ``sys.path``)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _use_source_tree() -> None:
    """The repository root on ``sys.path`` (nothing changes for an install): ``cake_cute`` from this tree,
    and ``tests.distributed_harness`` for the scripts that build its model."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


if __name__ == "__main__":
    _use_source_tree()
    from cake_cute.tools.bench.cli import main

    raise SystemExit(main(sys.argv[1:]))
