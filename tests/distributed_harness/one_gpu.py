"""The distributed matrix (``matrix.py``'s cases) with two ranks on one GPU: the CUDA kernels under every
two-rank plan without a second GPU.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m tests.distributed_harness.one_gpu --device cuda --out DIR
    python -m tests.distributed_harness.one_gpu --device cuda --backend gloo --out DIR
    python -m tests.distributed_harness.one_gpu --device cpu --small --only 1-op,2-,3-tp-sp --out /tmp/dist

NCCL refuses two ranks on one device. ``--backend threaded`` (the default) runs the two ranks as threads
of this process on torch's threaded process group (the one PyTorch's own DTensor tests use: a collective
copies tensors between the threads), which carries every case. ``--backend gloo`` runs each case in two
processes of its own: gloo moves CUDA tensors for all-reduce, broadcast and the list all-gather, which is
all that SequenceParallel + AdamW and DDP need; DTensor's all-gather for TP, FSDP2 and compiled plans
reaches gloo's ``allgather_coalesced``, which crashes on CUDA tensors, so only those two cases run there.

Writes ``<out>/<date>-<device>-distributed-one-gpu[-gloo][-<tag>].json`` (rows ``{case, ok, detail}``,
with the world size, backend, device, versions and commit) and a ``.log`` beside it, and prints a table
last. ``--budget`` starts no case after that many seconds (those rows fail, saying so); the compiled
cases run last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed_harness import launch, matrix

REPO = Path(__file__).resolve().parents[2]

WORLD = 2
# What gloo carries with CUDA tensors (see the module docstring).
GLOO_CASES = ("2-sp-adamw", "6-ddp")


def _setup(args, threads: bool) -> matrix.Setup:
    cfg, batch, seq = matrix.model_config(args.small)
    return matrix.Setup(args.device, cfg, batch, seq, args.steps, args.compile_backend, threads=threads)


def _enter_device(device: str) -> None:
    """Every rank on GPU 0 (the current device is per thread), FP32 matmuls without TF32."""
    if device == "cuda":
        torch.cuda.set_device(0)
        launch.exact_fp32_matmuls()


# --- threads ------------------------------------------------------------------------------------------


def _install_threaded_group(device: str):
    """torch's threaded process group, with one group registry per thread (without the isolation the
    second thread's ``init_process_group`` finds the first's group under the same name); on CUDA its
    collectives synchronize the device on the way in and out."""
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    threaded._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    if device == "cuda":
        threaded.Collective.join = _device_synchronous(threaded.Collective.join)
    return threaded.ProcessLocalGroup


def _device_synchronous(join):
    """A threaded collective is a set of copies that one thread issues on its own current stream for
    every rank's tensors; that stream is not ordered after the streams the other thread wrote its inputs
    on, nor before those it reads the outputs on (FSDP2 keeps streams of its own). Each rank synchronizes
    the device before it joins (its inputs are written) and after (the copies are done)."""

    @functools.wraps(join)
    def synchronized(self, rank, data):
        torch.cuda.synchronize()
        result = join(self, rank, data)
        torch.cuda.synchronize()
        return result

    return synchronized


def _threaded_case(args, group, fn) -> tuple[bool, str]:
    """One case on two threads, a fresh store and group; a rank that fails wakes the other out of its
    collectives (it then stops), and the case fails with the first error."""
    store = dist.HashStore()
    results: list[tuple[bool, str] | None] = [None] * WORLD

    def stop_the_other_rank_on_failure(s):
        try:
            return fn(s)
        except BaseException as err:
            group.exception_handle(err)
            raise

    def rank_main(rank: int) -> None:
        _enter_device(args.device)
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        try:
            results[rank] = matrix.run_case(_setup(args, threads=True), stop_the_other_rank_on_failure)
        except BaseException:  # SystemExit: stopped in a collective because the other rank failed
            results[rank] = (False, "stopped: the other rank failed")
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.timeout)
    if any(t.is_alive() for t in threads):
        group.exception_handle(TimeoutError())
        for t in threads:
            t.join(timeout=30)
        results = [(False, f"timed out after {args.timeout} s")] * WORLD
    group.reset()
    return _agreed(results)


def _agreed(results) -> tuple[bool, str]:
    """Ok when every rank is; the first failing rank's detail otherwise (rank 0's when all pass)."""
    failed = [r for r in results if r is None or not r[0]]
    if not failed:
        return True, results[0][1]
    return False, next((r[1] for r in failed if r and not r[1].startswith("stopped")), "no result")


# --- gloo processes ------------------------------------------------------------------------------------


def _gloo_case(args, name: str) -> tuple[bool, str]:
    """One case on two processes of this script (``--worker``) with gloo; a process that dies (gloo
    crashes on some CUDA collectives) or outlives the timeout fails the case with its exit code and the
    end of its output."""
    with tempfile.TemporaryDirectory(prefix="cake-cute-gloo-") as tmp:
        base = [sys.executable, "-m", __spec__.name, f"--device={args.device}", f"--steps={args.steps}"]
        base += [f"--compile-backend={args.compile_backend}", f"--timeout={args.timeout}", "--backend=gloo"]
        base += ["--small"] if args.small else []
        logs = [Path(tmp, f"rank{rank}.log") for rank in range(WORLD)]
        procs = []
        for rank, log in enumerate(logs):
            with log.open("w") as out:  # a file, not a pipe: a full pipe would stall a rank mid-case
                cmd = base + [f"--worker={rank},{tmp},{name}"]
                procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout + 60
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        results = []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            result = Path(tmp, f"rank{rank}.json")
            if result.exists():
                results.append(tuple(json.loads(result.read_text())))
            else:
                tail = log.read_text(errors="replace")[-600:]
                results.append((False, f"rank {rank} exited {proc.returncode}: {tail}"))
    return _agreed(results)


def _gloo_worker(args) -> int:
    rank_text, tmp, name = args.worker.split(",", 2)
    rank = int(rank_text)
    _enter_device(args.device)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    ok, detail = matrix.run_case(_setup(args, threads=False), matrix.cases(WORLD)[name])
    Path(tmp, f"rank{rank}.json").write_text(json.dumps([ok, detail]))
    dist.destroy_process_group()
    return 0


# --- the runner -----------------------------------------------------------------------------------------


def _parser():
    parser = launch.parser(__doc__)
    matrix.add_case_arguments(parser)
    parser.add_argument("--backend", choices=("threaded", "gloo"), default="threaded")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "rank,folder,case": one gloo rank
    parser.add_argument(
        "--budget", type=float, default=0, help="seconds after which no further case starts (0: none)"
    )
    parser.set_defaults(timeout=600)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return _gloo_worker(args)
    chosen = matrix.selected(WORLD, args.only)
    if args.backend == "gloo":
        chosen = {name: fn for name, fn in chosen.items() if name in GLOO_CASES}
    else:
        group = _install_threaded_group(args.device)
    # The compiled cases (the slowest) last, so that a budget leaves out the fewest cases.
    order = sorted(chosen, key=lambda name: name.startswith("7-compile"))
    rows, lines = [], []
    began = time.perf_counter()
    for name in order:
        start = time.perf_counter()
        if args.budget and start - began > args.budget:
            ok, detail = False, f"not run: the {args.budget:.0f} s budget was spent"
        elif args.backend == "gloo":
            ok, detail = _gloo_case(args, name)
        else:
            ok, detail = _threaded_case(args, group, chosen[name])
        seconds = time.perf_counter() - start
        rows.append({"case": name, "ok": ok, "detail": detail, "seconds": round(seconds, 1)})
        lines.append(matrix.report_line(name, ok, seconds, detail))
        print(lines[-1], flush=True)
    table = _table(rows, args)
    _write(args, rows, lines + [""] + table)
    print("\n".join(table), flush=True)
    return 0 if rows and all(r["ok"] for r in rows) else 1


def _table(rows, args) -> list[str]:
    passed = sum(r["ok"] for r in rows)
    head = f"{args.device}, {WORLD} ranks on one device, {args.backend}: {passed}/{len(rows)} ok"
    return [head, "-" * len(head)] + [
        f"{r['case']:34s} {'ok  ' if r['ok'] else 'FAIL'} {r['seconds']:6.1f}s" for r in rows
    ]


def _write(args, rows, lines) -> None:
    cfg, batch, seq = matrix.model_config(args.small)
    config = {**cfg.__dict__, "global_batch": batch, "seq": seq, "steps": args.steps}
    suffix = (
        "distributed-one-gpu"
        + ("-gloo" if args.backend == "gloo" else "")
        + (f"-{args.tag}" if args.tag else "")
    )
    path = launch.output_path(args, suffix)
    doc = {**launch.header(args.device, WORLD, config), "backend": args.backend, "rows": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".log").write_text("\n".join(lines) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
