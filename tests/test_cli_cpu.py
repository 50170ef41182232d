"""The ``cake-cute`` command without a GPU: warmup (cold, then warm, concurrent), info, check, and
every way an argument can be refused."""

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cake_cute.calls import gated_call
from cake_cute.gated import module as gated_module
from cake_cute.gated import ops as gated_ops
from cake_cute.gated.module import CakeGatedRMSNorm
from cake_cute.runtime.cache import is_cached_on_disk
from cake_cute.runtime.specs import KernelSpec, ReduceSpec
from cake_cute.tools import cli, info, kernel_report, warmup
from cake_cute.tools.cubin import spill_free
from cake_cute.vocab import SUPPORTED_ARCHS, dtype_name, torch_dtype

WARMUP = ["warmup", "--arch", "sm_90a,sm_100a", "--dtype", "bf16", "--hidden", "4096,65536"]
# One arch, bf16, H = 4096, plain mode: 4 variants (forward, backward, dW into FP32 and into bf16).
ONE_ARCH_PLAIN = ["warmup", "--arch", "sm_90a", "--residual", "off", "--jobs", "1"]
VARIANTS = 24  # 2 archs x 2 H x 2 residual x (fwd, bwd) + 2 archs x 2 H x dw(fp32, bf16)
# kernel, regs, stack B, local B, LDL/STL, atomics, cluster, threads, ld bits, st bits, config
ROW = re.compile(r"^(cake_\w+)" + r"\s+(\d+)" * 3 + r"\s+(\d+)/(\d+)" + r"\s+(\d+)" * 5 + r"\s+(\S.*)$")


def run_cli(*args, timeout=600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cake_cute", *args], capture_output=True, text=True, timeout=timeout
    )
    return proc, time.perf_counter() - start


def report_rows(stdout: str) -> dict[str, tuple]:
    """kernel -> (regs, stack, local, LDL, STL, atomics, cluster, threads, ld bits, st bits, config)."""
    return {
        m.group(1): (*map(int, m.groups()[1:-1]), m.group(12))
        for m in map(ROW.match, stdout.splitlines())
        if m
    }


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cli_cache"))
    cold = run_cli(*WARMUP, "--report", "--cache-dir", cache)
    warm_report = run_cli(*WARMUP, "--report", "--cache-dir", cache)
    warm_plain = run_cli(*WARMUP, "--cache-dir", cache)
    return cold, warm_report, warm_plain


def test_cold_warmup_compiles_everything_spill_free_and_vectorized(cold_and_warm):
    (proc, seconds), _, _ = cold_and_warm
    assert f"compiled {VARIANTS}, loaded 0 (compiled by another process meanwhile), cached 0, failed 0" in (
        proc.stdout
    ), proc.stderr
    assert re.search(rf"\[\s*{VARIANTS}/{VARIANTS}\] compiled cake_", proc.stderr)
    print(f"cold warmup of {VARIANTS} variants: {seconds:.1f}s")
    rows = report_rows(proc.stdout)
    assert len(rows) == VARIANTS, proc.stdout
    spilling = [name for name, row in rows.items() if row[1:6] != (0, 0, 0, 0, 0)]  # + atomics
    narrow = [name for name, row in rows.items() if row[8] != 128]
    assert not spilling and not narrow, f"spilling: {spilling}, narrow loads: {narrow}\n{proc.stdout}"
    configs = {name: row[10] for name, row in rows.items()}
    assert all(c.startswith("vec=") for c in configs.values()), configs
    assert all(re.search(r" regs<=\d+ smem=\d+B ", c) for n, c in configs.items() if n.startswith("cake_bwd"))
    assert all(" col_lanes=" in c for n, c in configs.items() if n.startswith("cake_dw")), configs
    assert kernel_report.REPORT_LEGEND in proc.stdout
    assert proc.returncode == 0, proc.stderr  # --report exits 1 on a spill


def test_second_warmup_compiles_nothing(cold_and_warm):
    _, (with_report, report_s), (plain, plain_s) = cold_and_warm
    for proc in (with_report, plain):
        assert (
            f"compiled 0, loaded 0 (compiled by another process meanwhile), cached {VARIANTS}, failed 0"
            in (proc.stdout)
        ), proc.stderr
        assert "] compiled" not in proc.stderr
    assert len(report_rows(with_report.stdout)) == VARIANTS
    assert plain.returncode == 0, plain.stderr
    # Process start (torch + the DSL) is most of it; no compile may hide in here.
    assert plain_s < 20, f"warm warmup took {plain_s:.1f}s"
    print(f"warm warmup: {plain_s:.1f}s, with --report {report_s:.1f}s")


