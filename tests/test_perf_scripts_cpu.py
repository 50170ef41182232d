"""perf/model_step.py and perf/hostbound.py run end to end without a GPU (tiny model, CPU layers), each
in its own process: ``--cpu-layers`` replaces the custom ops' CPU kernels for the whole process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[1] / "perf"


def _run(script: str, *args: str) -> None:
    subprocess.run([sys.executable, str(PERF / script), *args], check=True, capture_output=True, timeout=600)


def test_model_step_tiny_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "model-step.json"
    _run(
        "model_step.py",
        str(out),
        "--device",
        "cpu",
        "--tiny",
        "--modes",
        "eager",
        "--warmup",
        "1",
        "--steps",
        "1",
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["torch", "cake_cute"]  # liger and quack do not import here
    for row in rows:
        assert set(row) == {"impl", "mode", "layers", "H", "tokens", "step_ms", "peak_gib"}
        assert row["step_ms"] > 0 and row["peak_gib"] is None


def test_hostbound_cpu_layers(tmp_path):
    out = tmp_path / "hostbound.json"
    _run("hostbound.py", str(out), "--cpu-layers", "--tokens", "1", "--hidden", "256", "--reps", "3")
    rows = json.loads(out.read_text())["rows"]
    assert {(r["impl"], r["op"], r["residual"]) for r in rows} == {
        (impl, op, residual)
        for impl in ("cake_cute", "torch")
        for op in ("step", "fwd", "bwd")
        for residual in (False, True)
    }
    assert all(r["us_per_call"] > 0 and r["mode"] == "eager" for r in rows)
    # cake_cute's calls first ask the native extension when it is built (it hands CPU tensors back).
    assert {r["path"] for r in rows if r["impl"] == "torch"} == {"cpu-layers"}
    assert {r["path"] for r in rows if r["impl"] == "cake_cute"} <= {"cpu-layers", "cpu-layers+native-route"}
