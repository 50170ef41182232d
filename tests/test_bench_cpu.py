"""CPU tests of the benchmark's non-GPU parts: byte model, argument parsing, shapes, table / JSON writing,
trace attribution, plotting, and the clear failure of ``main()`` without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cake_cute import bench

ROOT = Path(__file__).resolve().parents[1]


# ---- byte model ---------------------------------------------------------------------------------------


def test_bytes_forward_plain_and_residual():
    T, H = 32768, 4096
    e = T * H * 2
    assert bench.model_bytes("fwd", False, T, H, "bf16") == 2 * e + 2 * H + 4 * T
    assert bench.model_bytes("fwd", True, T, H, "bf16") == 4 * e + 2 * H + 4 * T


def test_bytes_backward_plain_and_residual():
    T, H = 1024, 131072
    e = T * H * 2
    assert bench.model_bytes("bwd", False, T, H, "bf16") == 3 * e  # g, x in; dx out
    assert bench.model_bytes("bwd", True, T, H, "bf16") == 4 * e  # + g_residual in


def test_bytes_dtypes():
    assert bench.model_bytes("bwd", False, 2, 8, "fp32") == 3 * 2 * 8 * 4
    assert bench.model_bytes("fwd", False, 2, 8, "fp16") == 2 * 2 * 8 * 2 + 8 * 2 + 4 * 2
    assert bench.model_bytes("fwd", False, 2, 8, "bf16", w_dtype="fp32") == 2 * 2 * 8 * 2 + 8 * 4 + 4 * 2
    with pytest.raises(ValueError):
        bench.model_bytes("fwd", False, 2, 8, "int8")
    with pytest.raises(ValueError):
        bench.model_bytes("dgrad", False, 2, 8)


# ---- arguments and shapes ---------------------------------------------------------------------------------


def test_defaults():
    a = bench.parse_args([])
    assert a.dtype == ["bf16"] and a.residual == "both" and a.ops == ["fwd", "bwd"]
    assert a.vs == ["torch", "compile", "liger", "quack"]
    assert a.elements == 1 << 27 and not a.small and a.json is None and a.plot is None
    shapes = bench.sweep_shapes(a)
    assert [h for _, h in shapes] == list(bench.STANDARD_HIDDEN)
    assert all(t * h <= 1 << 27 and t == (1 << 27) // h for t, h in shapes)
    assert {h: t for t, h in shapes}[131072] == 1024


def test_flags():
    a = bench.parse_args(
        [
            "--hidden",
            "4096,8192",
            "--tokens",
            "1000",
            "--dtype",
            "bf16,fp16,fp32",
            "--residual",
            "on",
            "--vs",
            "torch,quack",
            "--ops",
            "bwd",
            "--json",
            "out.json",
            "--plot",
            "p.png",
            "--reps",
            "7",
            "--prof-reps",
            "4",
            "--warmup",
            "2",
        ]
    )
    assert a.hidden == [4096, 8192] and a.tokens == 1000 and a.dtype == ["bf16", "fp16", "fp32"]
    assert a.residual == "on" and a.vs == ["torch", "quack"] and a.ops == ["bwd"]
    assert (
        a.json == Path("out.json")
        and a.plot == Path("p.png")
        and (a.reps, a.prof_reps, a.warmup) == (7, 4, 2)
    )
    assert bench.sweep_shapes(a) == [(1000, 4096), (1000, 8192)]
    assert bench.parse_args(["--vs", "none"]).vs == []
    assert bench.parse_args(["--vs", "all"]).vs == list(bench.PEERS)


@pytest.mark.parametrize(
    "text,value",
    [
        ("134217728", 1 << 27),
        ("2^27", 1 << 27),
        ("2**27", 1 << 27),
        ("1<<27", 1 << 27),
        ("128M", 1 << 27),
        ("4k", 4096),
    ],
)
def test_elements_forms(text, value):
    assert bench.parse_count(text) == value
    a = bench.parse_args(["--elements", text, "--hidden", "1024"])
    assert bench.sweep_shapes(a) == [(value // 1024, 1024)]


def test_small_shapes():
    a = bench.parse_args(["--small"])
    assert bench.sweep_shapes(a) == [(1, 4096), (16, 4096), (256, 4096)]
    assert bench.sweep_shapes(bench.parse_args(["--small", "--hidden", "8192", "--tokens", "4"])) == [
        (4, 8192)
    ]


def test_shapes_skip_when_no_row_fits():
    assert bench.sweep_shapes(bench.parse_args(["--elements", "2048", "--hidden", "1024,4096"])) == [
        (2, 1024)
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "int8"],
        ["--vs", "torch,apex"],
        ["--ops", "fwd,dgrad"],
        ["--residual", "maybe"],
        ["--hidden", "0"],
        ["--hidden", "abc"],
        ["--reps", "0"],
        ["--warmup", "0"],
        ["--elements", "-5"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


# ---- naming, JSON, table ------------------------------------------------------------------------------


def test_default_json_path(tmp_path):
    p = bench.default_json_path("NVIDIA H200", "2025-01-02", root=tmp_path)
    assert p == tmp_path / "perf" / "results" / "2025-01-02-nvidia-h200.json"
    assert (
        bench.default_json_path("NVIDIA H100 80GB HBM3", "2025-01-02", small=True, root=tmp_path).name
        == "2025-01-02-nvidia-h100-80gb-hbm3-small.json"
    )
    assert bench.slugify("  ") == "unknown-gpu"


def test_git_commit_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("CAKE_CUTE_COMMIT", "feedbee")
    assert bench.git_commit() == "feedbee"
    monkeypatch.delenv("CAKE_CUTE_COMMIT")
    c = bench.git_commit()
    assert isinstance(c, str) and c and c != "feedbee"


def _rows():
    rows = []
    for impl in ("cake_cute", "torch", "liger"):
        for op in ("fwd", "bwd"):
            for res in (False, True):
                for T, H in ((32768, 4096), (1024, 131072)):
                    nbytes = bench.model_bytes(op, res, T, H)
                    if impl == "liger" and H == 131072:
                        rows.append(
                            {
                                "impl": impl,
                                "op": op,
                                "residual": res,
                                "dtype": "bf16",
                                "T": T,
                                "H": H,
                                "bytes": nbytes,
                                "error": "RuntimeError: Cannot launch Triton kernel since "
                                "n = 131072 exceeds the recommended Triton blocksize",
                            }
                        )
                        continue
                    gpu_us = nbytes / (3.0e6 if impl == "cake_cute" else 2.0e6)
                    copy = 4.0
                    rows.append(
                        {
                            "impl": impl,
                            "op": op,
                            "residual": res,
                            "dtype": "bf16",
                            "T": T,
                            "H": H,
                            "bytes": nbytes,
                            "us": gpu_us + 20,
                            "gpu_us": gpu_us,
                            "host_us": 20.0,
                            "tbps": nbytes / gpu_us / 1e6,
                            "copy_tbps": copy,
                            "frac_copy": nbytes / gpu_us / 1e6 / copy,
                        }
                    )
    return rows


def test_json_roundtrip_one_row_per_line(tmp_path):
    doc = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2025-01-02", "rows": _rows()}
    path = tmp_path / "sub" / "r.json"
    bench.write_json(path, doc)
    assert bench.load_json(path) == doc
    text = path.read_text()
    assert text.count("\n") >= len(doc["rows"])  # rows are one per line
    assert not list(path.parent.glob("*.tmp"))
    assert bench.load_json(path)["rows"][0]["impl"] == "cake_cute"


def test_load_json_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError):
        bench.load_json(p)


def test_merge_rows_replaces_same_key():
    old = _rows()
    new = [
        dict(old[0], us=1.0),
        {"impl": "quack", "op": "fwd", "residual": False, "dtype": "bf16", "T": 1, "H": 8},
    ]
    merged = bench.merge_rows(old, new)
    assert len(merged) == len(old) + 1
    assert merged[0]["us"] == 1.0


def test_table_contains_rows_and_errors():
    rows = _rows()
    table = bench.format_table(rows)
    lines = table.splitlines()
    assert len(lines) == len(rows) + 2
    for col in ("impl", "gpu_us", "TB/s", "copyTB/s", "host_us"):
        assert col in lines[0]
    assert any(line.startswith("liger") and "error: RuntimeError" in line for line in lines)
    body = [line for line in lines[2:] if "error" not in line]
    assert all(len(line) == len(lines[0]) for line in body)
    # fwd rows are listed before bwd rows, cake first within a shape
    assert lines[2].split()[:2] == ["cake_cute", "fwd"]


def test_table_handles_missing_numbers():
    row = {
        "impl": "cake_cute",
        "op": "fwd",
        "residual": False,
        "dtype": "bf16",
        "T": 1,
        "H": 8,
        "us": 5.0,
        "gpu_us": None,
        "tbps": None,
    }
    cols = bench.format_table([row]).splitlines()[2].split()
    assert cols[6] == "5.0" and cols[7] == "-" and cols[8] == "-"  # us, gpu_us, TB/s


# ---- device-time attribution -----------------------------------------------------------------------------


def test_per_call_device_us_brackets_calls():
    m = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    events = [
        ("setup_fwd_kernel", 0.0, 50.0),  # untimed setup before the first marker: excluded
        (m, 100.0, 1.0),
        ("rmsnorm_bwd", 102.0, 10.0),
        ("dw_reduce", 113.0, 2.0),
        ("Memset (Device)", 116.0, 0.5),
        (m, 120.0, 1.0),
        ("setup_fwd_kernel", 130.0, 50.0),  # between calls: excluded
        (m, 200.0, 1.0),
        ("rmsnorm_bwd", 202.0, 11.0),
        ("dw_reduce", 214.0, 2.0),
        (m, 220.0, 1.0),
    ]
    assert bench.per_call_device_us(reversed(events), 2) == [12.5, 13.0]
    with pytest.raises(RuntimeError):
        bench.per_call_device_us(events, 3)


def test_device_events_from_trace(tmp_path):
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1.0, "dur": 5.0},
            {"ph": "X", "cat": "kernel", "name": "k1", "ts": 2.5, "dur": 3.25},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 7.0, "dur": 1.0},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 9.0, "dur": 0.5},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "range", "ts": 1.0, "dur": 20.0},
            {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1.0},
        ]
    }
    p = tmp_path / "t.json"
    p.write_text(json.dumps(trace))
    assert bench.device_events_from_trace(p) == [
        ("k1", 2.5, 3.25),
        ("Memcpy DtoD (Device -> Device)", 7.0, 1.0),
        ("Memset (Device)", 9.0, 0.5),
    ]


# ---- plotting -------------------------------------------------------------------------------------------


def _doc(rows):
    return {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2025-01-02", "rows": rows}


def test_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    bench.write_json(path, _doc(_rows()))
    png = tmp_path / "out" / "r.png"
    assert bench.plot_results(path, png) is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_small_sweep_uses_tokens(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {
            "impl": "cake_cute",
            "op": op,
            "residual": False,
            "dtype": "bf16",
            "T": t,
            "H": 4096,
            "bytes": 100,
            "gpu_us": 1.0,
            "tbps": 1.0,
            "copy_tbps": 2.0,
        }
        for op in ("fwd", "bwd")
        for t in (1, 16, 256)
    ]
    png = tmp_path / "s.png"
    assert bench.plot_results(_doc(rows), png) is True and png.stat().st_size > 0


def test_plot_nothing_to_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [
        {"impl": "liger", "op": "fwd", "residual": False, "dtype": "bf16", "T": 1, "H": 8, "error": "boom"}
    ]
    assert bench.plot_results(_doc(rows), tmp_path / "n.png") is False
    assert not (tmp_path / "n.png").exists()


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert bench.plot_results(_doc(_rows()), tmp_path / "x.png") is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_perf_plot_script_without_torch_import(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    bench.write_json(path, _doc(_rows()))
    code = (
        f"import sys, runpy; sys.modules['torch'] = None; sys.argv = ['plot.py', {str(path)!r}, '-o', "
        f"{str(tmp_path / 'p.png')!r}]; runpy.run_path({str(ROOT / 'perf' / 'plot.py')!r}, run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "cake_cute" in out.stdout and (tmp_path / "p.png").exists()


# ---- no GPU ----------------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_cuda_available(), reason="a GPU is present: main() would run the sweep")
def test_main_without_gpu_fails_clearly(capsys):
    rc = bench.main(["--hidden", "4096", "--vs", "none"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "perf/plot.py" in err


@pytest.mark.skipif(_cuda_available(), reason="a GPU is present: the script would run the sweep")
def test_perf_sweep_script_without_gpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "perf" / "sweep.py"), "--small", "--vs", "none"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 2
    assert "no CUDA GPU" in out.stderr


def test_help_works_without_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    assert "--small" in capsys.readouterr().out


def test_module_level_needs_only_stdlib():
    spec = importlib.util.spec_from_file_location("_bench_isolated", ROOT / "cake_cute" / "bench.py")
    code = (
        "import sys, importlib.util; sys.modules['torch'] = None; "
        f"spec = importlib.util.spec_from_file_location('b', {str(spec.origin)!r}); "
        "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m; spec.loader.exec_module(m); "
        "print(m.model_bytes('bwd', True, 2, 8))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(4 * 2 * 8 * 2)


def test_plot_main_merges_files(tmp_path, capsys):
    rows = _rows()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    bench.write_json(a, _doc(rows[:10]))
    bench.write_json(b, _doc([dict(rows[0], us=1.5)] + rows[10:]))
    merged = tmp_path / "m.json"
    rc = bench.plot_main([str(a), str(b), "--write-json", str(merged), "--no-plot"])
    assert rc == 0
    doc = bench.load_json(merged)
    assert len(doc["rows"]) == len(rows) and doc["rows"][0]["us"] == 1.5
    assert doc["merged_from"] == [str(a), str(b)]
    assert "cake_cute" in capsys.readouterr().out


def test_plot_main_bad_file(tmp_path, capsys):
    assert bench.plot_main([str(tmp_path / "missing.json")]) == 2