def test_info():
    proc, _ = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    for key in (
        "cake_cute",
        "nvidia-cutlass-dsl",
        "torch",
        "GPU",
        "cache",
        "cached kernels",
        "native host path",
    ):
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


EMPTY = ("--arch", "archs"), ("--dtype", "dtypes"), ("--hidden", "hidden sizes")
REFUSED = [
    (option, value, f"argument {option}: expected one or more {what} separated by commas, got {value!r}")
    for option, what in EMPTY
    for value in ("", ",")
]
REFUSED += [
    ("--jobs", value, f"argument --jobs: expected a positive integer, got {value!r}")
    for value in ("0", "-1", "two")
]
REFUSED += [
    ("--arch", "sm_80", "unsupported arch 'sm_80'"),
    ("--dtype", "int8", "unsupported dtype 'int8'"),
    ("--hidden", "0", "hidden size 0 is outside"),
    ("--hidden", "4k", "argument --hidden: hidden size '4k' is not an integer"),
    ("--weight-offset", "inf", "argument --weight-offset: expected a finite number, got 'inf'"),
    ("--fp8", "", "argument --fp8: expected one or more FP8 recipes separated by commas, got ''"),
    ("--fp8", "nvfp4", "recipe must be one of ('mxfp8', '1x128'), got 'nvfp4'"),
    ("--gated", "", "argument --gated: expected one or more gated forms separated by commas, got ''"),
    ("--gated", "100/3", "group size 3 does not divide the hidden size 100"),
    ("--gated", "128/x", "hidden size 'x' is not an integer"),
    ("--gated", "0/0", "hidden size 0 is outside"),
    ("--gate-activation", "", "argument --gate-activation: expected one or more gate activations"),
    ("--gate-activation", "gelu", "activation must be one of ('silu', 'sigmoid'), got 'gelu'"),
]


@pytest.mark.parametrize("option, value, message", REFUSED)
def test_bad_warmup_arguments_exit_2_with_a_clear_message(option, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["warmup", option, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--hidden", ""], ["--dtype", "x"], ["--arch", ""]])
def test_bad_info_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["info", *args])
    assert exit_info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["info", "--bogus"], "usage: cake-cute info "),
        (["check", "--quick", "--bogus"], "usage: cake-cute check "),
        (["warmup", "--bogus", "x"], "usage: cake-cute warmup "),
        (["bench", "--bogus"], "usage: cake-cute bench "),
        (["--bogus"], "usage: cake-cute [-h]"),
        (["--bogus", "info"], "usage: cake-cute [-h]"),
    ],
)
def test_an_unknown_option_prints_the_usage_of_the_command_it_follows(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(usage) and "error: unrecognized arguments: --bogus" in err


@pytest.mark.parametrize(
    ("make_path", "problem"),
    [
        (lambda tmp: tmp / "file", "is not a directory"),
        (lambda tmp: tmp / "file" / "cache", "lies under {tmp}/file, which is not a directory"),
    ],
    ids=["a-file", "under-a-file"],
)
def test_info_reports_a_cache_path_that_is_not_a_directory(tmp_path, monkeypatch, capsys, make_path, problem):
    """The table still prints (versions, GPU); the cache line's problem goes to stderr, naming the path
    and CAKE_CUTE_CACHE_DIR, and the exit status is 2. Nothing is created."""
    (tmp_path / "file").write_text("not a directory")
    path = make_path(tmp_path)
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(path))
    assert cli.main(["info"]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"^cached kernels\s+none: the cache path is not a directory$", out, re.M), out
    assert err == (
        f"cake-cute info: the kernel cache path {path} (CAKE_CUTE_CACHE_DIR) "
        f"{problem.format(tmp=tmp_path)}; point CAKE_CUTE_CACHE_DIR at a directory\n"
    )
    assert (tmp_path / "file").read_text() == "not a directory"


def test_info_accepts_a_cache_path_not_created_yet(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path / "later" / "cache"))
    assert cli.main(["info"]) == 0
    assert "0 for this version, 0 files in all" in capsys.readouterr().out
    assert not (tmp_path / "later").exists()


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores mode bits, but not sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked


@pytest.mark.parametrize(
    "make_dir, problem",
    [
        (lambda tmp: tmp / "file", "is not a directory"),
        (lambda tmp: tmp / "missing" / "cache", "its parent directory"),
        (_unwritable_dir, "is not writable"),
    ],
    ids=["a-file", "missing-parent", "unwritable"],
)
def test_unusable_cache_dir_is_one_line_and_exit_2_before_compiling(
    tmp_path, monkeypatch, capsys, make_dir, problem
):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.delenv("CAKE_CUTE_CACHE_DIR", raising=False)

    def no_warmup(*args, **kwargs):
        raise AssertionError("compiling started despite an unusable cache directory")

    monkeypatch.setattr(warmup, "warm", no_warmup)
    code = cli.main(["warmup", "--arch", "sm_90a", "--cache-dir", str(make_dir(tmp_path))])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("cake-cute warmup: cannot use the cache directory: ")
    assert problem in err and not out


