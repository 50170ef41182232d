"""The distributed matrix with two ranks on one GPU (``tests/distributed_harness/one_gpu.py``): CUDA kernels
under the two-rank plans, the ranks as threads on torch's threaded process group, and the cases gloo carries
with CUDA tensors (SequenceParallel + AdamW, DDP) on two gloo processes. A small model and no compiled plan
here; ``one_gpu.py --device cuda`` runs every case at the full size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cake_cute

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and cake_cute.is_cake_rmsnorm_train_supported("cuda")),
        reason="needs an NVIDIA Hopper or Blackwell GPU",
    ),
]

REPO = Path(__file__).resolve().parents[1]
RUNNER = "tests.distributed_harness.one_gpu"
THREAD_CASES = (
    "1-op-level",
    "1-fp8-op-level",
    "2-sp-adamw",
    "3-tp-sp",
    "3-tp-sp-fused-residual",
    "4-fsdp-reshard",
    "4-fsdp-no-reshard",
    "4-fsdp-bf16",
    "5-fsdp-tp-1x2",
    "5-fsdp-tp-2x1",
    "6-ddp",
    "8-checkpoint-tp-sp",
    "9-determinism",
    "10-dcp-tp-sp",
    "10-dcp-fsdp",
    "11-hf-fused-tp-sp",
)
GLOO_CASES = ("2-sp-adamw", "6-ddp")


def _rows(out: Path, backend: str, cases) -> dict:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    cmd = [sys.executable, "-m", RUNNER, "--device=cuda", "--small", f"--backend={backend}"]
    cmd += [f"--only={','.join(cases)}", f"--out={out}", "--timeout=300"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    files = list(out.glob(f"*-distributed-one-gpu{'-gloo' if backend == 'gloo' else ''}.json"))
    assert files, f"no JSON (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    doc = json.loads(files[0].read_text())
    assert (doc["world_size"], doc["backend"], doc["device"]) == (2, backend, "cuda")
    return {row["case"]: row for row in doc["rows"]}


@pytest.fixture(scope="module")
def thread_rows(tmp_path_factory):
    return _rows(tmp_path_factory.mktemp("threads"), "threaded", THREAD_CASES)


@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    return _rows(tmp_path_factory.mktemp("gloo"), "gloo", GLOO_CASES)


@pytest.mark.parametrize("case", THREAD_CASES)
def test_two_threads_on_one_gpu(thread_rows, case):
    assert thread_rows[case]["ok"], thread_rows[case]["detail"]


@pytest.mark.parametrize("case", GLOO_CASES)
def test_two_gloo_processes_on_one_gpu(gloo_rows, case):
    assert gloo_rows[case]["ok"], gloo_rows[case]["detail"]
