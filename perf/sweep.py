#!/usr/bin/env python
"""``python perf/sweep.py [options]`` is ``cake-cute bench [options]`` (``cake_cute.tools.bench``): the
per-shape performance sweep (cake_cute vs torch, torch.compile, Liger, quack + a device-copy ceiling).
See perf/README.md.

Works with cake_cute installed (``pip install -e .``) and from a bare source tree: then the repository
root goes on ``sys.path`` and ``kernels/`` is registered as ``cake_cute.kernels`` (what pyproject's
package-dir mapping does for an install)."""

import importlib
import importlib.util
import sys
from pathlib import Path

from plot import STANDALONE, load_bench_package

ROOT = Path(__file__).resolve().parents[1]


def _use_source_tree() -> None:
    try:
        import cake_cute.kernels.config  # noqa: F401  (installed / editable: nothing to do)

        return
    except ImportError:
        for name in [m for m in sys.modules if m == "cake_cute" or m.startswith("cake_cute.")]:
            del sys.modules[name]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    init = ROOT / "kernels" / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(
            "cake_cute.kernels", init, submodule_search_locations=[str(init.parent)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["cake_cute.kernels"] = module
        spec.loader.exec_module(module)
        import cake_cute

        cake_cute.kernels = module


def _bench_main():
    try:
        _use_source_tree()
        from cake_cute.tools.bench.cli import main

        return main
    except ImportError as e:  # cake_cute itself cannot import: peers can still be timed
        print(f"note: cake_cute does not import ({e}); its rows will carry the error", file=sys.stderr)
        load_bench_package()
        return importlib.import_module(f"{STANDALONE}.cli").main


if __name__ == "__main__":
    raise SystemExit(_bench_main()(sys.argv[1:]))
