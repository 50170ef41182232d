"""benchmarks/gated_model_step.py without a GPU: its smoke mode end to end (a tiny Qwen3-Next, FP32,
eager, in its own process; and a tiny Kimi Linear, ``--model kimi_linear``), and the gated-norm slot
made Hugging Face's class whatever transformers built there; also what ``--profile`` writes, the dynamo
counts a compiled row keeps, and ``--interleave``.

The first-step loss of both cake runs is asserted bitwise equal to stock-torch's. Same seed, same
batch, so the first forward differs only in the gated norms, and in FP32 on CPU they compute what the
class computes: the CPU path does ``Qwen3NextRMSNormGated``'s FP32 operations in its order
(docs/gated.md: a swapped model's FP32 logits are bitwise the stock model's), and in FP32 the class's
roundings to the input dtype are exact, so ``one_rounding`` is the same arithmetic. Later losses are
not compared bitwise: the backward is the kernels' closed form (gradients within rtol 1e-4 of
autograd's chain), and AdamW carries that into the next steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gated-model-step") / "step.json"
    command = [sys.executable, str(BENCHMARKS / "gated_model_step.py"), str(out), "--device", "cpu"]
    subprocess.run([*command, "--dtype", "fp32"], check=True, capture_output=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["default_gated_norm"] == "Qwen3NextRMSNormGated"
    assert set(doc["linear_attention"]) == {"torch_chunk_gated_delta_rule", "causal_conv1d_fn"}
    return doc["rows"]


def test_smoke_run_has_a_row_per_implementation(smoke_rows):
    assert [(r["impl"], r["mode"], r["plain_norms"]) for r in smoke_rows] == [
        (impl, "eager", "stock") for impl in ("stock-torch", "fla", "cake", "cake-one-rounding")
    ]
    for row in smoke_rows:
        if row["impl"] == "fla" and "skipped" in row:  # fla-core is not a dependency
            continue
        assert "error" not in row, row
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["peak_gib"] is None
        assert len(row["losses"]) == 3


def test_smoke_run_cake_first_loss_is_stock_torchs(smoke_rows):
    rows = {r["impl"]: r for r in smoke_rows}
    assert rows["stock-torch"]["gated_norm"] == "Qwen3NextRMSNormGated"
    for impl in ("cake", "cake-one-rounding"):
        assert rows[impl]["gated_norm"] == "CakeGatedRMSNorm"
        assert rows[impl]["losses"][0] == rows["stock-torch"]["losses"][0]  # bitwise: module docstring


def test_kimi_linear_smoke_run(tmp_path):
    """``--model kimi_linear``: a tiny Kimi Linear (its Kimi Delta Attention in torch), the sigmoid-gated
    ``KimiLinearRMSNormGated`` in the stock run and ``CakeGatedRMSNorm`` in the cake runs, whose first
    loss is the stock run's, bitwise (the class rounds once, which the CPU path does in FP32 too)."""
    out = tmp_path / "step.json"
    command = [sys.executable, str(BENCHMARKS / "gated_model_step.py"), str(out), "--device", "cpu"]
    subprocess.run(
        [*command, "--dtype", "fp32", "--model", "kimi_linear"], check=True, capture_output=True, timeout=600
    )
    doc = json.loads(out.read_text())
    assert doc["model"] == "KimiLinearForCausalLM" and doc["default_gated_norm"] == "KimiLinearRMSNormGated"
    assert set(doc["linear_attention"]) == {"chunk_kimi_delta_attention", "causal_conv1d_fn"}
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["stock-torch"]["gated_norm"] == "KimiLinearRMSNormGated"
    for impl in ("cake", "cake-one-rounding"):
        assert "error" not in rows[impl], rows[impl]
        assert rows[impl]["gated_norm"] == "CakeGatedRMSNorm"
        assert rows[impl]["losses"][0] == rows["stock-torch"]["losses"][0]


