"""The benchmark harness on a GPU: a tiny training-grid sweep writes rows of the documented schema, with
rotated input sets and a copy ceiling measured in the same run."""

import pytest

from cake_cute.tools.bench import results, timing
from cake_cute.tools.bench.cli import main

pytestmark = pytest.mark.gpu


def test_tiny_training_sweep_writes_schema_rows(tmp_path):
    path = tmp_path / "training.json"
    argv = ["--grid", "training", "--hidden", "1024", "--tokens", "2048", "--vs", "none", "--no-plot"]
    assert main(argv + ["--reps", "3", "--prof-reps", "3", "--json", str(path)]) == 0
    doc = results.load_json(path)
    assert doc["grid"] == "training" and doc["complete"] is True and doc["l2_bytes"] > 0
    rows = doc["rows"]
    assert len(rows) == 4  # cake_cute x (fwd, bwd) x (plain, residual)
    assert [results.schema_problems(r) for r in rows] == [[]] * 4, rows
    per_set = {False: 2, True: 4}  # activation tensors of one input set, 2048 x 1024 bf16 each
    for r in rows:
        expected_sets = timing.buffer_sets_for(per_set[r["residual"]] * 2048 * 1024 * 2, doc["l2_bytes"])
        assert r["buffer_sets"] == expected_sets > 1
        assert r["gpu_method"] == "events" and 0 < r["gpu_us"] <= r["us"] + 1
        assert 0.2 < r["frac_copy"] < 1.5, r


def test_device_time_of_a_copy_matches_its_bytes():
    """A copy of 256 MiB cannot beat the HBM: its device time implies at most ~5 TB/s (H200: 4.8)."""
    import torch

    timer = timing.DeviceTimer(torch, torch.device("cuda"))
    ceiling = timer.copy_ceiling(1 << 29, reps=5)
    assert ceiling["copy_buffer_sets"] == 1
    assert 1.0 < ceiling["copy_tbps"] < 5.5, ceiling
