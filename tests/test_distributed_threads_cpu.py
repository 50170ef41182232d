"""Two ranks on one device (``tests/distributed_harness/one_gpu.py``) on CPU: a few of the matrix's cases as
two threads on torch's threaded process group, and a rank that fails ends the case on both threads instead of
leaving the other waiting in a collective. The runner installs the threaded group process-wide, so each run is
a process of its own. tests/test_gpu_distributed_threads.py runs it on a GPU, gloo processes too;
tests/test_distributed_cpu.py runs every case on two gloo processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = "tests.distributed_harness.one_gpu"
THREAD_CASES = (
    "1-op-level",
    "2-sp-adamw",
    "3-tp-sp-fused-residual",
    "4-fsdp-reshard",
    "5-fsdp-tp-2x1",
    "6-ddp",
    "9-determinism",
    "10-dcp-fsdp",
    "11-hf-fused-tp-sp",
)


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(out: Path, backend: str, run) -> dict:
    name = "distributed-one-gpu" + ("-gloo" if backend == "gloo" else "")
    files = list(out.glob(f"*-cpu-{name}.json"))
    assert files, f"no JSON (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    doc = json.loads(files[0].read_text())
    assert (doc["world_size"], doc["backend"], doc["device"]) == (2, backend, "cpu")
    assert run.stdout.rstrip().splitlines()[-1].startswith(doc["rows"][-1]["case"])  # the table is last
    return {row["case"]: row for row in doc["rows"]}


@pytest.fixture(scope="module")
def thread_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("threads")
    only = ",".join(THREAD_CASES)
    run = _run(["-m", RUNNER, "--device=cpu", "--small", "--timeout=120", f"--only={only}", f"--out={out}"])
    return _rows(out, "threaded", run)


@pytest.mark.parametrize("case", THREAD_CASES)
def test_threaded_case(thread_rows, case):
    assert thread_rows[case]["ok"], thread_rows[case]["detail"]


def test_a_failing_rank_fails_the_case_without_a_hang():
    """Rank 1 raises before a collective that rank 0 waits in: the case fails with rank 1's error, and
    the next case runs on fresh groups."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from tests.distributed_harness import one_gpu

        def fails_on_rank_1(s):
            if s.rank == 1:
                raise ValueError("rank 1 broke")
            dist.all_reduce(torch.ones(1))
            return "unreachable"

        def passes(s):
            t = torch.ones(1)
            dist.all_reduce(t)
            return f"sum {t.item():.0f}"

        args = one_gpu._parser().parse_args(["--device=cpu", "--small", "--timeout=60"])
        group = one_gpu._install_threaded_group("cpu")
        print(one_gpu._threaded_case(args, group, fails_on_rank_1))
        print(one_gpu._threaded_case(args, group, passes))
        """
    )
    run = _run(["-c", script], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-2:] == ["(False, 'ValueError: rank 1 broke')", "(True, 'sum 2')"]
