"""Training-step throughput and peak memory of the small Llama-style model on two devices: FSDP2 and
TP + SP, ``swap_rmsnorm`` (cake_cute) vs ``torch.nn.RMSNorm``, eager and compiled per block.

    torchrun --nproc_per_node=2 benchmarks/distributed_train.py --out evidence
    torchrun --nproc_per_node=2 benchmarks/distributed_train.py --device cpu --small --steps 2 --out /tmp/b

Rank 0 writes ``<out>/<date>-<device>-distributed-train.json``: one row per (plan, norm, compile) with
tokens/s (the global batch's tokens per second of wall time, median over the timed steps) and the peak
memory allocated on rank 0. Parameters are bf16 on CUDA (FP32 on CPU); AdamW steps are timed too.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the model is the distributed harness's

from cake_cute import swap_rmsnorm  # noqa: E402
from tests.distributed_harness import launch  # noqa: E402
from tests.distributed_harness import model as llama  # noqa: E402

PLANS = {"fsdp2": llama.Plan(fsdp=True), "tp-sp": llama.Plan(tp=True)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _measure(args, cfg, plan: llama.Plan, cake: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch._dynamo.reset()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = llama.build(cfg, seed=0, device=args.device, dtype=dtype)
    if cake:
        swap_rmsnorm(model)
    model = llama.parallelize(model, args.device, world, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_degree, dp_rank = llama.data_parallel_coords(world, rank, plan)
    local = args.batch // dp_degree
    tokens, targets = llama.batch(cfg, 0, args.batch, args.seq, args.device)
    tokens, targets = (t[dp_rank * local : (dp_rank + 1) * local] for t in (tokens, targets))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        _sync(args.device)
        start = time.perf_counter()
        llama.loss_fn(model(tokens), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(args.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {
        "plan": next(name for name, p in PLANS.items() if p == replace(plan, compile=False)),
        "norm": "cake_cute" if cake else "torch.nn.RMSNorm",
        "compiled": plan.compile,
        "tokens_per_s": args.batch * args.seq / seconds,
        "step_ms": seconds * 1e3,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
    }


def main(argv=None) -> int:
    parser = launch.parser(__doc__)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    launch.init(args)
    if args.small:
        cfg, args.seq = llama.Config(), 16
    else:
        cfg = llama.Config(vocab=32768, hidden=2048, layers=4, heads=16, ffn=5632)
    rows = []
    for plan in PLANS.values():
        for compiled in (False, True):
            for cake in (False, True):
                row = _measure(args, cfg, replace(plan, compile=compiled), cake)
                rows.append(row)
                if dist.get_rank() == 0:
                    print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        config = {**cfg.__dict__, "global_batch": args.batch, "seq": args.seq, "steps": args.steps}
        launch.write_json(args, "distributed-train", config, rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
