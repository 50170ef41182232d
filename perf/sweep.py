#!/usr/bin/env python
"""``python perf/sweep.py [options]`` is ``cake-cute bench [options]`` (``cake_cute.tools.bench``): the
per-shape performance sweep (cake_cute vs torch, torch.compile, Liger, quack + a device-copy ceiling).
See perf/README.md.

Works with cake_cute installed (``pip install -e .``) and from a bare source tree (the repository root
goes on ``sys.path``)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from cake_cute.tools.bench.cli import main

    raise SystemExit(main(sys.argv[1:]))
