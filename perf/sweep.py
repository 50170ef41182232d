#!/usr/bin/env python
"""``python perf/sweep.py [options]`` is ``cake-cute bench [options]`` (``cake_cute.tools.bench``): the
per-shape performance sweep (cake_cute vs torch, torch.compile, Liger, quack + a device-copy ceiling).
See perf/README.md.

Works with cake_cute installed (``pip install -e .``) and from a bare source tree: then the repository
root goes on ``sys.path`` and ``kernels/`` is registered as ``cake_cute.kernels`` (what pyproject's
package-dir mapping does for an install)."""

import importlib.util
import sys
from pathlib import Path

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


if __name__ == "__main__":
    _use_source_tree()
    from cake_cute.tools.bench.cli import main

    raise SystemExit(main(sys.argv[1:]))
