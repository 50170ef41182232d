"""No compilation on the hot path: the kernel key never includes the row count T, and a warmed
on-disk cache serves a fresh process without a single compile."""

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cake_cute import dispatch, launch
from cake_cute.runtime import cache as compile_cache
from cake_cute.runtime import device, native
from cake_cute.runtime.specs import KernelSpec, ReduceSpec
from cake_cute.vocab import dtype_name

ROWS = (1, 2, 129, 4096)


def test_kernel_specs_have_no_row_count():
    """A spec and its config are the whole compile key (object_path hashes them with the code
    fingerprint)."""
    fields = {f.name for f in dataclasses.fields(KernelSpec)}
    assert fields == {
        "kind",
        "arch",
        "act_dtype",
        "w_dtype",
        "hidden",
        "residual",
        "weight_offset",
        "g_parts",
        "memory_efficient",
        "dw_dtype",
    }
    assert {f.name for f in dataclasses.fields(ReduceSpec)} == {"arch", "out_dtype", "hidden"}


def _isolate_memory_caches(monkeypatch):
    """Empty in-memory kernel caches for this test only (the originals come back afterwards), and the
    calls on the Python path: the native path holds the kernels registered before this test."""
    monkeypatch.setattr(compile_cache, "_memory", {})
    monkeypatch.setattr(native, "extension", None)
    monkeypatch.setattr(native, "load_built", lambda: None)  # nor is a signature handed to it


@pytest.fixture
def recorded_specs(monkeypatch):
    """Run the real ops code on CPU tensors up to the launch, recording the specs it asks for."""
    specs = []

    def fake_get_kernel(spec):
        specs.append(spec)
        return lambda *args: None

    _isolate_memory_caches(monkeypatch)
    monkeypatch.setattr(launch, "get_kernel", fake_get_kernel)
    facts = device.DeviceFacts(0, "fake B200", (10, 0), "sm_100a", 148)
    monkeypatch.setattr(device, "device_arch", lambda device: facts.arch)
    monkeypatch.setattr(device, "device_facts", lambda device: facts)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return specs


@pytest.mark.filterwarnings("ignore:.*occupancy query failed:UserWarning")  # no driver on a CPU machine
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ops_build_the_same_specs_for_every_row_count(recorded_specs, dtype):
    hidden = 4096
    per_rows = {}
    for rows in ROWS + (0,):
        shape = (rows, hidden) if rows % 2 else (2, rows // 2, hidden)  # N-D inputs collapse to rows too
        x, g, res, g_res = (torch.randn(shape).to(dtype) for _ in range(4))
        w = torch.randn(hidden).to(dtype)
        rstd = torch.ones(x.numel() // hidden)
        start = len(recorded_specs)
        dispatch.cake_rmsnorm_train_forward(x, w, 1e-6, residual=res)
        dispatch.cake_rmsnorm_train_backward(g, x, w, rstd, g_residual=g_res)
        per_rows[rows] = recorded_specs[start:]
    assert per_rows[0] == []  # an empty batch launches nothing
    expected = [
        KernelSpec("fwd", "sm_100a", dtype_name(dtype), dtype_name(dtype), hidden, True),
        KernelSpec("bwd", "sm_100a", dtype_name(dtype), dtype_name(dtype), hidden, True),
        ReduceSpec("sm_100a", "fp32", hidden),
    ]
    for rows in ROWS:
        assert per_rows[rows] == expected, rows


def _device_arch() -> str:
    return device.device_arch(torch.device("cuda"))


@pytest.mark.gpu
def test_row_counts_compile_each_variant_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    _isolate_memory_caches(monkeypatch)
    before = compile_cache.compile_count
    hidden = 4096
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    for rows in ROWS:
        x, res, g, g_res = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        _, rstd, h = dispatch.cake_rmsnorm_train_forward(x, w, 1e-6, residual=res)
        dispatch.cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=g_res)
    torch.cuda.synchronize()
    assert compile_cache.compile_count - before == 3  # forward, backward, dW reduction


WARM_PROCESS = textwrap.dedent("""
    import torch
    import cake_cute
    from cake_cute.runtime import cache as compile_cache

    H = 4096
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 129):
        x, res, g, g_res = (torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        y, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
        cake_cute.cake_rmsnorm_train_backward(g, x, w, rstd)
        y, rstd, h = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6, residual=res)
        cake_cute.cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=g_res)
        xa, wa, ra = x.clone().requires_grad_(), w.clone().requires_grad_(), res.clone().requires_grad_()
        cake_cute.cake_rmsnorm(xa, wa).backward(g)
        torch.autograd.backward(list(cake_cute.cake_rmsnorm(xa, wa, residual=ra)), [g, g_res])
    torch.cuda.synchronize()
    print("compile_count", compile_cache.compile_count)
""")


@pytest.mark.gpu
def test_warmed_cache_means_no_compilation(tmp_path):
    """`cake-cute warmup` in one process; the public API in a fresh one compiles nothing."""
    env = {**os.environ, "CAKE_CUTE_CACHE_DIR": str(tmp_path)}
    warm = subprocess.run(
        [
            sys.executable,
            "-m",
            "cake_cute",
            "warmup",
            "--arch",
            _device_arch(),
            "--dtype",
            "bf16",
            "--hidden",
            "4096",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert warm.returncode == 0, warm.stderr
    run = subprocess.run([sys.executable, "-c", WARM_PROCESS], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "compile_count 0" in run.stdout, run.stdout + run.stderr
