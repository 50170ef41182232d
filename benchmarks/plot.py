#!/usr/bin/env python
"""``python benchmarks/plot.py results.json [more.json ...] [-o out.png] [--write-json merged.json]``: the
table and PNG of cake-cute bench results (``cake_cute.tools.bench.plot``). Needs only matplotlib: the plot and
results modules are loaded from the source tree as a standalone package, so neither torch nor a GPU is
required."""

import importlib
import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "cake_cute" / "tools" / "bench"
STANDALONE = "_cake_cute_bench"


def load_bench_package():
    """``cake_cute/tools/bench`` as the package ``_cake_cute_bench``, without running
    ``cake_cute/__init__.py`` (which imports torch and the DSL)."""
    if STANDALONE not in sys.modules:
        init = BENCH_DIR / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            STANDALONE, init, submodule_search_locations=[str(BENCH_DIR)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[STANDALONE] = module
        spec.loader.exec_module(module)
    return sys.modules[STANDALONE]


if __name__ == "__main__":
    load_bench_package()
    raise SystemExit(importlib.import_module(f"{STANDALONE}.plot").main(sys.argv[1:]))
