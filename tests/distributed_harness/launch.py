"""What the distributed scripts share around the model: common arguments, process-group start-up (NCCL
on CUDA, gloo on CPU), the device label of output names, and the JSON header."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import cake_cute
from cake_cute.tools.bench.results import git_commit


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, default=Path("evidence"))
    p.add_argument("--small", action="store_true", help="a tiny model (H = 64, seq 16) for CPU runs")
    p.add_argument("--timeout", type=int, default=300, help="seconds a collective may wait")
    return p


def init(args) -> None:
    """One process per device (torchrun's LOCAL_RANK); FP32 matmuls without TF32 on CUDA."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        exact_fp32_matmuls()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))


def exact_fp32_matmuls() -> None:
    """FP32 matmuls and convolutions without TF32, so that FP32 plans compare at FP32 precision."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def device_label(device: str) -> str:
    """ "cpu", or the GPU's name as the results files spell it (e.g. "nvidia-h200")."""
    if device == "cpu":
        return "cpu"
    return torch.cuda.get_device_name().lower().replace(" ", "-")


def header(device: str, world_size: int, config: dict) -> dict:
    """Versions, commit (``results.git_commit``: ``CAKE_CUTE_COMMIT``, else the checkout's HEAD), device,
    world size, config."""
    return {
        "torch": torch.__version__,
        "cake_cute": cake_cute.__version__,
        "commit": git_commit(),
        "device": device,
        "world_size": world_size,
        "config": config,
    }


def output_path(args, suffix: str) -> Path:
    """``<out>/<date>-<device>-<suffix>.json``, its folder made."""
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out / f"{datetime.date.today().isoformat()}-{device_label(args.device)}-{suffix}.json"


def write_json(args, suffix: str, config: dict, rows: list) -> Path:
    """``<out>/<date>-<device>-<suffix>.json`` with a header (versions, commit, world size, config)."""
    path = output_path(args, suffix)
    meta = header(args.device, dist.get_world_size(), config)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return path
