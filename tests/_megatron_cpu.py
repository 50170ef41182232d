"""The CPU stand-ins of ``benchmarks/megatron_cpu.py`` for the Megatron-Core tests, loaded once (import
this after ``pytest.importorskip("megatron.core")``: the stand-ins import Megatron)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_cpu_shims():
    spec = importlib.util.spec_from_file_location("megatron_cpu", BENCHMARKS / "megatron_cpu.py")
    module = importlib.util.module_from_spec(spec)
    # Registered, so that torch.compile, tracing Megatron functions that call its stand-ins, finds it.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CPU = sys.modules.get("megatron_cpu") or _load_cpu_shims()
