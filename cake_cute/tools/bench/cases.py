"""What a sweep measures: the shape grids, and the bytes an ideal kernel moves for each shape.

Dtype names and sizes come from ``cake_cute.vocab``; the row vocabulary (ops, implementations) from
``results``, which, like ``plot``, needs only the standard library.
"""

from __future__ import annotations

import argparse
import re

from ...vocab import DTYPE_NAMES, dtype_bytes
from .results import PEERS

STANDARD_HIDDEN = (1024, 2048, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072)
# Bytes per activation tensor of the standard grid: T * H = 2^27 in bf16 and fp16, 2^26 in fp32.
STANDARD_TENSOR_BYTES = 1 << 28
SMALL_TOKENS = (1, 16, 256)
SMALL_HIDDEN = (4096,)
# Micro-batches of real training: tokens per GPU x model width.
TRAINING_TOKENS = (2048, 4096, 8192, 16384)
TRAINING_HIDDEN = (1024, 2048, 4096, 5120, 8192, 16384)
# Per-head q/k norms (H = head_dim over T * heads rows): three row counts keep the sweep short, with
# torch.compile compiling each shape.
HEADDIM_TOKENS = (1 << 12, 1 << 16, 1 << 20)
HEADDIM_HIDDEN = (32, 64, 80, 96, 128, 192, 256)
GRIDS = ("standard", "training", "small", "headdim")
# The implementations a grid times unless --vs says otherwise: the training grid compares with quack
# only (plus the copy ceiling every row carries); the headdim grid with the fused peers (eager torch's
# unfused norm says nothing about these shapes); the others with every peer.
GRID_PEERS = {
    "standard": PEERS,
    "training": ("quack",),
    "small": PEERS,
    "headdim": ("compile", "liger", "quack"),
}
# A call that moves at least this many bytes is held to a fraction of the device copy: 0.95 for the
# forward, 0.90 for the backward (smaller calls are launch- and tail-bound).
CEILING_TARGET_BYTES = 32 << 20
CEILING_TARGETS = {"fwd": 0.95, "bwd": 0.90}
RESIDUAL_MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def model_bytes(
    op: str, residual: bool, tokens: int, hidden: int, dtype: str = "bf16", w_dtype: str | None = None
) -> int:
    """Bytes an ideal kernel moves for one call (w, rstd and dw not counted); ValueError for an unknown
    op or dtype."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    act = tokens * hidden * dtype_bytes(dtype)
    if op == "fwd":
        w_bytes = hidden * dtype_bytes(w_dtype or dtype)
        return (4 if residual else 2) * act + w_bytes + 4 * tokens
    if op == "bwd":
        return (4 if residual else 3) * act
    raise ValueError(f"op must be 'fwd' or 'bwd', got {op!r}")


def ceiling_target(op: str, nbytes: int) -> float | None:
    """The copy fraction a call of ``op`` moving ``nbytes`` is held to, None for small calls."""
    if op not in CEILING_TARGETS:
        raise ValueError(f"op must be 'fwd' or 'bwd', got {op!r}")
    return CEILING_TARGETS[op] if nbytes >= CEILING_TARGET_BYTES else None


def parse_count(text: str) -> int:
    """'134217728', '2^27', '2**27', '1<<27' or '128M' -> int > 0, else ``ArgumentTypeError``."""
    t = str(text).strip().lower().replace("_", "").replace(" ", "")
    value = None
    if m := re.fullmatch(r"(\d+)(?:\^|\*\*)(\d+)", t):
        value = int(m.group(1)) ** int(m.group(2))
    elif m := re.fullmatch(r"(\d+)<<(\d+)", t):
        value = int(m.group(1)) << int(m.group(2))
    elif m := re.fullmatch(r"(\d+)([kmg]?)", t):
        value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive count like 134217728, 2^27 or 128M, got {text!r}"
        )
    return value


def parse_count_list(text: str) -> list[int]:
    """An argparse type: a comma-separated list of positive counts in ``parse_count``'s forms."""
    try:
        values = [parse_count(p) for p in str(text).split(",") if p.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers (e.g. 4096,8192), got {text!r}"
        )
    return values


def grid_shapes(
    grid: str,
    dtype: str,
    hidden: list[int] | None = None,
    tokens: list[int] | None = None,
    elements: int | None = None,
) -> list[tuple[int, int]]:
    """(T, H) pairs of a grid, H outer, T inner, each T at least 1.

    Grids: standard (T = elements // H for every H, by default ``STANDARD_TENSOR_BYTES`` per tensor of
    ``dtype``), training, small and headdim (their module constants). ``hidden`` and ``tokens`` replace the
    grid's values. ValueError for an unknown grid, or ``elements`` for a grid that does not use it."""
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {', '.join(GRIDS)}, got {grid!r}")
    if elements is not None and (grid != "standard" or tokens):
        raise ValueError(
            "--elements sets T = elements // H of the standard grid; it does not combine with "
            f"--grid {grid}" + (" or --tokens" if tokens else "")
        )
    if grid == "standard" and not tokens:
        per_shape = elements or STANDARD_TENSOR_BYTES // dtype_bytes(dtype)
        return [(per_shape // h, h) for h in hidden or STANDARD_HIDDEN if per_shape // h >= 1]
    default_tokens, default_hidden = {
        "standard": ((), STANDARD_HIDDEN),
        "training": (TRAINING_TOKENS, TRAINING_HIDDEN),
        "small": (SMALL_TOKENS, SMALL_HIDDEN),
        "headdim": (HEADDIM_TOKENS, HEADDIM_HIDDEN),
    }[grid]
    return [(t, h) for h in hidden or default_hidden for t in tokens or default_tokens]


def grid_peers(grid: str) -> list[str]:
    """The peers a grid compares with when ``--vs`` is not given."""
    return list(GRID_PEERS[grid])
