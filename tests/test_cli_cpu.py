"""The ``cake-cute`` command without a GPU: warmup (cold, then warm), info, check, and failures."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cake_cute import cli, warmup

WARMUP = ["warmup", "--arch", "sm_90a,sm_100a", "--dtype", "bf16", "--hidden", "4096,65536"]
VARIANTS = 24  # 2 archs x 2 H x 2 residual x (fwd, bwd) + 2 archs x 2 H x dw(fp32, bf16)
ROW = re.compile(
    r"^(cake_\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)/(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$"
)


def run_cli(*args, timeout=600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cake_cute.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    return proc, time.perf_counter() - start


def report_rows(stdout: str) -> dict[str, tuple[int, ...]]:
    """kernel -> (regs, stack, local, LDL, STL, smem, cluster, threads, ld bits, st bits)."""
    return {m.group(1): tuple(map(int, m.groups()[1:])) for m in map(ROW.match, stdout.splitlines()) if m}


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cli_cache"))
    cold = run_cli(*WARMUP, "--report", "--cache-dir", cache)
    warm_report = run_cli(*WARMUP, "--report", "--cache-dir", cache)
    warm_plain = run_cli(*WARMUP, "--cache-dir", cache)
    return cold, warm_report, warm_plain


def test_cold_warmup_compiles_everything_spill_free_and_vectorized(cold_and_warm):
    (proc, seconds), _, _ = cold_and_warm
    assert f"compiled {VARIANTS}, cached 0, failed 0" in proc.stdout, proc.stderr
    assert re.search(rf"\[\s*{VARIANTS}/{VARIANTS}\] compiled cake_", proc.stderr)
    print(f"cold warmup of {VARIANTS} variants: {seconds:.1f}s")
    rows = report_rows(proc.stdout)
    assert len(rows) == VARIANTS, proc.stdout
    spilling = [name for name, row in rows.items() if row[1:5] != (0, 0, 0, 0)]  # stack, local, LDL, STL
    narrow = [name for name, row in rows.items() if row[8] != 128]
    assert not spilling and not narrow, f"spilling: {spilling}, narrow loads: {narrow}\n{proc.stdout}"
    assert proc.returncode == 0, proc.stderr  # --report exits 1 on a spill


def test_second_warmup_compiles_nothing(cold_and_warm):
    _, (with_report, report_s), (plain, plain_s) = cold_and_warm
    for proc in (with_report, plain):
        assert f"compiled 0, cached {VARIANTS}, failed 0" in proc.stdout, proc.stderr
        assert "] compiled" not in proc.stderr
    assert len(report_rows(with_report.stdout)) == VARIANTS
    assert plain.returncode == 0, plain.stderr
    # Process start (torch + the DSL) is most of it; no compile may hide in here.
    assert plain_s < 20, f"warm warmup took {plain_s:.1f}s"
    print(f"warm warmup: {plain_s:.1f}s, with --report {report_s:.1f}s")


def test_info():
    proc, _ = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    for key in ("cake_cute", "nvidia-cutlass-dsl", "torch", "GPU", "cache", "cached kernels"):
        assert re.search(rf"^{key}\s", proc.stdout, re.M), proc.stdout
    if not torch.cuda.is_available():
        assert "no GPU" in proc.stdout


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "cake-cute"
    if not script.exists():
        pytest.skip("the console script is not installed next to this interpreter")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "warmup" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_check_without_gpu_exits_2():
    proc, _ = run_cli("check", "--quick")
    assert proc.returncode == 2
    assert "needs a supported GPU" in proc.stderr and "no CUDA GPU" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arch", "sm_80"], "unsupported arch 'sm_80'"),
        (["--dtype", "int8"], "unsupported dtype 'int8'"),
        (["--hidden", "0"], "hidden size 0 is outside"),
    ],
)
def test_bad_arguments_exit_nonzero_with_a_clear_message(args, message):
    proc, _ = run_cli("warmup", *args)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_failed_compile_exits_1_and_names_the_kernel(tmp_path, monkeypatch, capsys):
    def broken(spec):
        raise RuntimeError(f"cannot compile {spec.hidden}")

    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warmup, "get_kernel", broken)
    code = cli.main(
        [
            "warmup",
            "--arch",
            "sm_90a",
            "--hidden",
            "4096",
            "--residual",
            "off",
            "--jobs",
            "1",
            "--cache-dir",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1
    assert "compiled 0, cached 0, failed 4" in out
    assert (
        "FAILED cake_fwd_sm_90a_bf16_wbf16_h4096_off0" in err and "RuntimeError: cannot compile 4096" in err
    )


def test_report_exits_1_when_a_kernel_spills(tmp_path, monkeypatch, capsys):
    def fake_reports(specs, jobs=None):
        spills = {s: 16 if s.kind == "bwd" else 0 for s in specs}
        return [
            dict(
                name=s.name(),
                registers=80,
                stack_bytes=spills[s],
                local_bytes=0,
                local_loads=1,
                local_stores=1,
                shared_bytes=1024,
                cluster_n=1,
                threads=256,
                global_load_width_bits=128,
                global_store_width_bits=128,
            )
            for s in specs
        ]

    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warmup, "get_kernel", lambda spec: None)
    monkeypatch.setattr(warmup, "collect_reports", fake_reports)
    code = cli.main(["warmup", "--arch", "sm_90a", "--residual", "off", "--jobs", "1", "--report"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "1 kernel(s) spill registers: cake_bwd_sm_90a_bf16_wbf16_h4096_off0" in err
    assert "compiled 4, cached 0, failed 0" in out


def test_arch_aliases_and_defaults():
    assert warmup.normalize_arch("sm_90") == "sm_90a"
    assert warmup.normalize_arch("sm_100a") == "sm_100a"
    if not torch.cuda.is_available():
        assert warmup.local_archs() == ("sm_90a", "sm_100a")
