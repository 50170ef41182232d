#!/usr/bin/env python
"""``python perf/plot.py results.json [-o out.png]``: print the table of a cake-cute bench results JSON and
draw its PNG (fwd | bwd panels, fraction of device-copy bandwidth vs H). Needs only matplotlib: the
helpers are loaded straight from cake_cute/bench.py, so neither torch nor a GPU is required."""

import importlib.util
import sys
from pathlib import Path


def _load_bench():
    path = Path(__file__).resolve().parents[1] / "cake_cute" / "bench.py"
    spec = importlib.util.spec_from_file_location("_cake_cute_bench_standalone", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    raise SystemExit(_load_bench().plot_main(sys.argv[1:]))
