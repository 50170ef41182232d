#!/usr/bin/env python
"""``python benchmarks/torchtitan_loss.py OUT.json [--cases 1proc,fsdp2,tp2_sp_compile,qwen35_tp2]``:
torchtitan's own trainer on its llama3 debug model (or, the ``qwen35_`` cases, its Qwen3.5 debug model),
10 steps on CPU (gloo), the stock norms against cake_cute enabled by its override line (and the Llama
3 fused-residual override, and the memory-efficient keyword; for Qwen3.5 its offset and gated norms'
line), loss curves step by step.

The runs and the CPU settings are those of ``tests/torchtitan_harness`` (the same as
``CAKE_CUTE_TORCHTITAN_RUNS=1 python -m pytest tests/test_torchtitan_cpu.py``); each case trains with
the stock norm twice (to see whether torch itself is reproducible there) and once per variant.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.torchtitan_harness.runs import CASES, compare_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    options = parser.parse_args()
    kept = json.loads(options.out.read_text())["cases"] if options.out.exists() else {}
    results = {
        "torch": version("torch"),
        "torchtitan": version("torchtitan"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "module": "tests.torchtitan_harness",  # each case's --config is its "config"
        "cases": kept,  # cases not rerun are kept from an existing OUT
    }
    for case in options.cases.split(","):
        results["cases"][case] = {"config": CASES[case].config, **compare_case(case)}
        options.out.write_text(json.dumps(results, indent=1) + "\n")
        print(case, json.dumps({k: v["max_rel_diff"] for k, v in results["cases"][case]["variants"].items()}))


if __name__ == "__main__":
    main()