def test_profile_writes_tables_and_a_summary_per_run(tmp_path):
    out, folder = tmp_path / "step.json", tmp_path / "profile"
    command = [sys.executable, str(BENCHMARKS / "gated_model_step.py"), str(out), "--device", "cpu"]
    subprocess.run(
        [*command, "--impls", "cake", "--profile", str(folder)], check=True, capture_output=True, timeout=600
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row
    assert row["profile"] == ["profile/cake-eager.txt", "profile/cake-eager.json"]
    tables = (folder / "cake-eager.txt").read_text()
    assert "sorted by self_cpu_time_total" in tables and "gated_model_step.step" in tables
    assert "self_device_time_total" not in tables  # no CUDA activity on CPU
    summary = json.loads((folder / "cake-eager.json").read_text())
    assert set(summary) == {
        "steps",
        "host_ms",
        "device_span_ms",
        "device_ms",
        "kernels",
        "device_ms_by_name",
        "markers",
    }
    assert summary["steps"] == 2 and summary["host_ms"] > 0
    assert summary["device_span_ms"] == summary["device_ms"] == summary["kernels"] == 0
    assert summary["device_ms_by_name"] == {}
    # The one linear-attention layer's norm (the class's casts): its forward op twice a step (the
    # forward, and its recomputation in the backward), its backward op once.
    assert summary["markers"] == {"cake_cute::rmsnorm_fwd": 2, "cake_cute::rmsnorm_bwd": 1}
    assert "dynamo" not in row  # eager


def test_interleaved_runs_take_turns_and_keep_each_round(tmp_path):
    """``--interleave 3``: every run's row with its three round medians and their median as the step;
    no peak (the other runs stay resident); the same first losses as the runs one after another."""
    command = [sys.executable, str(BENCHMARKS / "gated_model_step.py"), "--device", "cpu", "--dtype", "fp32"]
    impls = ["--impls", "stock-torch,cake"]
    out = {name: tmp_path / f"{name}.json" for name in ("apart", "together")}
    subprocess.run([*command, str(out["apart"]), *impls], check=True, capture_output=True, timeout=600)
    subprocess.run(
        [*command, str(out["together"]), *impls, "--interleave", "3"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    apart, together = (json.loads(out[name].read_text())["rows"] for name in ("apart", "together"))
    assert [r["impl"] for r in together] == ["stock-torch", "cake"]
    for alone, row in zip(apart, together):
        assert "error" not in row, row
        assert len(row["round_ms"]) == 3 and row["step_ms"] == sorted(row["round_ms"])[1]
        assert row["peak_gib"] is None and "round_ms" not in alone
        assert row["losses"] == alone["losses"]


def test_interleave_needs_two_rounds():
    command = [sys.executable, str(BENCHMARKS / "gated_model_step.py"), "out.json", "--interleave", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--interleave takes at least 2 rounds; got 1" in done.stderr


def test_dynamo_stats_counts_graphs_breaks_and_recompiles(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gated_model_step as bench

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    bench.reset_dynamo()
    compiled = torch.compile(broken, backend="eager")
    compiled(torch.ones(3))
    stats = bench.dynamo_stats()
    assert stats["unique_graphs"] == 2 and sum(stats["graph_breaks"].values()) == 1
    assert stats["recompiles"] == 0 and stats["recompile_reasons"] == {}
    compiled(torch.ones(3, dtype=torch.float64))  # both frames' dtype guards fail
    stats = bench.dynamo_stats()
    assert stats["unique_graphs"] == 4 and stats["recompiles"] == 2
    assert all("dtype mismatch" in reason for reason in stats["recompile_reasons"])
    bench.reset_dynamo()
    assert bench.dynamo_stats() == dict(
        unique_graphs=0,
        graph_breaks={},
        recompiles=0,
        recompile_reasons={},
        compile_s=0.0,
        fx_graph_cache_hits=0,
        fx_graph_cache_misses=0,
    )


def test_stock_torch_puts_the_hugging_face_class_in_a_slot_holding_another_module(monkeypatch):
    """Transformers 5.0 and older build fla's FusedRMSNormGated in the slot when fla imports: the
    stock-torch run replaces it by Hugging Face's class on the same weight."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gated_model_step as bench

    model = bench.build_model(bench.TINY, "stock-torch", "stock", torch.float32, "cpu")
    (mixer,) = bench.linear_mixers(model)
    weight = mixer.norm.weight
    mixer.norm = torch.nn.Module()  # stands for fla's module: a weight, another class
    mixer.norm.weight = weight
    bench.install_gated_norms(model, "stock-torch")
    assert type(mixer.norm) is Qwen3NextRMSNormGated and mixer.norm.weight is weight
    assert mixer.norm.variance_epsilon == model.config.rms_norm_eps
