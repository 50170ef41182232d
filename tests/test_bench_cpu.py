"""CPU tests of the benchmark harness (``cake_cute.tools.bench``): byte model, grids, argument errors, the
L2 rotation's size, rows / table / JSON schema, plotting from a synthetic file, and the clear failure of
``main()`` without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cake_cute.tools.bench import cases, plot, results, timing
from cake_cute.tools.bench.cli import main, parse_args

ROOT = Path(__file__).resolve().parents[1]
H200_L2 = 60 * 2**20

# ---- byte model ---------------------------------------------------------------------------------------


def test_bytes_forward_plain_and_residual():
    T, H = 32768, 4096
    e = T * H * 2
    assert cases.model_bytes("fwd", False, T, H, "bf16") == 2 * e + 2 * H + 4 * T
    assert cases.model_bytes("fwd", True, T, H, "bf16") == 4 * e + 2 * H + 4 * T


def test_bytes_backward_plain_and_residual():
    T, H = 1024, 131072
    e = T * H * 2
    assert cases.model_bytes("bwd", False, T, H, "bf16") == 3 * e  # g, x in; dx out
    assert cases.model_bytes("bwd", True, T, H, "bf16") == 4 * e  # + g_residual in


def test_bytes_dtypes():
    assert cases.model_bytes("bwd", False, 2, 8, "fp32") == 3 * 2 * 8 * 4
    assert cases.model_bytes("fwd", False, 2, 8, "fp16") == 2 * 2 * 8 * 2 + 8 * 2 + 4 * 2
    assert cases.model_bytes("fwd", False, 2, 8, "bf16", w_dtype="fp32") == 2 * 2 * 8 * 2 + 8 * 4 + 4 * 2
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp16, fp32, got 'int8'"):
        cases.model_bytes("fwd", False, 2, 8, "int8")
    with pytest.raises(ValueError, match="op"):
        cases.model_bytes("dgrad", False, 2, 8)


# ---- grids and arguments ----------------------------------------------------------------------------------


def _shapes(argv: list[str], dtype: str = "bf16") -> list[tuple[int, int]]:
    a = parse_args(argv)
    return cases.grid_shapes(a.grid, dtype, a.hidden, a.tokens, a.elements)


def test_defaults_are_the_standard_grid():
    a = parse_args([])
    assert (a.grid, a.dtype, a.residual, a.ops) == ("standard", ["bf16"], "both", ["fwd", "bwd"])
    assert a.vs == ["torch", "compile", "liger", "quack"]
    assert a.elements is None and a.json is None and a.plot is None
    assert _shapes([]) == [((1 << 27) // h, h) for h in cases.STANDARD_HIDDEN]
    assert dict((h, t) for t, h in _shapes([]))[131072] == 1024


def test_standard_grid_per_dtype():
    assert _shapes(["--dtype", "fp16"], "fp16") == _shapes([])
    fp32 = _shapes(["--dtype", "fp32"], "fp32")
    assert fp32 == [((1 << 26) // h, h) for h in cases.STANDARD_HIDDEN]
    assert fp32[0] == (65536, 1024) and fp32[-1] == (512, 131072)


def test_training_grid():
    a = parse_args(["--grid", "training"])
    assert a.vs == ["quack"] and a.residual == "both" and a.ops == ["fwd", "bwd"]
    shapes = _shapes(["--grid", "training"])
    assert len(shapes) == 24
    assert shapes[:4] == [(2048, 1024), (4096, 1024), (8192, 1024), (16384, 1024)]
    assert {h for _, h in shapes} == {1024, 2048, 4096, 5120, 8192, 16384}
    assert {t for t, _ in shapes} == {2048, 4096, 8192, 16384}
    assert _shapes(["--grid", "training", "--hidden", "4096", "--tokens", "2048,4096"]) == [
        (2048, 4096),
        (4096, 4096),
    ]


def test_small_grid():
    assert _shapes(["--grid", "small"]) == [(1, 4096), (16, 4096), (256, 4096)]
    assert _shapes(["--grid", "small", "--hidden", "8192", "--tokens", "4"]) == [(4, 8192)]


def test_headdim_grid():
    """H = 32 ... 256 (per-head norms) at T = 2^12, 2^16, 2^20; compared with the fused peers."""
    a = parse_args(["--grid", "headdim"])
    assert a.vs == ["compile", "liger", "quack"]
    shapes = _shapes(["--grid", "headdim"])
    assert [h for _, h in shapes[::3]] == [32, 64, 80, 96, 128, 192, 256]
    assert all(t in (2**12, 2**16, 2**20) for t, _ in shapes) and len(shapes) == 21
    assert _shapes(["--grid", "headdim", "--hidden", "64", "--tokens", "2^18"]) == [(2**18, 64)]


@pytest.mark.parametrize(
    ("op", "residual", "T", "H", "target"),
    [
        ("fwd", False, 2**20, 32, 0.95),  # 2^20 * 32 * 2 * 2 bytes + w + rstd = 132 MiB
        ("bwd", True, 2**20, 32, 0.90),
        ("fwd", False, 2**16, 128, 0.95),  # 32 MiB of x and y, plus w and rstd
        ("fwd", False, 2**16, 64, None),  # 16 MiB
        ("bwd", False, 2**16, 64, None),  # 24 MiB
        ("bwd", False, 2**16, 128, 0.90),  # 48 MiB
    ],
)
def test_calls_of_32_mib_or_more_are_held_to_a_copy_fraction(op, residual, T, H, target):
    nbytes = cases.model_bytes(op, residual, T, H)
    assert cases.ceiling_target(op, nbytes) == target
    with pytest.raises(ValueError, match="op must be 'fwd' or 'bwd'"):
        cases.ceiling_target("step", nbytes)


def test_table_marks_rows_below_their_target():
    row = {"impl": "cake_cute", "op": "bwd", "residual": False, "dtype": "bf16", "T": 2**20, "H": 64}
    row |= {"us": 80.0, "gpu_us": 70.0, "tbps": 3.0, "copy_tbps": 4.5, "frac_copy": 0.667, "host_us": 10.0}
    assert results.format_table([row | {"target_frac_copy": 0.9}]).splitlines()[2].endswith(" <0.90")
    met = row | {"frac_copy": 0.93, "target_frac_copy": 0.9}
    assert results.format_table([met]).splitlines()[2].endswith(" >=0.90")
    assert results.format_table([row]).splitlines()[2].endswith("10.0")


def test_flags():
    a = parse_args(
        ["--hidden", "4096,8192", "--tokens", "1000", "--dtype", "bf16,fp16,fp32", "--residual", "on"]
        + ["--vs", "torch,quack", "--ops", "bwd", "--json", "out.json", "--plot", "p.png"]
        + ["--reps", "7", "--prof-reps", "4", "--warmup", "2"]
    )
    assert a.hidden == [4096, 8192] and a.tokens == [1000] and a.dtype == ["bf16", "fp16", "fp32"]
    assert a.residual == "on" and a.vs == ["torch", "quack"] and a.ops == ["bwd"]
    assert (a.json, a.plot, a.reps, a.prof_reps, a.warmup) == (Path("out.json"), Path("p.png"), 7, 4, 2)
    assert cases.grid_shapes(a.grid, "fp32", a.hidden, a.tokens, a.elements) == [(1000, 4096), (1000, 8192)]
    assert parse_args(["--vs", "none"]).vs == []
    assert parse_args(["--grid", "training", "--vs", "all"]).vs == list(results.PEERS)


@pytest.mark.parametrize(
    "text,value",
    [("134217728", 1 << 27), ("2^27", 1 << 27), ("2**27", 1 << 27), ("1<<27", 1 << 27), ("128M", 1 << 27)]
    + [("4k", 4096)],
)
def test_elements_forms(text, value):
    assert cases.parse_count(text) == value
    assert _shapes(["--elements", text, "--hidden", "1024"]) == [(value // 1024, 1024)]


def test_shapes_skip_when_no_row_fits():
    assert _shapes(["--elements", "2048", "--hidden", "1024,4096"]) == [(2, 1024)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "int8"], "argument --dtype: expected a comma-separated subset of bf16, fp16, fp32"),
        (["--dtype", ""], "argument --dtype: expected a comma-separated subset"),
        (["--vs", "torch,apex"], "argument --vs: expected a comma-separated subset of torch"),
        (["--ops", "fwd,dgrad"], "argument --ops: expected a comma-separated subset of fwd, bwd"),
        (["--residual", "maybe"], "argument --residual: invalid choice: 'maybe'"),
        (["--grid", "huge"], "argument --grid: invalid choice: 'huge'"),
        (["--hidden", "0"], "argument --hidden: expected a comma-separated list of positive integers"),
        (["--hidden", ""], "argument --hidden: expected a comma-separated list of positive integers"),
        (["--hidden", "abc"], "argument --hidden: expected a comma-separated list of positive integers"),
        (["--tokens", "-3"], "argument --tokens: expected a comma-separated list of positive integers"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--prof-reps", "0"], "--prof-reps must be >= 1"),
        (["--warmup", "0"], "--warmup must be >= 1"),
        (["--eps", "0"], "--eps must be > 0"),
        (["--elements", "-5"], "argument --elements: expected a positive count"),
        (["--grid", "training", "--elements", "2^20"], "does not combine with --grid training"),
        (["--elements", "2^20", "--tokens", "8"], "does not combine with --grid standard or --tokens"),
        (["--elements", "512", "--hidden", "1024"], "no shape of --grid standard has T >= 1"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_grid_shapes_rejects_an_unknown_grid():
    with pytest.raises(ValueError, match="grid must be one of standard, training, small"):
        cases.grid_shapes("huge", "bf16")


# ---- L2 rotation ------------------------------------------------------------------------------------------


def test_buffer_sets_exceed_twice_the_l2():
    per_set = 2 * 2048 * 1024 * 2  # x and g of the smallest training shape, bf16: 8 MiB
    sets = timing.buffer_sets_for(per_set, H200_L2)
    assert sets == 15
    assert sets * per_set >= timing.L2_FACTOR * H200_L2 > (sets - 1) * per_set


def test_buffer_sets_limits():
    assert timing.buffer_sets_for(2 * 2**28, H200_L2) == 1  # the standard grid: one set is far larger
    assert timing.buffer_sets_for(2 * 4096 * 2, H200_L2) == timing.MAX_BUFFER_SETS
    assert timing.buffer_sets_for(2**20, H200_L2, rotate=False) == 1


def test_rotation_cycles_across_every_call():
    rotation = timing.Rotation(3)
    assert [rotation.next() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


class _FakeEvent:
    """A CUDA event of the fake device below: fires when the device clock passes its timestamp."""

    def __init__(self, device):
        self.device, self.at = device, None

    def record(self):
        self.at = self.device.queue_end()

    def query(self):
        return self.device.host_clock >= self.at

    def synchronize(self):
        self.device.host_clock = max(self.device.host_clock, self.at)

    def elapsed_time(self, end):
        return (end.at - self.at) / 1e3  # ms


class _FakeCuda:
    """One stream in microseconds: a spin of c cycles takes c / 1000 us, a call's kernel 10 us; queuing
    the call costs the host ``host_us``."""

    def __init__(self, host_us):
        self.host_us, self.host_clock, self.device_clock = host_us, 0.0, 0.0
        self.Event = lambda enable_timing: _FakeEvent(self)

    def queue_end(self):
        self.device_clock = max(self.device_clock, self.host_clock)
        return self.device_clock

    def synchronize(self):
        self.host_clock = self.device_clock = max(self.host_clock, self.device_clock)

    def _sleep(self, cycles):
        self.queue_end()
        self.device_clock += cycles / 1000

    def kernel(self):
        self.host_clock += self.host_us
        self.queue_end()
        self.device_clock += 10.0

    def get_device_properties(self, device):
        return type("Props", (), {"L2_cache_size": H200_L2})()


@pytest.mark.parametrize("host_us, spins", [(50.0, 1), (5000.0, 4)])
def test_device_time_excludes_the_host_and_lengthens_a_short_spin(host_us, spins):
    cuda = _FakeCuda(host_us)
    timer = timing.DeviceTimer(type("Torch", (), {"cuda": cuda})(), "cuda")
    assert timer.device_us(lambda _: cuda.kernel(), reps=3) == pytest.approx(10.0)
    assert timer.spin_cycles == timing.SPIN_CYCLES * spins  # 2097 us of spin hides 50 us, not 5000


def test_a_host_that_outlasts_every_spin_is_an_error():
    cuda = _FakeCuda(1e9)
    timer = timing.DeviceTimer(type("Torch", (), {"cuda": cuda})(), "cuda")
    with pytest.raises(timing.LateHostError, match="outlasted"):
        timer.device_us(lambda _: cuda.kernel(), reps=1)


# ---- naming, rows, JSON, table ----------------------------------------------------------------------


def test_default_json_path(tmp_path):
    def name(**kw):
        return results.default_json_path("NVIDIA H200", "2025-01-02", root=tmp_path, **kw).name

    assert results.default_json_path("NVIDIA H200", "2025-01-02", root=tmp_path) == (
        tmp_path / "evidence" / "2025-01-02-nvidia-h200.json"
    )
    assert name(grid="training") == "2025-01-02-nvidia-h200-training-shapes.json"
    assert name(grid="small") == "2025-01-02-nvidia-h200-small.json"
    assert name(grid="headdim") == "2025-01-02-nvidia-h200-headdim.json"
    assert name(dtypes=("fp32",)) == "2025-01-02-nvidia-h200-fp32.json"
    assert (
        name(grid="training", dtypes=("bf16", "fp16"))
        == "2025-01-02-nvidia-h200-training-shapes-bf16-fp16.json"
    )
    assert results.slugify("  ") == "unknown-gpu"


def test_git_commit_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("CAKE_CUTE_COMMIT", "feedbee")
    assert results.git_commit() == "feedbee"
    monkeypatch.delenv("CAKE_CUTE_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert results.git_commit().removesuffix("-dirty") == head.stdout.strip()


def _row(impl, op, res, T, H, tbps=3.0, copy=4.0, **extra):
    nbytes = cases.model_bytes(op, res, T, H)
    row = {"impl": impl, "op": op, "residual": res, "dtype": "bf16", "T": T, "H": H, "bytes": nbytes}
    if extra.get("error"):
        return {**row, **extra}
    gpu_us = nbytes / tbps / 1e6
    row.update(us=gpu_us + 20, gpu_us=gpu_us, host_us=20.0, tbps=tbps, copy_tbps=copy, frac_copy=tbps / copy)
    return {**row, **extra}


def _rows():
    rows = []
    for impl, tbps in (("cake_cute", 3.0), ("torch", 2.0), ("liger", 2.0)):
        for op in ("fwd", "bwd"):
            for res in (False, True):
                for T, H in ((32768, 4096), (1024, 131072)):
                    error = (
                        "RuntimeError: n = 131072 exceeds the Triton blocksize" if impl == "liger" else None
                    )
                    if error and H == 131072:
                        rows.append(_row(impl, op, res, T, H, error=error))
                    else:
                        rows.append(_row(impl, op, res, T, H, tbps=tbps))
    return rows


def test_rows_follow_the_schema():
    rows = _rows()
    assert all(results.schema_problems(r) == [] for r in rows)
    assert results.schema_problems({"impl": "x", "op": "fwd"}) == [
        "missing residual",
        "missing dtype",
        "missing T",
        "missing H",
        "missing gpu_us",
        "missing tbps",
        "missing copy_tbps",
        "missing frac_copy",
    ]
    assert results.schema_problems(dict(rows[0], tbps=None)) == ["missing tbps"]


def test_json_roundtrip_one_row_per_line(tmp_path):
    doc = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2025-01-02", "rows": _rows()}
    path = tmp_path / "sub" / "r.json"
    results.write_json(path, doc)
    assert results.load_json(path) == doc
    lines = path.read_text().splitlines()
    row_lines = [line for line in lines if line.startswith('  {"impl"')]
    assert [json.loads(line.rstrip(",")) for line in row_lines] == doc["rows"]
    assert not list(path.parent.glob("*.tmp"))


def test_load_json_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="no 'rows' list"):
        results.load_json(p)


def test_merge_rows_replaces_same_key():
    old = _rows()
    new = [dict(old[0], us=1.0), _row("quack", "fwd", False, 1, 8)]
    merged = results.merge_rows(old, new)
    assert len(merged) == len(old) + 1
    assert merged[0]["us"] == 1.0 and merged[-1]["impl"] == "quack"


def test_table_contains_rows_and_errors():
    rows = _rows()
    lines = results.format_table(rows).splitlines()
    assert len(lines) == len(rows) + 2
    assert lines[0].split() == ["impl", "op", "res", "dtype", "H", "T", "us", "gpu_us"] + [
        "TB/s",
        "copyTB/s",
        "%copy",
        "host_us",
    ]
    assert sum(line.startswith("liger") and "error: RuntimeError" in line for line in lines) == 4
    body = [line for line in lines[2:] if "error" not in line]
    assert len(body) == len(rows) - 4 and all(len(line) == len(lines[0]) for line in body)
    assert lines[2].split()[:2] == ["cake_cute", "fwd"]  # fwd before bwd, cake first within a shape


def test_table_handles_missing_numbers():
    row = {"impl": "cake_cute", "op": "fwd", "residual": False, "dtype": "bf16", "T": 1, "H": 8, "us": 5.0}
    cols = results.format_table([dict(row, gpu_us=None, tbps=None)]).splitlines()[2].split()
    assert cols[6:9] == ["5.0", "-", "-"]  # us, gpu_us, TB/s


# ---- plotting -------------------------------------------------------------------------------------------


def _doc(rows):
    return {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2025-01-02", "rows": rows}


def _training_rows():
    return [
        _row(impl, op, res, T, H, tbps=3.0 + T / 16384)
        for impl in ("cake_cute", "quack")
        for op in ("fwd", "bwd")
        for res in (False, True)
        for T in cases.TRAINING_TOKENS
        for H in (2048, 4096)
    ]


def test_axes_follow_the_grid():
    assert plot.axes_of(_rows()) == ("H", None)  # standard: one T per H
    assert plot.axes_of(_training_rows()) == ("H", "T")  # a line per T
    assert plot.axes_of([_row("cake_cute", "fwd", False, t, 4096) for t in (1, 16)]) == ("T", None)


def test_training_series_are_a_line_per_impl_op_residual_and_t():
    series = plot._series(_training_rows(), "T")
    assert len(series) == 2 * 2 * 2 * 4
    points = series[("bwd", "quack", "bf16", True, 8192)]
    assert points == [(2048, 3.5 / 4.0), (4096, 3.5 / 4.0)]


def test_plot_from_synthetic_json(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    results.write_json(path, _doc(_rows()))
    for doc, png in ((path, tmp_path / "out" / "r.png"), (_doc(_training_rows()), tmp_path / "t.png")):
        assert plot.plot_results(doc, png) is True
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_nothing_to_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row("liger", "fwd", False, 1, 8, error="boom")]
    assert plot.plot_results(_doc(rows), tmp_path / "n.png") is False
    assert not (tmp_path / "n.png").exists()


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert plot.plot_results(_doc(_rows()), tmp_path / "x.png") is False
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def _run_perf_plot(tmp_path, *args, hide=("torch",)):
    hidden = "; ".join(f"sys.modules[{m!r}] = None" for m in hide)
    code = (
        f"import sys, runpy; {hidden}; sys.argv = ['plot.py', *{list(map(str, args))!r}]; "
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'plot.py')!r}, run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_perf_plot_script_without_torch(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    results.write_json(path, _doc(_rows()))
    out = _run_perf_plot(tmp_path, path, "-o", tmp_path / "p.png")
    assert out.returncode == 0, out.stderr
    assert "cake_cute" in out.stdout and (tmp_path / "p.png").exists()


def test_perf_plot_script_without_matplotlib_exits_2_with_a_hint(tmp_path):
    path = tmp_path / "r.json"
    results.write_json(path, _doc(_rows()))
    out = _run_perf_plot(tmp_path, path, hide=("torch", "matplotlib"))
    assert out.returncode == 2
    assert "pip install matplotlib" in out.stderr and "--no-plot" in out.stderr
    table = _run_perf_plot(tmp_path, path, "--no-plot", hide=("torch", "matplotlib"))
    assert table.returncode == 0 and "cake_cute" in table.stdout


def test_plot_main_merges_files(tmp_path, capsys):
    rows = _rows()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    results.write_json(a, _doc(rows[:10]))
    results.write_json(b, _doc([dict(rows[0], us=1.5)] + rows[10:]))
    merged = tmp_path / "m.json"
    assert plot.main([str(a), str(b), "--write-json", str(merged), "--no-plot"]) == 0
    doc = results.load_json(merged)
    assert len(doc["rows"]) == len(rows) and doc["rows"][0]["us"] == 1.5
    assert doc["merged_from"] == [str(a), str(b)]
    assert "cake_cute" in capsys.readouterr().out


def test_plot_main_bad_file(tmp_path, capsys):
    assert plot.main([str(tmp_path / "missing.json"), "--no-plot"]) == 2
    assert "missing.json" in capsys.readouterr().err


# ---- no GPU ----------------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_available(), reason="a GPU is present: main() would run the sweep")
def test_main_without_gpu_fails_clearly(capsys):
    assert main(["--hidden", "4096", "--vs", "none"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "benchmarks/plot.py" in err


@pytest.mark.skipif(_cuda_available(), reason="a GPU is present: the script would run the sweep")
def test_perf_sweep_script_without_gpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--grid", "small", "--vs", "none"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "no CUDA GPU" in out.stderr


def test_help_works_without_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "--grid {standard,training,small,headdim}" in capsys.readouterr().out


def test_rows_and_plot_need_only_the_standard_library():
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); sys.modules['torch'] = None; "
        "from plot import load_bench_package; load_bench_package(); "
        "from _cake_cute_bench import results, plot; "
        "print(plot.axes_of([{'H': 8, 'T': 1}, {'H': 8, 'T': 2}]), results.row_key({'impl': 'x'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('T', None) ('x', None, False, None, None, None)"


# ---- the whole sweep on the CPU, through a stand-in for torch.cuda -------------------------------------


class _HostCuda:
    """torch.cuda for a sweep whose tensors live on the CPU: events read the host clock, so every
    call is timed with no spin to wait for."""

    OutOfMemoryError = RuntimeError

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = time.perf_counter()

        def query(self):
            return False

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def _sleep(self, cycles):
        pass

    def get_device_properties(self, device):
        facts = dict(name="Host CPU", major=0, minor=0, multi_processor_count=1, L2_cache_size=1 << 16)
        return type("Props", (), facts)()


class _HostTorch:
    """torch with ``cuda`` replaced by ``_HostCuda``."""

    cuda = _HostCuda()

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)


def test_a_training_sweep_on_the_host_writes_schema_rows(tmp_path, monkeypatch):
    from cake_cute.tools.bench import runner

    monkeypatch.setattr(timing.DeviceTimer, "warm_clocks", lambda self: None)
    path = tmp_path / "host.json"
    args = parse_args(
        ["--grid", "training", "--hidden", "64", "--tokens", "8,16", "--dtype", "fp32", "--vs", "torch"]
        + ["--no-cake", "--reps", "2", "--prof-reps", "2", "--warmup", "1", "--no-plot", "--json", str(path)]
    )
    assert runner.run(args, _HostTorch(), time.perf_counter(), device="cpu") == 0
    doc = results.load_json(path)
    assert doc["complete"] is True and doc["grid"] == "training" and doc["impls"] == ["torch"]
    rows = doc["rows"]
    assert [results.row_key(r) for r in rows] == [
        ("torch", op, res, "fp32", T, 64) for T in (8, 16) for res in (False, True) for op in ("fwd", "bwd")
    ]
    assert [results.schema_problems(r) for r in rows] == [[]] * 8, rows
    for r in rows:
        per_set = (4 if r["residual"] else 2) * r["T"] * 64 * 4
        assert r["buffer_sets"] == timing.buffer_sets_for(per_set, 1 << 16) > 1
        assert r["copy_buffer_sets"] == timing.buffer_sets_for(r["bytes"], 1 << 16)
        assert r["frac_copy"] == pytest.approx(r["tbps"] / r["copy_tbps"], rel=1e-3)
    assert {r["bwd_method"] for r in rows if r["op"] == "bwd"} == {"retain_graph"}
