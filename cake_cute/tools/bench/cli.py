"""``cake-cute bench`` / ``python benchmarks/sweep.py``: the arguments of a sweep and its entry point."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ...vocab import DTYPE_NAMES
from .. import EXIT_USAGE
from .cases import GRIDS, RESIDUAL_MODES, grid_peers, grid_shapes, parse_count, parse_count_list
from .results import OPS, PEERS


def _choice_list(choices, *, allow_none=False, allow_all=False):
    def parse(text: str) -> list[str]:
        items = [p.strip().lower() for p in str(text).split(",") if p.strip()]
        if allow_none and items == ["none"]:
            return []
        if allow_all and items == ["all"]:
            return list(choices)
        if not items or any(i not in choices for i in items):
            extra = (", 'none'" if allow_none else "") + (", 'all'" if allow_all else "")
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(choices)}{extra}; got {text!r}"
            )
        return list(dict.fromkeys(items))  # keep order, drop repeats

    return parse


def build_parser(prog: str = "cake-cute bench") -> argparse.ArgumentParser:
    """The sweep's argument parser (checks that span arguments are in ``parse_args``)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="RMSNorm training performance sweep: cake_cute vs torch eager, torch.compile, Liger and "
        "quack, with a device-copy ceiling of the same bytes. See benchmarks/README.md for the method and "
        "fields.",
    )
    p.add_argument(
        "--grid",
        choices=GRIDS,
        default="standard",
        help="standard: T*H = 2^27 (fp32: 2^26) at H = 1K..128K, every peer; training: T in 2K..16K x "
        "H in 1K..16K, quack only; small: T in 1,16,256 at H = 4096 (L2-resident by nature); headdim: "
        "T in 2^12,2^16,2^20 x H in 32..256 (per-head q/k norms), compile, liger and quack",
    )
    p.add_argument("--hidden", type=parse_count_list, help="hidden sizes replacing the grid's")
    p.add_argument("--tokens", type=parse_count_list, help="rows T replacing the grid's (for every H)")
    p.add_argument(
        "--elements", type=parse_count, help="T*H per shape of the standard grid (2^27, 1<<27, 128M)"
    )
    p.add_argument(
        "--dtype",
        type=_choice_list(DTYPE_NAMES),
        default=["bf16"],
        help="activation dtypes out of bf16,fp16,fp32 (default bf16); w has the same dtype",
    )
    p.add_argument(
        "--residual", choices=tuple(RESIDUAL_MODES), default="both", help="off, on or both (default)"
    )
    p.add_argument(
        "--vs",
        type=_choice_list(PEERS, allow_none=True, allow_all=True),
        help="peers: a subset of torch,compile,liger,quack, 'all' or 'none' (default: the grid's); a peer "
        "that fails to import is skipped with a note",
    )
    p.add_argument("--no-cake", action="store_true", help="do not time cake_cute (peers only)")
    p.add_argument("--ops", type=_choice_list(OPS), default=list(OPS), help="fwd,bwd (default both)")
    p.add_argument(
        "--json", type=Path, help="output JSON (default: evidence folder, <date>-<gpu>[-<grid>].json)"
    )
    p.add_argument(
        "--append", action="store_true", help="merge into an existing --json file (same keys replaced)"
    )
    p.add_argument("--plot", type=Path, help="output PNG (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--reps", type=int, default=30, help="timed calls per row for us (default 30)")
    p.add_argument("--prof-reps", type=int, default=10, help="timed calls per row for gpu_us (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before measuring (default 3, min 1)")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sweep's arguments, checked (a usage error exits with status 2); ``vs`` filled in from the grid."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("reps", "prof_reps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.eps > 0:
        parser.error("--eps must be > 0")
    for dtype in args.dtype:
        try:
            shapes = grid_shapes(args.grid, dtype, args.hidden, args.tokens, args.elements)
        except ValueError as e:
            parser.error(str(e))
        if not shapes:
            parser.error(f"no shape of --grid {args.grid} has T >= 1 with these --hidden / --elements")
    if args.vs is None:
        args.vs = grid_peers(args.grid)
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cake-cute bench`` and ``benchmarks/sweep.py``; returns the exit status."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"cake-cute bench: needs PyTorch with CUDA ({e})", file=sys.stderr)
        return EXIT_USAGE
    if not torch.cuda.is_available():
        print(
            "cake-cute bench: no CUDA GPU is available (torch.cuda.is_available() is False). The sweep "
            "times kernels on an NVIDIA GPU (Hopper or Blackwell for cake_cute); run it on a GPU machine. "
            "To plot an existing results file without a GPU use: python benchmarks/plot.py <results.json>",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from .runner import run

    return run(args, torch, t_start)
