"""Run torchtitan's trainer (``torchtitan.train`` through the CPU launcher) on the llama3 or Qwen3.5 debug
model and compare loss curves, stock norms against cake_cute enabled by its one config line.

Each case is a process count, torchtitan CLI arguments, the variants and the config. ``compare_case``
trains stock twice (is torch reproducible here?) and each variant once, and reports the curves and
their differences.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
CAKE_CUTE_LINE = ("--override.imports", "cake_cute.integrations.torchtitan.cake_rmsnorm")
FUSED_RESIDUAL_LINE = (
    "--override.imports",
    "cake_cute.integrations.torchtitan.cake_llama3_fused_residual,"
    "cake_cute.integrations.torchtitan.cake_final_rmsnorm",
)
# The keyword form of a target (one argument, no shell quoting needed here).
MEMORY_EFFICIENT_LINE = (
    "--override.imports",
    'cake_cute.integrations.torchtitan.cake_rmsnorm={"memory_efficient": true}',
)
# Qwen3.5's norms are classes of its own (an offset norm and the gated norm): two targets, one line.
QWEN35_LINE = (
    "--override.imports",
    "cake_cute.integrations.torchtitan_qwen35.cake_offset_rmsnorm,"
    "cake_cute.integrations.torchtitan_qwen35.cake_rmsnorm_gated",
)
VARIANTS = {
    "cake_cute": CAKE_CUTE_LINE,
    "cake_cute_fused_residual": FUSED_RESIDUAL_LINE,
    "cake_cute_memory_efficient": MEMORY_EFFICIENT_LINE,
    "cake_cute_qwen35": QWEN35_LINE,
}
# torch 2.13's fully_shard takes DTensor parameters, which torchtitan's default spmd_types backend does
# not make (its multi-process runs stop in fully_shard, stock norm included): the two-process cases use
# partial_dtensor, where the norm receives DTensors. With tensor parallelism and compile, activation
# checkpointing (selective or full) fails on torch 2.13 with the stock norm too (a DeviceMesh among the
# compiled block's saved tensors): that case runs without it. Under compile the stock norm is inductor's
# code, not aten's kernel: such a case also trains the stock norm eagerly ("stock_eager"), which measures
# what a change of the norm's rounding does to the curve in torch itself.
_DTENSOR = ("--parallelism.spmd_backend", "partial_dtensor")


class Case(NamedTuple):
    """Processes, torchtitan arguments, the variants compared with the stock norm, and the trainer
    config (a function of ``config_registry``)."""

    processes: int
    args: tuple[str, ...]
    variants: tuple[str, ...]
    config: str = "llama3_debugmodel_cpu"


CASES = {
    "1proc": Case(1, (), ("cake_cute", "cake_cute_fused_residual", "cake_cute_memory_efficient")),
    "fsdp2": Case(2, (*_DTENSOR, "--parallelism.data_parallel_shard_degree", "2"), ("cake_cute",)),
    "tp2_sp_compile": Case(
        2,
        (
            *_DTENSOR,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            "--compile.enable",
            "activation-checkpoint:none",
        ),
        ("cake_cute", "cake_cute_fused_residual"),
    ),
    "qwen35_1proc": Case(1, (), ("cake_cute_qwen35",), "qwen35_debugmodel_cpu"),
    "qwen35_fsdp2": Case(
        2,
        (*_DTENSOR, "--parallelism.data_parallel_shard_degree", "2"),
        ("cake_cute_qwen35",),
        "qwen35_debugmodel_cpu",
    ),
    "qwen35_tp2": Case(
        2,
        (*_DTENSOR, "--parallelism.tensor_parallel_degree", "2"),
        ("cake_cute_qwen35",),
        "qwen35_debugmodel_cpu",
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(nproc: int, args: tuple[str, ...], workdir: Path, config: str) -> tuple[list[float], float]:
    """Train the debug model of ``config`` once; returns (the loss of each step, wall seconds).

    Raises
    ------
    RuntimeError
        The run failed; the message holds the end of its log.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    losses = workdir / "loss.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={_free_port()}",
        "-m",
        "tests.torchtitan_harness.launch",
        "--module",
        "tests.torchtitan_harness",
        "--config",
        config,
        "--dump-folder",
        str(workdir / "out"),
        *args,
    ]
    env = {**os.environ, "CAKE_TT_LOSS_FILE": str(losses), "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (workdir / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not losses.exists():
        raise RuntimeError(
            f"torchtitan run failed ({' '.join(args)}, exit {done.returncode}):\n"
            f"stdout ends:\n{done.stdout[-2000:]}\nstderr ends:\n{done.stderr[-3000:]}"
        )
    return json.loads(losses.read_text())["loss"], seconds


def _ulps(a: float, b: float) -> int:
    """How many FP32 values lie between a and b (0: bitwise equal)."""
    import struct

    def ordered(x: float) -> int:
        bits = struct.unpack("<i", struct.pack("<f", x))[0]
        return bits if bits >= 0 else -(bits & 0x7FFFFFFF)

    return abs(ordered(a) - ordered(b))


def _max_rel_diff(reference: list[float], other: list[float]) -> float:
    return max(abs(r - o) / abs(r) for r, o in zip(reference, other))


def compare_case(name: str, workdir: Path | None = None) -> dict:
    """Stock twice (and once without compile where the case compiles), then each variant of the case
    ``name`` of ``CASES``.

    Returns
    -------
    dict
        ``processes``, ``args``, the ``stock`` and ``stock_again`` loss curves, ``stock_reproducible`` (the
        two bitwise equal), ``torch_spread`` (the largest relative difference torch shows on its own:
        between the two stock runs, and between compiled and eager stock runs), and per variant its
        ``args``, ``loss`` curve, ``ulps`` (per step, the FP32 values between its loss and the stock
        one), ``max_rel_diff``, where the case compiles ``max_rel_diff_eager`` (against the eager stock
        run), and ``seconds``.
    """
    nproc, args, variants, config = CASES[name]
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"torchtitan-{name}-"))
    stock, stock_s = train(nproc, args, workdir / "stock", config)
    again, again_s = train(nproc, args, workdir / "stock_again", config)
    result = {
        "processes": nproc,
        "args": list(args),
        "stock": stock,
        "stock_again": again,
        "stock_reproducible": stock == again,
        "seconds": {"stock": stock_s, "stock_again": again_s},
        "torch_spread": _max_rel_diff(stock, again),
        "variants": {},
    }
    if "--compile.enable" in args:
        eager_args = tuple(a for a in args if a != "--compile.enable")
        eager, eager_s = train(nproc, eager_args, workdir / "stock_eager", config)
        result["stock_eager"], result["seconds"]["stock_eager"] = eager, eager_s
        result["torch_spread"] = max(result["torch_spread"], _max_rel_diff(stock, eager))
    for variant in variants:
        line = VARIANTS[variant]
        # The line goes first: tyro applies options after a subcommand (activation-checkpoint:none) to it.
        loss, seconds = train(nproc, (*line, *args), workdir / variant, config)
        found = result["variants"][variant] = {
            "args": list(line),
            "loss": loss,
            "ulps": [_ulps(s, c) for s, c in zip(stock, loss)],
            "max_rel_diff": _max_rel_diff(stock, loss),
            "seconds": seconds,
        }
        if "stock_eager" in result:
            found["max_rel_diff_eager"] = _max_rel_diff(result["stock_eager"], loss)
    return result