def test_default_cache_dir_parents_are_created(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh" / "home-cache"))
    monkeypatch.delenv("CAKE_CUTE_CACHE_DIR", raising=False)
    assert cli._use_cache_dir(None) is None
    assert (tmp_path / "fresh" / "home-cache" / "cake_cute").is_dir()


def test_weight_offset_compiles_gemma_kernels(tmp_path, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (asked.append(spec), "compiled"))
    code = cli.main([*ONE_ARCH_PLAIN, "--weight-offset", "1"] + ["--cache-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert [s.weight_offset for s in asked if s.kind != "dw"] == [1.0, 1.0]
    assert [s.name() for s in asked] == [
        "cake_fwd_sm_90a_bf16_wbf16_h4096_off1",
        "cake_bwd_sm_90a_bf16_wbf16_h4096_off1",
        "cake_dw_sm_90a_fp32_h4096",
        "cake_dw_sm_90a_bf16_h4096",
    ]


def test_fp8_adds_the_quantizing_forwards(tmp_path, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (asked.append(spec), "compiled"))
    code = cli.main([*ONE_ARCH_PLAIN, "--fp8", "mxfp8", "--weight-offset", "1", "--cache-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert [s.name() for s in asked if "mxfp8" in s.kind] == [
        "cake_fwd_mxfp8_sm_90a_bf16_wbf16_h4096_off1",
        "cake_fwd_mxfp8_persistent_sm_90a_bf16_wbf16_h4096_off1",
        "cake_fwd_mxfp8_y_sm_90a_bf16_wbf16_h4096_off1",
        "cake_fwd_mxfp8_y_persistent_sm_90a_bf16_wbf16_h4096_off1",
    ]


def test_gated_adds_the_gated_norms_kernels(tmp_path, monkeypatch, capsys):
    """``--gated 128,8192/1024``: per form the fused forward and backward in both orders, the FP32 dW
    reductions into FP32 and the weight's dtype, for whole rows the statistics kernel (FlashInfer's
    functional backward), and what the other cast policies launch in bf16 (the gate-then-norm fused
    kernels with a unit weight, the plain kernels at the group's width, in FP32 too for groups under
    ``"scale_then_round"``); the plain variants of --hidden first."""
    plain = _warmed_specs(monkeypatch, tmp_path, *ONE_ARCH_PLAIN)
    asked = _warmed_specs(monkeypatch, tmp_path, *ONE_ARCH_PLAIN, "--gated", "128,8192/1024")
    assert asked[: len(plain)] == plain
    assert [s.name() for s in asked[len(plain) :]] == [
        "cake_gated_fwd_sm_90a_bf16_wbf16_h128_nbg_off0",
        "cake_gated_fwd_sm_90a_bf16_wbf16_h128_gbn128_off0",
        "cake_gated_bwd_sm_90a_bf16_wbf16_h128_nbg_off0",
        "cake_gated_bwd_sm_90a_bf16_wbf16_h128_gbn128_off0",
        "cake_dw_sm_90a_fp32_h128",
        "cake_dw_sm_90a_bf16_h128",
        "cake_gated_rstd_sm_90a_bf16_wbf16_h128_nbg_off0",
        "cake_fwd_sm_90a_bf16_wbf16_h128_off0",
        "cake_bwd_sm_90a_bf16_wbf16_h128_off0",
        "cake_gated_fwd_sm_90a_bf16_wbf16_h8192_nbg1024_off0",
        "cake_gated_fwd_sm_90a_bf16_wbf16_h8192_gbn1024_off0",
        "cake_gated_bwd_sm_90a_bf16_wbf16_h8192_nbg1024_off0",
        "cake_gated_bwd_sm_90a_bf16_wbf16_h8192_gbn1024_off0",
        "cake_dw_sm_90a_fp32_h8192",
        "cake_dw_sm_90a_bf16_h8192",
        "cake_fwd_sm_90a_bf16_wbf16_h1024_off0",
        "cake_bwd_sm_90a_bf16_wbf16_h1024_off0",
        "cake_dw_sm_90a_fp32_h1024",
        "cake_dw_sm_90a_bf16_h1024",
        "cake_fwd_sm_90a_fp32_wfp32_h1024_off0",
        "cake_bwd_sm_90a_fp32_wfp32_h1024_off0",
    ]
    assert "warmup: 25 variants, compiled 25, " in capsys.readouterr().out.splitlines()[-1]


def test_gate_activation_adds_the_sigmoid_kernels(tmp_path, monkeypatch):
    """``--gated 128 --gate-activation silu,sigmoid``: the SiLU variants of ``--gated 128`` in their
    order, then the same fused kernels gating with sigmoid (FlashInfer's statistics kernel is SiLU's
    alone); ``--gate-activation sigmoid`` warms no SiLU gated kernel."""
    silu = _warmed_specs(monkeypatch, tmp_path, *ONE_ARCH_PLAIN, "--gated", "128")
    both = _warmed_specs(
        monkeypatch, tmp_path, *ONE_ARCH_PLAIN, "--gated", "128", "--gate-activation", "silu,sigmoid"
    )
    assert [s for s in both if s in silu] == silu
    assert [s.name() for s in both if s not in silu] == [
        "cake_gated_fwd_sm_90a_bf16_wbf16_h128_nbg_off0_sigmoid",
        "cake_gated_fwd_sm_90a_bf16_wbf16_h128_gbn128_off0_sigmoid",
        "cake_gated_bwd_sm_90a_bf16_wbf16_h128_nbg_off0_sigmoid",
        "cake_gated_bwd_sm_90a_bf16_wbf16_h128_gbn128_off0_sigmoid",
    ]
    sigmoid = _warmed_specs(
        monkeypatch, tmp_path, *ONE_ARCH_PLAIN, "--gated", "128", "--gate-activation", "sigmoid"
    )
    gated = [s for s in sigmoid if s.kind.startswith("gated")]
    assert gated and {s.activation for s in gated} == {"sigmoid"}


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("policy", ["one_rounding", "round_then_scale", "scale_then_round"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("w_mode", ["same", "fp32"])
@pytest.mark.parametrize(("group_size", "norm_before_gate"), [(None, True), (16, False), (16, True)])
def test_the_gated_warmup_holds_every_kernel_a_gated_module_launches(
    monkeypatch, policy, dtype, w_mode, group_size, norm_before_gate, activation
):
    """What a ``CakeGatedRMSNorm`` hands to the kernels (the gated entry, or the plain norm for the
    class's own casts), as the launches name their variants (``gated_ops.forward_spec`` and its other
    kinds; the plain launch's specs), is among ``gated_variant_specs`` of its form, dtype, weight
    dtype, offset and gate activation."""
    launched = _record_gated_module_launches(monkeypatch)
    act = torch_dtype(dtype)
    norm = CakeGatedRMSNorm(
        64,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=0.5,
        cast_policy=policy,
        activation=activation,
        dtype=act if w_mode == "same" else torch.float32,
    )
    x, z = torch.randn(2, 3, 64, dtype=act), torch.randn(2, 3, 64, dtype=act)
    norm(x, z)
    warmed = warmup.gated_variant_specs(
        ["sm_90a"], [dtype], [(64, group_size or 64)], [w_mode], 0.5, activations=[activation]
    )
    assert launched and set(launched) <= set(warmed), set(launched) - set(warmed)


@pytest.mark.parametrize("policy", ["one_rounding", "round_then_scale", "scale_then_round"])
@pytest.mark.parametrize(("x_dtype", "z_dtype"), [("fp32", "bf16"), ("bf16", "fp32"), ("fp16", "bf16")])
@pytest.mark.parametrize(("group_size", "norm_before_gate"), [(None, True), (16, False)])
def test_the_gated_warmup_of_both_dtypes_holds_a_dtype_mix(
    monkeypatch, policy, x_dtype, z_dtype, group_size, norm_before_gate
):
    """A gate of another dtype than x's (the Hugging Face classes' offset-free mixes, a weight in
    the model's dtype) runs kernels of x's dtype and FP32 kernels: among the gated warmup of x's
    dtype and fp32 with both weight dtypes (docs/gated.md)."""
    launched = _record_gated_module_launches(monkeypatch)
    norm = CakeGatedRMSNorm(
        64,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        cast_policy=policy,
        dtype=torch.bfloat16,
    )
    x, z = (torch.randn(2, 3, 64, dtype=torch_dtype(name)) for name in (x_dtype, z_dtype))
    norm(x, z)
    form = [(64, group_size or 64)]
    warmed = warmup.gated_variant_specs(["sm_90a"], [x_dtype, "fp32"], form, ["same", "fp32"])
    assert launched and set(launched) <= set(warmed), set(launched) - set(warmed)


def _record_gated_module_launches(monkeypatch) -> list:
    """The variants a ``CakeGatedRMSNorm`` launches from now on (the gated entry's and the plain
    norm's, on sm_90a), in a list that its calls fill."""
    launched = []
    real_gated, real_plain = gated_module.cake_gated_rmsnorm, gated_module.cake_rmsnorm

    def gated(x, z, w, eps, **options):
        call = gated_call(
            x,
            z,
            w,
            eps,
            options["group_size"],
            options["norm_before_gate"],
            options["weight_offset"],
            options["activation"],
        )
        forward = gated_ops.forward_spec(call)
        launched.extend(dataclasses.replace(forward, kind=kind) for kind in warmup.GATED_KINDS)
        launched.append(ReduceSpec("sm_90a", dtype_name(w.dtype), x.shape[-1]))
        return real_gated(x, z, w, eps, **options)

    def plain(x, w, eps, weight_offset=0.0):
        variant = ("sm_90a", dtype_name(x.dtype), dtype_name(w.dtype), x.shape[-1])
        launched.extend(KernelSpec(kind, *variant, weight_offset=weight_offset) for kind in ("fwd", "bwd"))
        launched.append(ReduceSpec("sm_90a", dtype_name(w.dtype), x.shape[-1]))
        return real_plain(x, w, eps, weight_offset=weight_offset)

    monkeypatch.setattr(gated_ops, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(gated_module, "cake_gated_rmsnorm", gated)
    monkeypatch.setattr(gated_module, "cake_rmsnorm", plain)
    return launched


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("w_mode", ["same", "fp32"])
def test_the_gated_warmup_holds_flashinfers_functional_backward(launches, dtype, w_mode):
    """What ``cake_rmsnorm_silu_gate_train_backward`` launches (the statistics kernel, the backward,
    dW in the weight's dtype) is among ``gated_variant_specs`` of its whole-row form."""
    from cake_cute import cake_rmsnorm_silu_gate_train_backward

    act = torch_dtype(dtype)
    x, z, g = (torch.randn(3, 2, 128, dtype=act) for _ in range(3))
    w = torch.ones(128, dtype=act if w_mode == "same" else torch.float32)
    cake_rmsnorm_silu_gate_train_backward(g, x, z, w)
    launched = [spec for spec, _ in launches]
    warmed = warmup.gated_variant_specs(["sm_90a"], [dtype], [(128, 128)], [w_mode])
    assert len(launched) == 3 and set(launched) <= set(warmed), set(launched) - set(warmed)


# Two archs, bf16 and FP32 rows, w in x's dtype and in FP32, residual off and on, Gemma's offset:
# 12 (arch, x dtype, w dtype, residual), bf16 rows taking both w dtypes (FP32 rows' two are one).
MANY_SETTINGS = ["warmup", "--arch", "sm_90a,sm_100a", "--dtype", "bf16,fp32", "--w-dtype", "both"]
MANY_SETTINGS += ["--weight-offset", "1", "--jobs", "1"]


def _warmed_specs(monkeypatch, tmp_path, *args) -> list:
    """The specs ``cake-cute *args`` brings into the cache, in order (compiling nothing)."""
    asked = []
    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (asked.append(spec), "compiled"))
    assert cli.main([*args, "--cache-dir", str(tmp_path)]) == 0
    return asked


def test_memory_efficient_adds_exactly_the_memory_efficient_backwards(tmp_path, monkeypatch, capsys):
    default = _warmed_specs(monkeypatch, tmp_path, *MANY_SETTINGS)
    both = _warmed_specs(monkeypatch, tmp_path, *MANY_SETTINGS, "--memory-efficient")
    assert len(default) == 12 * 2 + 2 * 2  # (fwd, bwd) each, and dW into FP32 and into bf16 per arch
    assert not any(getattr(s, "memory_efficient", False) for s in default)
    added = [s for s in both if s not in default]
    assert [s for s in both if s in default] == default  # the default variants unchanged, in order
    # One per default backward, the spec launch.backward_kernels looks the mode's up by: one summand of
    # g when no graph pass folds a sum into the backward.
    assert added == [dataclasses.replace(s, memory_efficient=True) for s in default if s.kind == "bwd"]
    assert len(added) == 12 and len(both) == 40
    assert {(s.kind, s.g_parts, s.memory_efficient, s.weight_offset) for s in added} == {
        ("bwd", 1, True, 1.0)
    }
    assert all(s.name().endswith("_off1_meff") for s in added)
    assert "warmup: 40 variants, compiled 40, " in capsys.readouterr().out.splitlines()[-1]


def test_memory_efficient_backwards_are_reported(tmp_path, monkeypatch, capsys):
    reported = []

    def fake_reports(specs, jobs=None):
        reported.extend(specs)
        return [dict(CLEAN_REPORT, name=s.name()) for s in specs]

    monkeypatch.setattr(kernel_report, "collect_reports", fake_reports)
    _warmed_specs(monkeypatch, tmp_path, *ONE_ARCH_PLAIN, "--memory-efficient", "--report")
    out = capsys.readouterr().out
    assert [s.name() for s in reported] == [
        "cake_fwd_sm_90a_bf16_wbf16_h4096_off0",
        "cake_bwd_sm_90a_bf16_wbf16_h4096_off0",
        "cake_bwd_sm_90a_bf16_wbf16_h4096_off0_meff",
        "cake_dw_sm_90a_fp32_h4096",
        "cake_dw_sm_90a_bf16_h4096",
    ]
    assert re.search(r"^cake_bwd_sm_90a_bf16_wbf16_h4096_off0_meff\s", out, re.M), out


def test_a_memory_efficient_backward_compiles_without_a_gpu(tmp_path, monkeypatch):
    """One memory-efficient backward compiled for sm_90a by the warmup's code path, then read back as
    ``--report`` reads it: spill-free, no global atomics, 128-bit global accesses."""
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    spec = KernelSpec("bwd", "sm_90a", "bf16", "bf16", 4096, memory_efficient=True)  # as the mode looks it up
    assert spec in warmup.variant_specs(["sm_90a"], ["bf16"], [4096], memory_efficient=True)
    result = warmup.warm([spec], jobs=1)
    assert [o.spec for o in result.compiled] == [spec], [o.error for o in result.failed]
    assert is_cached_on_disk(spec)
    (report,) = kernel_report.collect_reports([spec], jobs=1)
    assert spill_free(report) and (report["local_loads"], report["local_stores"]) == (0, 0), report
    assert report["global_atomics"] == 0, report
    assert report["global_load_width_bits"] == report["global_store_width_bits"] == 128, report


@pytest.mark.parametrize("python_path", [False, True], ids=["native", "python-path"])
def test_warmup_builds_the_native_host_path(python_path, tmp_path, monkeypatch, capsys):
    from cake_cute.runtime import native

    if python_path:
        monkeypatch.setenv(native.PYTHON_PATH_ENV, "1")
    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (None, "compiled"))
    assert cli.main([*ONE_ARCH_PLAIN, "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = out.splitlines()[-1]
    if python_path:
        assert "native host path: not built (CAKE_CUTE_PYTHON_PATH=1)" in out
        assert "; native host path skipped (0.0s); " in summary
    else:
        assert f"native host path: {native.library_path()}" in out and native.library_path().exists()
        assert re.search(r"; native host path (already )?built \(\d+\.\ds\); ", summary), summary
    assert re.fullmatch(r"warmup: 4 variants, .* \(\d+\.\ds\); native host path .*; total \d+\.\ds", summary)


def _fake_native_build(monkeypatch, tmp_path, events: list, fails: bool = False):
    """native.build replaced by one that records the output printed before it ran and takes 0.2 s,
    for a library not on disk yet."""
    import io

    from cake_cute.runtime import native

    library = tmp_path / "native.so"
    progress = io.StringIO()

    def build():
        events.append(("build", progress.getvalue()))
        time.sleep(0.2)
        if fails:
            raise RuntimeError("no C++ compiler")
        library.write_bytes(b"")
        return library

    monkeypatch.delenv(native.PYTHON_PATH_ENV, raising=False)
    monkeypatch.setattr(native, "library_path", lambda: library)
    monkeypatch.setattr(native, "build", build)
    return progress


@pytest.mark.parametrize("fails", [False, True], ids=["built", "failed"])
def test_the_native_build_is_announced_before_it_starts_and_timed(fails, tmp_path, monkeypatch):
    events = []
    progress = _fake_native_build(monkeypatch, tmp_path, events, fails)
    done = warmup.build_native(progress)
    assert events == [("build", warmup.NATIVE_ANNOUNCEMENT + "\n")]
    assert done.seconds >= 0.2
    if fails:
        assert done.status == warmup.NOT_BUILT and "no C++ compiler" in done.line()
    else:
        assert done.status == warmup.BUILT and done.line() == f"native host path: {tmp_path / 'native.so'}"
        again = warmup.build_native(progress)  # on disk now: nothing announced, nothing built
        assert again.status == warmup.ON_DISK and len(events) == 2
        assert progress.getvalue().count(warmup.NATIVE_ANNOUNCEMENT) == 1
    assert done.summary() == f"native host path {done.status} ({done.seconds:.1f}s)"


def test_warmup_announces_each_step_and_sums_them_up(tmp_path, monkeypatch, capsys):
    """The bare warmup's output: the kernels' step announced before the first compile, the native
    build announced before it starts, and a last line with each step's count and time and the total."""
    events = []
    _fake_native_build(monkeypatch, tmp_path, events)
    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (None, "compiled"))
    assert cli.main([*ONE_ARCH_PLAIN, "--cache-dir", str(tmp_path / "cache")]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == "4 variants: 0 cached, 4 to compile, compiling them in 1 process ..."
    assert err.splitlines()[-1] == warmup.NATIVE_ANNOUNCEMENT
    summary = out.splitlines()[-1]
    kernels, native_part, total = summary.split("; ")
    assert kernels.startswith("warmup: 4 variants, compiled 4, ")
    assert re.fullmatch(r"native host path built \(0\.[2-9]s\)", native_part), native_part
    seconds = [float(t) for t in re.findall(r"\((\d+\.\d)s\)", summary)]
    assert float(total.removeprefix("total ").removesuffix("s")) >= sum(seconds) - 0.1


def test_version_and_help_say_what_a_bare_command_does():
    from cake_cute import __version__

    version, _ = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"cake-cute {__version__}"
    help_text, _ = run_cli("--help")
    assert help_text.returncode == 0
    assert "Without a command: on a supported GPU, `check` then `bench`; without one, `warmup`" in " ".join(
        help_text.stdout.split()
    )


def test_importing_cake_cute_imports_no_tool():
    code = "import sys, cake_cute; print(sorted(m for m in sys.modules if m.startswith('cake_cute.tools')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_info_shows_the_config_per_kind(capsys):
    assert cli.main(["info", "--hidden", "4096,65536", "--arch", "sm_90a", "--dtype", "bf16"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sm_90a ")]
    # Per H: (fwd, bwd) x (plain, residual), dw, the FP8 forwards of 2 recipes x (plain, residual), and
    # the 2 persistent ones at H = 4096 (rows split over clusters have none).
    assert len(lines) == 2 * 9 + 2
    width = info.CONFIG_LABEL_WIDTH
    expected = kernel_report.describe_config(KernelSpec("bwd", "sm_90a", "bf16", "bf16", 65536, True))
    assert f"{'sm_90a bf16 H=65536 bwd residual':<{width}}{expected}" in lines
    reduce = kernel_report.describe_config(ReduceSpec("sm_90a", "fp32", 4096))
    assert f"{'sm_90a bf16 H=4096 dw':<{width}}{reduce}" in lines
    persistent_spec = KernelSpec("fwd_1x128_persistent", "sm_90a", "bf16", "bf16", 4096)
    persistent = kernel_report.describe_config(persistent_spec)
    assert f"{'sm_90a bf16 H=4096 fwd 1x128 persistent':<{width}}{persistent}" in lines
    assert "persistent 4/SM" in persistent
    assert all("vec=" in line for line in lines)


# A cubin report of a kernel that neither spills nor has atomics (as collect_reports returns it).
CLEAN_REPORT = dict(
    registers=80,
    stack_bytes=0,
    local_bytes=0,
    local_loads=0,
    local_stores=0,
    global_atomics=0,
    data_atomics=0,
    cluster_n=2,
    threads=256,
    global_load_width_bits=128,
    global_store_width_bits=128,
    config="-",
    programs_fit=True,
)


def test_report_has_units_a_legend_and_the_config():
    config = "vec=8 tpr=256 vpt=2 cluster=2 rows/cta=1 stages=2 regs<=128"
    report = dict(CLEAN_REPORT, name="cake_bwd_x", config=config)
    lines = kernel_report.format_report([report]).splitlines()
    header = "kernel regs stack B local B LDL/STL atomics cluster threads ld bits st bits config"
    assert lines[0].split() == header.split()
    assert lines[1].split() == "cake_bwd_x 80 0 0 0/0 0 2 256 128 128".split() + report["config"].split()
    assert lines[2] == kernel_report.REPORT_LEGEND and "smem" not in lines[0]


def test_describe_config_is_the_config_values_description():
    from cake_cute.runtime.build import config_for

    for spec in (
        KernelSpec("fwd", "sm_90a", "bf16", "bf16", 4096),
        KernelSpec("bwd", "sm_100a", "fp32", "fp32", 65536, True),
        ReduceSpec("sm_90a", "fp32", 4096),
    ):
        assert kernel_report.describe_config(spec) == config_for(spec).describe()
    backward = KernelSpec("bwd", "sm_90a", "bf16", "bf16", 4096)
    assert kernel_report.describe_config(backward).startswith("vec=8 ")


def test_concurrent_warmups_report_what_each_did(tmp_path):
    """Three processes on one empty cache: the file lock lets one compile each variant; the others
    load it after waiting and must say so rather than claim a compile."""
    args = [sys.executable, "-m", "cake_cute", *ONE_ARCH_PLAIN]
    procs = [
        subprocess.Popen(
            args + ["--cache-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=900) for p in procs]
    summary = re.compile(
        r"4 variants, compiled (\d), loaded (\d) \(compiled by another process meanwhile\), cached (\d)"
    )
    counts = []
    for (out, err), proc in zip(outputs, procs):
        assert proc.returncode == 0, err
        counts.append(tuple(map(int, summary.search(out).groups())))
    assert all(sum(c) == 4 for c in counts), counts
    assert sum(c[0] for c in counts) == 4, counts  # each variant compiled exactly once, somewhere


def test_failed_compile_exits_1_and_names_the_kernel(tmp_path, monkeypatch, capsys):
    def broken(spec):
        raise RuntimeError(f"cannot compile {spec.hidden}")

    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warmup, "get_kernel_and_source", broken)
    code = cli.main([*ONE_ARCH_PLAIN, "--hidden", "4096", "--cache-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert "compiled 0, loaded 0 (compiled by another process meanwhile), cached 0, failed 4" in out
    assert (
        "FAILED cake_fwd_sm_90a_bf16_wbf16_h4096_off0" in err and "RuntimeError: cannot compile 4096" in err
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(stack_bytes=16), "1 kernel(s) spill registers: cake_bwd_sm_90a_bf16_wbf16_h4096_off0"),
        (dict(local_loads=1), "1 kernel(s) spill registers: cake_bwd_sm_90a_bf16_wbf16_h4096_off0"),
        (
            dict(global_atomics=2, data_atomics=2),
            "1 kernel(s) have atomics on data: cake_bwd_sm_90a_bf16_wbf16_h4096_off0",
        ),
        (
            dict(programs_fit=False),
            "1 persistent kernel(s) hold too many registers for their programs per SM: "
            "cake_bwd_sm_90a_bf16_wbf16_h4096_off0",
        ),
    ],
    ids=["stack", "local-loads", "atomics", "crowded"],
)
def test_report_exits_1_when_a_kernel_spills_or_has_atomics(tmp_path, monkeypatch, capsys, bad, message):
    def fake_reports(specs, jobs=None):
        return [dict(CLEAN_REPORT, name=s.name(), **(bad if s.kind == "bwd" else {})) for s in specs]

    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (None, "compiled"))
    monkeypatch.setattr(kernel_report, "collect_reports", fake_reports)
    code = cli.main([*ONE_ARCH_PLAIN, "--report", "--cache-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.splitlines()[-1] == message
    assert "compiled 4, loaded 0 (compiled by another process meanwhile), cached 0, failed 0" in out


def test_report_passes_a_grid_barriers_counter_atomics(tmp_path, monkeypatch, capsys):
    """A backward that sums dW in its own launch has two integer atomics on its grid barrier's counter
    and none on data: the report passes it."""

    def fake_reports(specs, jobs=None):
        return [dict(CLEAN_REPORT, name=s.name(), global_atomics=2 if s.kind == "bwd" else 0) for s in specs]

    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (None, "compiled"))
    monkeypatch.setattr(kernel_report, "collect_reports", fake_reports)
    assert cli.main([*ONE_ARCH_PLAIN, "--report", "--cache-dir", str(tmp_path)]) == 0
    assert "atomics" not in capsys.readouterr().err


def test_a_variant_another_process_compiled_counts_as_loaded(tmp_path, monkeypatch, capsys):
    # Another process compiled each variant while this one waited on the cache's file lock.
    monkeypatch.setattr(warmup, "get_kernel_and_source", lambda spec: (None, "disk after waiting"))
    code = cli.main([*ONE_ARCH_PLAIN, "--cache-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0
    assert "compiled 0, loaded 4 (compiled by another process meanwhile), cached 0, failed 0" in out
    assert err.count("] loaded   cake_") == 4


def test_arch_aliases_and_defaults():
    assert warmup.normalize_arch("sm_90") == "sm_90a"
    assert warmup.normalize_arch("sm_100a") == "sm_100a"
    assert warmup.normalize_arch("sm_103") == "sm_103a"
    if not torch.cuda.is_available():
        assert warmup.local_archs() == ("sm_90a", "sm_100a", "sm_103a") == SUPPORTED_ARCHS
