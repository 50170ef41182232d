"""benchmarks/model_step.py and benchmarks/hostbound.py run end to end without a GPU (tiny model, CPU layers),
each in its own process: ``--cpu-layers`` replaces the custom ops' CPU kernels for the whole process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[1] / "benchmarks"


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
        for impl in ("cake_cute", "cake_cute_apply", "torch")
        for op in ("step", "fwd", "bwd")
        for residual in (False, True)
    }
    assert all(r["us_per_call"] > 0 and r["mode"] == "eager" for r in rows)
    # cake_cute's calls first ask the native extension when it is built (it hands CPU tensors back).
    assert {r["path"] for r in rows if r["impl"] == "torch"} == {"cpu-layers"}
    for impl in ("cake_cute", "cake_cute_apply"):
        assert {r["path"] for r in rows if r["impl"] == impl} <= {"cpu-layers", "cpu-layers+native-route"}


@pytest.mark.parametrize("impl", ["cake_cute_mxfp8", "cake_cute_mxfp8_op"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_hostbound_fp8_adapters_step_through_the_rmsnorm_backward(monkeypatch, impl, residual):
    """Both FP8 adapters' steps (on CPU: the reference) give the gradients of cake_rmsnorm's step, and
    their other outputs are the e4m3 data and scales."""
    import importlib

    import torch

    import cake_cute

    monkeypatch.syspath_prepend(str(PERF))
    hostbound = importlib.import_module("hostbound")
    adapter = hostbound.factories()[impl](torch, hostbound.EPS)
    x, w = torch.randn(5, 64, requires_grad=True), torch.rand(64, requires_grad=True)
    r = torch.randn(5, 64, requires_grad=True) if residual else None
    leaves, g = [t for t in (x, w, r) if t is not None], torch.randn(5, 64)
    y, data, scales = adapter.forward(x, w, r)
    assert data.dtype == torch.float8_e4m3fn and scales.shape == (5, 2)
    got = torch.autograd.grad(y, leaves, g)
    out = cake_cute.cake_rmsnorm(x, w, hostbound.EPS, residual=r)
    want = torch.autograd.grad(out[0] if residual else out, leaves, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_hostbound_graph_replays_mark_each_step_and_leave_out_bwd(monkeypatch):
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(PERF))
    hostbound = importlib.import_module("hostbound")
    events = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    calls = {op: (lambda op=op: events.append(op)) for op in ("step", "fwd", "bwd")}
    replays = hostbound.graph_replays(calls)
    assert sorted(replays) == ["fwd", "step"]
    replays["step"]()
    replays["fwd"]()
    assert events == ["mark", "step", "mark", "fwd"]


# ---- benchmarks/fp8_bench.py: the pure parts, imported on CPU ---------------------------------------------


@pytest.fixture
def fp8_bench(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(PERF))  # its sibling results_doc
    return importlib.import_module("fp8_bench")


def test_fp8_bench_rotating_call_drops_a_sets_outputs_just_before_its_next_turn(fp8_bench):
    import weakref

    class Output:
        pass

    made: list[tuple[int, weakref.ref]] = []
    alive_at_call = []

    def fn(index):
        alive_at_call.append([ref() is not None for _, ref in made])
        out = Output()
        made.append((index, weakref.ref(out)))
        return out

    call = fp8_bench.rotating_call(fn, [(0,), (1,), (2,)])
    for _ in range(7):
        call(None)
    assert [index for index, _ in made] == [0, 1, 2, 0, 1, 2, 0]
    # At call 3 (set 0 again) set 0's first output is gone, sets 1 and 2 still hold theirs.
    assert alive_at_call[3] == [False, True, True]
    assert alive_at_call[6] == [False, False, False, False, True, True]
    assert [ref() is not None for _, ref in made] == [False] * 4 + [True] * 3


def test_fp8_bench_fused_bytes(fp8_bench):
    # x read, e4m3 written (1 byte each), one E8M0 byte per 32 columns, 4 bytes of rstd per row.
    assert fp8_bench.fused_bytes(2, 64, 2, "mxfp8", False) == 2 * 64 * 2 + 2 * 64 + 2 * 2 + 2 * 4
    # residual adds the residual read and h_new written; 1x128 scales are 4 bytes, one for 65 columns.
    assert fp8_bench.fused_bytes(3, 65, 4, "1x128", True) == 3 * 65 * 4 * 3 + 3 * 65 + 3 * 4 + 3 * 4


def test_fp8_bench_grid_shapes(fp8_bench):
    both = fp8_bench.grid_shapes("standard,training")
    assert both == fp8_bench.STANDARD + [s for s in fp8_bench.TRAINING if s not in fp8_bench.STANDARD]
    picked = fp8_bench.grid_shapes("standard,training", "4096,65536")
    assert picked == [(2**15, 4096), (2048, 65536)] + [(t, 4096) for t in (2048, 4096, 8192, 16384)]
    with pytest.raises(ValueError, match=r"--hidden: no shape of the grids training has H = \[7168\]"):
        fp8_bench.grid_shapes("training", "4096,7168")
    with pytest.raises(ValueError, match="--grid: unknown big"):
        fp8_bench.grid_shapes("big")


def test_fp8_bench_parse_tiling(fp8_bench):
    hidden, tiling = fp8_bench.parse_tiling("16384=512,4,1", "bf16", "sm_90a")
    assert hidden == 16384
    assert (tiling.vec, tiling.threads_per_row, tiling.vecs_per_thread, tiling.cluster_n) == (8, 512, 4, 1)
    assert tiling.rows_per_cta == 1 and tiling.covers_row_exactly
    two_rows = fp8_bench.parse_tiling("4096=128,4,1,2", "bf16", "sm_90a")[1]
    assert (two_rows.threads_per_row, two_rows.rows_per_cta) == (128, 2)
    with pytest.raises(ValueError, match="H=TPR,VPT,CLUSTER"):
        fp8_bench.parse_tiling("16384:512,4,1", "bf16", "sm_90a")
    assert fp8_bench.parse_choices("4096:min_ctas_per_sm=12") == (4096, {"min_ctas_per_sm": 12})
    assert fp8_bench.parse_choices("amax_scatter=false,min_ctas_per_sm=4") == (
        None,
        {"amax_scatter": False, "min_ctas_per_sm": 4},
    )
    for wrong in ("4096=12", "4096:tiling=1", "4096:min_ctas_per_sm=many"):
        with pytest.raises(ValueError, match=r"\[H:\]CHOICE=VALUE"):
            fp8_bench.parse_choices(wrong)
    with pytest.raises(ValueError, match="do not cover H"):
        fp8_bench.parse_tiling("16384=256,4,1", "bf16", "sm_90a")


def test_fp8_bench_same_bits_matches_nans_only(fp8_bench):
    import torch

    a = torch.tensor([1.0, float("nan"), 0.0])
    b = a.clone()
    b.view(torch.int32)[1] = -4194304  # 0xFFC00000: a NaN with another sign
    assert fp8_bench.same_bits(a, b)
    assert not fp8_bench.same_bits(a, torch.tensor([1.0, float("nan"), -0.0]))
    assert not fp8_bench.same_bits(a, torch.tensor([1.0, 2.0, 0.0]))


def test_fp8_bench_fastest_configs_sums_each_config_over_its_rows(fp8_bench):
    def row(config, us, candidate, T=8192, H=16384, impl="cake_cute", recipe="mxfp8", residual=False):
        r = {"impl": impl, "T": T, "H": H, "config": config, "gpu_us": us, "recipe": recipe}
        return r | {"residual": residual} | ({"candidate": True} if candidate else {})

    rows = [
        row("a", 10.0, False),
        row("a", 10.0, False, recipe="1x128"),
        row("a", 30.0, False, residual=True),
        row("b", 9.0, True),
        row("b", 12.0, True, recipe="1x128"),  # b: 21 over the cases both have, a: 20
        row("n", 8.0, True),  # no residual row: compared over what it shares with the others only
        row("n", 13.0, True, recipe="1x128"),
        row("c", 1.0, False, impl="cake_cute+compile"),  # another impl: not a config of the fused op
        row("a", 5.0, False, T=16384, H=8192),  # no candidates at this shape
        row("a", 4.0, False, T=2048),  # another shape of the same H, with a candidate of its own
        row("e", 3.0, True, T=2048),
    ]
    assert fp8_bench.fastest_configs(rows) == [(2048, 16384, "e", 3.0), (8192, 16384, "a", 20.0)]


# ---- benchmarks/tune.py and benchmarks/model_step.py: the pure parts, imported on CPU ----------------------


@pytest.fixture
def perf_module(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(PERF))
    return importlib.import_module


def test_tune_parse_candidate_splits_kinds_and_reads_values(perf_module):
    tune = perf_module("tune")
    assert tune.parse_candidate("default", "sm_90a", "bf16", 4096) == {}
    parsed = tune.parse_candidate(
        "bwd.ring_depth=4,dw.after_backward=false,dw.threads=128", "sm_90a", "bf16", 4096
    )
    assert parsed == {"bwd": {"ring_depth": 4}, "dw": {"after_backward": False, "threads": 128}}
    tiling = tune.parse_candidate("bwd.tiling=256:2:1", "sm_90a", "bf16", 4096)["bwd"]["tiling"]
    assert (tiling.hidden, tiling.threads_per_row, tiling.vecs_per_thread, tiling.rows_per_cta) == (
        4096,
        256,
        2,
        1,
    )
    wide = tune.parse_candidate("bwd.tiling=512:8:1:8", "sm_90a", "fp32", 131072)["bwd"]["tiling"]
    assert (wide.threads_per_row, wide.vecs_per_thread, wide.cluster_n) == (512, 8, 8)
    assert wide.cols_per_cta * wide.cluster_n == 131072


def test_tune_kernel_label_names_the_module(perf_module):
    tune = perf_module("tune")
    name = "kernel_cutlass_kernel_cake_cutekernelsdw_reduceDWReduce_object_at__tensorptrf32"
    assert tune._kernel_label(name) == "dw_reduce"
    assert (
        tune._kernel_label("kernel_cake_cutekernelsrmsnorm_fwd_quantRMSNormForwardQuant")
        == "rmsnorm_fwd_quant"
    )
    assert tune._kernel_label("void at::native::elementwise_kernel<128>") == "void at::native::elementwise_k"


def test_model_step_profile_table_sorts_and_totals(perf_module, tmp_path):
    model_step = perf_module("model_step")
    path = tmp_path / "profile.txt"
    model_step.write_profile(path, [("gemm", 30.0, 2.0), ("norm", 12.5, 1.0)])
    lines = path.read_text().splitlines()
    assert lines[0] == "# 42.5 us of kernels per step"
    assert lines[2].split() == ["30.0", "2.0", "gemm"] and lines[3].split() == ["12.5", "1.0", "norm"]


# ---- benchmarks/headdim_scan.py: its cases and candidates, without a GPU -----------------------------------


def test_headdim_scan_arguments_and_cases(perf_module):
    scan = perf_module("headdim_scan")
    args = scan.parse_args([])
    assert args.hidden == [64, 128, 256, 32, 96, 80, 192] and args.rows == [2**16, 2**18, 2**20]
    assert args.vs == ["quack", "compile"] and args.dtype == "bf16"
    args = scan.parse_args(["--hidden", "64", "--rows", "2^16,1<<18", "--vs", "none"])
    assert scan.cases(args.hidden, args.rows) == [
        (64, 2**16, False),
        (64, 2**16, True),
        (64, 2**18, False),
        (64, 2**18, True),
    ]
    assert args.vs == []


@pytest.mark.parametrize("argv", [["--vs", "torch"], ["--reps", "0"], ["--rows", "x"]])
def test_headdim_scan_refuses_bad_arguments(perf_module, argv, capsys):
    scan = perf_module("headdim_scan")
    with pytest.raises(SystemExit) as exc:
        scan.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_headdim_scan_out_dir_prefers_the_option_then_out(perf_module, monkeypatch, tmp_path):
    scan = perf_module("headdim_scan")
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    assert (
        scan.out_dir(scan.parse_args(["--out", str(tmp_path / "opt")]), "NVIDIA H200", "d")
        == tmp_path / "opt"
    )
    assert scan.out_dir(scan.parse_args([]), "NVIDIA H200", "d") == tmp_path / "env"
    monkeypatch.delenv("OUT")
    assert scan.out_dir(scan.parse_args([]), "NVIDIA H200", "d").name == "d-nvidia-h200-headdim-scan"


def _tilings(scan, hidden):
    tune = pytest.importorskip("tune")
    found = {}
    for cand in scan.candidates(hidden, "bf16"):
        parsed = tune.parse_candidate(cand.overrides, "sm_90a", "bf16", hidden)
        found[cand.name] = parsed
    return found


@pytest.mark.parametrize("hidden", [32, 64, 80, 96, 128, 192, 256])
def test_headdim_scan_candidates_cover_rows_exactly_with_128_threads(perf_module, hidden):
    """Every candidate tiling parses into a valid override (the config's own checks), covers H with no
    idle lane and keeps 128-thread CTAs, except the candidates of the rule's lanes in other CTA sizes
    (the forward's 2 and 4 times the rows, the backward's 128 and 256 threads) and the forward's
    one-vector lanes in 64-thread CTAs; the rule's idle lanes (H = 80, 96, 192) get an exact cover."""
    from cake_cute.kernels.config import backward_config, forward_config, overridden

    scan = perf_module("headdim_scan")
    parsed = _tilings(scan, hidden)
    assert "dw256" in parsed
    # Threads per CTA of the candidates that keep the rule's lanes in other CTA sizes (which may leave
    # lanes idle), and of the one-vector lanes in small CTAs.
    rule_lanes = {f"fwd-rows{f}x": 128 * f for f in scan.WIDE_CTA_FACTORS}
    rule_lanes |= {f"bwd-cta{n}": n for n in scan.CTA_THREADS}
    rule_lanes[f"fwd-cta{scan.SMALL_FWD_CTA}"] = scan.SMALL_FWD_CTA
    cta_threads = {**rule_lanes, f"fwd-vpt1-cta{scan.SMALL_FWD_CTA}": scan.SMALL_FWD_CTA}
    for name, kinds in parsed.items():
        for kind, choices in kinds.items():
            if "tiling" not in choices:
                continue
            t = choices["tiling"]
            assert t.threads_per_cta == cta_threads.get(name, 128) and t.threads_per_row <= 32, name
            assert t.covers_row_exactly or name in rule_lanes, name
            with overridden(kind, "sm_90a", "bf16", hidden, **choices):
                config = (forward_config if kind == "fwd" else backward_config)(
                    *(
                        ("sm_90a", "bf16", hidden)
                        if kind == "fwd"
                        else ("sm_90a", "bf16", "bf16", hidden, False)
                    )
                )
                assert config.tiling == t
    ragged = not backward_config("sm_90a", "bf16", "bf16", hidden, False).tiling.covers_row_exactly
    assert ("bwd-exact" in parsed) == (ragged and hidden != 80)  # H = 80: five vectors, 222 registers
    if "bwd-exact" in parsed:
        assert parsed["bwd-exact"]["bwd"]["register_budget"] == 160


def test_headdim_scan_summary_picks_the_best_candidate(perf_module):
    scan = perf_module("headdim_scan")
    base = {"H": 64, "T": 65536, "residual": False, "op": "bwd"}
    rows = [
        base | {"impl": "cake_cute", "candidate": "default", "frac_copy": 0.7},
        base | {"impl": "cake_cute", "candidate": "dw1024", "frac_copy": 0.85, "deterministic": True},
        base | {"impl": "cake_cute", "candidate": "ctas2", "frac_copy": 0.8, "batch_invariant": True},
        base | {"impl": "quack", "candidate": "", "frac_copy": 0.88},
    ]
    line = scan.summary(rows).splitlines()[2].split()
    assert line == ["64", "65536", "off", "bwd", "0.700", "dw1024", "0.850", "0.880", "-", "ok"]
    rows[1]["batch_invariant"] = False
    assert scan.summary(rows).splitlines()[2].endswith("FAIL")


class _FakeSweep:
    """What ``headdim_scan.Scan`` asks of a sweep, on CPU: rows record the backward config in force."""

    fatal = None

    def __init__(self):
        import types

        self.notes = []
        self.timer = types.SimpleNamespace(copy_ceiling=lambda nbytes, reps: {"copy_tbps": 4.0})

    def input_sets(self, rows, hidden, dtype, residual):
        import torch

        names = ("x", "w", "g") + (("r", "gh") if residual else ())
        return [{n: torch.randn(hidden if n == "w" else (rows, hidden)) for n in names}]

    def measure(self, impl, op, residual, dtype, shape, sets, copy):
        from cake_cute.kernels.config import backward_config, forward_config, reduce_config

        config = (
            forward_config("sm_90a", dtype, shape[1]).describe()
            if op == "fwd"
            else backward_config("sm_90a", dtype, dtype, shape[1], residual).describe()
            + " "
            + reduce_config("sm_90a", dtype, shape[1]).describe()
        )
        return {"impl": impl.name, "op": op, "residual": residual, "T": shape[0], "H": shape[1]} | {
            "frac_copy": 0.5,
            "config": config,
        }

    def check_context(self, exc, message):
        """A CUDA error would stop the sweep; none happens on CPU."""


def test_headdim_scan_case_times_each_candidate_under_its_overrides(perf_module, monkeypatch):
    import types

    import torch

    scan_mod = perf_module("headdim_scan")

    def functional(torch, op, t, rows=None):
        x = t["x"][:rows].clone()
        return (x, t["x"].sum(0)) if op == "bwd" else (x, x.sum(1))

    monkeypatch.setattr(scan_mod, "_functional", functional)
    lines = []
    scan = object.__new__(scan_mod.Scan)
    scan.args = types.SimpleNamespace(dtype="bf16", reps=1, only=None)
    scan.torch, scan.log, scan.sweep, scan.rows = torch, lines.append, _FakeSweep(), []
    scan.peers = [types.SimpleNamespace(name="quack")]
    scan.case(64, 40, True, "cake")
    assert not any(r["impl"] == "quack" for r in scan.rows)
    scan.case(64, 40, True, "peers")
    by_name = {(r["candidate"], r["op"]): r for r in scan.rows}
    # residual mode keeps a ring of two: a deeper ring's candidate is skipped, with a line saying so
    deep = {
        c.name
        for c in scan_mod.candidates(64, "bf16")
        if "ring_depth" in c.overrides and "ring_depth=2" not in c.overrides
    }
    assert set(by_name) == {("default", "fwd"), ("default", "bwd"), ("", "fwd"), ("", "bwd")} | {
        (c.name, c.op) for c in scan_mod.candidates(64, "bf16") if c.name not in deep
    }
    assert sum("skipped (ValueError: residual mode keeps a ring of 2" in line for line in lines) == len(deep)
    for cand in scan_mod.candidates(64, "bf16"):
        if cand.name in deep:
            continue
        config = by_name[cand.name, cand.op]["config"]
        for item in cand.overrides.split(","):
            name, _, value = item.partition("=")
            if name.endswith(".tiling"):
                shown = "tpr={} vpt={} cluster=1 rows/cta={}".format(*value.split(":"))
            elif name == "dw.threads":
                shown = f"row_lanes={value}"
            elif name == "dw.rows_in_flight":
                shown = f"in_flight={value}" if value != "1" else "row_lanes"
            else:
                shown = {
                    "bwd.register_budget": f"regs<={value}",
                    "bwd.ring_depth": f"ring={value}",
                    "fwd.min_ctas_per_sm": f"min_ctas/SM={value}",
                }[name]
            assert shown in config, (cand.name, shown, config)
    candidate = by_name["dw256", "bwd"]  # the row kernel's own config: dx bitwise the default's
    assert candidate["deterministic"] and candidate["batch_invariant"] and candidate["bitwise_default"]
    assert candidate["dw_rel_err"] >= 0
    assert len(lines) == len(scan.rows) + len(deep)
    assert "ok" in scan_mod.summary(scan.rows)


# ---- benchmarks/model_step.py --model qwen3: q/k norms over every head -------------------------------------


def test_model_step_qwen3_shapes_have_grouped_heads_of_128(perf_module):
    model_step = perf_module("model_step")
    full = model_step.shapes_for("qwen3", [2048, 4096], 2048, tiny=False)
    assert [(s.hidden, s.heads, s.kv_heads, s.head_dim, s.ffn, s.tokens) for s in full] == [
        (2048, 16, 8, 128, 6144, 8192),
        (4096, 32, 8, 128, 12288, 8192),
    ]
    llama = model_step.shapes_for("llama", [4096], 2048, tiny=False)[0]
    assert (llama.kv_heads, llama.ffn) == (32, 11008)
    tiny = model_step.shapes_for("qwen3", [], 32, tiny=True)[0]
    assert (tiny.heads, tiny.kv_heads, tiny.head_dim) == (4, 2, 16)
    wide = model_step.shapes_for("qwen3", [2048], 2048, tiny=False, head_dim=256)[0]
    assert (wide.heads, wide.kv_heads, wide.head_dim) == (8, 4, 256)
    assert model_step.shapes_for("llama", [2048], 2048, tiny=False, head_dim=256)[0].head_dim == 128


def test_model_step_qk_kernel_keeps_the_head_norms_on_the_kernel_under_compile(perf_module):
    """``cake_cute`` follows swap_rmsnorm's default (per-head norms as torch math under compile),
    ``cake_cute_qk_kernel`` the kernel for them; every other norm is the kernel in both."""
    pytest.importorskip("transformers")
    import torch

    import cake_cute

    model_step = perf_module("model_step")
    shape = model_step.shapes_for("qwen3", [], 32, tiny=True)[0]
    for impl, head_norms in (("cake_cute", "torch"), ("cake_cute_qk_kernel", "kernel")):
        model, _ = model_step.build_model(shape, impl, torch.device("cpu"))
        norms = {
            name.rsplit(".", 1)[-1]: m.compiled_as
            for name, m in model.named_modules()
            if isinstance(m, cake_cute.CakeRMSNorm)
        }
        others = dict.fromkeys(["input_layernorm", "post_attention_layernorm", "norm"], "kernel")
        assert norms == others | {"q_norm": head_norms, "k_norm": head_norms}


def test_model_step_qwen3_tiny_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "model-step.json"
    _run(
        "model_step.py", str(out), "--device", "cpu", "--tiny", "--model", "qwen3", "--modes", "eager",
        "--warmup", "1", "--steps", "1", "--impls", "torch,cake_cute,cake_cute_qk_kernel", "--head-dim", "32",
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["torch", "cake_cute", "cake_cute_qk_kernel"]
    assert all(r["model"] == "qwen3" and r["compile_scope"] == "model" and r["step_ms"] > 0 for r in rows)
    assert all(r["head_dim"] == 32 for r in rows)


def test_headdim_scan_compiles_every_kernel_a_row_can_launch(perf_module, monkeypatch):
    """Each compile task builds the forward, the backward and both dW reductions under its overrides
    (the config they compile with differs from the default's), and reports a mode it cannot take."""
    from cake_cute.runtime import cache as compile_cache
    from cake_cute.runtime.build import config_for

    scan = perf_module("headdim_scan")
    built = []
    monkeypatch.setattr(compile_cache, "get_kernel", lambda spec: built.append((spec, config_for(spec))))
    text = "bwd.tiling=8:1:16,dw.threads=1024,dw.rows_in_flight=8"
    assert scan.compile_variant((64, False, "bf16", text)) is None
    kinds = {(spec.kind, getattr(spec, "out_dtype", None)): config for spec, config in built}
    assert set(kinds) == {("fwd", None), ("bwd", None), ("dw", "bf16"), ("dw", "fp32")}
    assert kinds["bwd", None].tiling.threads_per_row == 8
    assert kinds["dw", "fp32"].threads == 1024 and kinds["dw", "bf16"].rows_in_flight == 8
    problem = scan.compile_variant((64, True, "bf16", "bwd.ring_depth=8"))
    assert "residual mode keeps a ring of 2" in problem


# ---- benchmarks/megatron_pretrain.py: its harness around a stand-in pretrain_gpt.py -----------------------

# Two iteration lines as Megatron-LM's training log writes them (training.py's training_log), among others.
MEGATRON_LOG = """\
> building GPT model ...
 [2026-12-06 10:00:01.000000] iteration        1/       2 | consumed samples:            1 | elapsed time \
per iteration (ms): 9123.4 | learning rate: 3.000000E-04 | global batch size:     1 | \
lm loss: 1.037612E+01 | load_balancing_loss: 1.02 | loss scale: 1.0 | grad norm: 4.127 | \
number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-12-06 10:00:01.200000] iteration        2/       2 | consumed samples:            2 | elapsed time \
per iteration (ms): 201.5 | learning rate: 3.000000E-04 | global batch size:     1 | lm loss: 1.021E+01 | \
load_balancing_loss: 1.01 | loss scale: 1.0 | grad norm: 3.5 | number of skipped iterations:   0 | number \
of nan iterations:   0 |
[after training is done] datetime: 2026-12-06 10:00:02
"""


def test_megatron_pretrain_reads_megatrons_iteration_lines(perf_module):
    pretrain = perf_module("megatron_pretrain")
    rows = pretrain.parse_iterations(MEGATRON_LOG)
    assert [row["iteration"] for row in rows] == [1, 2]
    assert rows[0]["lm loss"] == 10.37612 and rows[1]["load_balancing_loss"] == 1.01
    assert rows[0]["elapsed time per iteration (ms)"] == 9123.4 and rows[1]["grad norm"] == 3.5
    summary = pretrain.summarize(rows, warmup=1)
    assert summary["losses"] == [10.37612, 10.21] and summary["median_step_ms"] == 201.5


def test_megatron_pretrain_arguments(perf_module, tmp_path):
    pretrain = perf_module("megatron_pretrain")
    (tmp_path / "pretrain_gpt.py").write_text("")
    args = pretrain.parse_args(["out.json", "--megatron-lm", str(tmp_path)])
    dense, moe = (" ".join(pretrain.pretrain_arguments(args, model, "stock")) for model in ("dense", "moe"))
    assert "--num-layers 8 --hidden-size 2048" in dense and "--transformer-impl local" in dense
    assert "--num-experts" not in dense and "--spec" not in dense
    assert moe.endswith("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2")
    block = pretrain.pretrain_arguments(args, "moe", "cake-block")
    assert block[-3:] == ["--spec", "cake_cute.integrations.megatron", "gpt_decoder_block_spec"]


def test_megatron_pretrain_runs_each_spec_in_a_process_of_its_own(perf_module, tmp_path, monkeypatch):
    """The harness end to end with a stand-in pretrain_gpt.py that logs as Megatron-LM does: one process per
    run, each with its --spec line, the parsed series, and before 0.19 the block function recorded as
    skipped."""
    pretrain = perf_module("megatron_pretrain")
    megatron_lm = tmp_path / "megatron-lm"
    megatron_lm.mkdir()
    (megatron_lm / "pretrain_gpt.py").write_text(
        f"import sys\nprint(' '.join(sys.argv[1:]))\nprint({MEGATRON_LOG!r})\n"
    )
    out = tmp_path / "pretrain.json"
    monkeypatch.setattr(pretrain, "megatron_version", lambda: (0, 16))
    argv = [str(out), "--megatron-lm", str(megatron_lm), "--models", "moe", "--steps", "2", "--warmup", "1"]
    pretrain.main(argv)
    runs = {run["name"]: run for run in json.loads(out.read_text())["runs"]}
    assert runs.keys() == {"moe-stock", "moe-cake-layer", "moe-cake-block"}
    assert "0.19" in runs.pop("moe-cake-block")["skipped"]
    for name, run in runs.items():
        assert run["returncode"] == 0, run.get("log_tail")
        assert run["losses"] == [10.37612, 10.21] and run["median_step_ms"] == 201.5
        assert run["load_balancing_loss"] == [1.02, 1.01]
        assert run["peak_gib"] is None  # no CUDA here; the stand-in builds no GPTModel
        log = (tmp_path / f"pretrain-{name}.log").read_text()
        assert ("--spec cake_cute.integrations.megatron gpt_layer_spec" in log) == (name == "moe-cake-layer")


def test_model_step_route_on_cpu(tmp_path):
    """--route: the stock norms and cake_cute's layers through Hugging Face's kernel route (Liger's
    stand-in needs liger-kernel, not installed here), with the route's versions in the document."""
    pytest.importorskip("transformers")
    pytest.importorskip("kernels")
    out = tmp_path / "model-step.json"
    _run(
        "model_step.py", str(out), "--device", "cpu", "--tiny", "--route", "--model", "qwen3",
        "--modes", "eager", "--warmup", "1", "--steps", "1", "--optimizer", "adamw",
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert [r["impl"] for r in doc["rows"]] == ["hf", "kernels_cake_cute"]
    assert set(doc["route"]) == {"transformers", "kernels"}


def test_model_step_liger_stand_in_is_bound_by_the_route(perf_module, monkeypatch):
    """The Liger stand-in's repository loads through the kernels package and its layer replaces every
    "RMSNorm" norm's forward (a fake LigerRMSNormFunction here: liger-kernel needs a GPU)."""
    pytest.importorskip("transformers")
    pytest.importorskip("kernels")
    import types

    import torch

    class FakeLigerRMSNormFunction:
        calls = 0

        @classmethod
        def apply(cls, x, w, eps):
            cls.calls += 1
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    fake = types.ModuleType("liger_kernel.ops.rms_norm")
    fake.LigerRMSNormFunction = FakeLigerRMSNormFunction
    for name in ("liger_kernel", "liger_kernel.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rms_norm", fake)
    model_step = perf_module("model_step")
    shape = model_step.shapes_for("llama", [], 32, tiny=True)[0]
    model, loss = model_step.build_model(shape, "kernels_liger", torch.device("cpu"))
    loss(model).backward()
    assert FakeLigerRMSNormFunction.calls == 2 * shape.layers + 1
