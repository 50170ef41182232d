"""Kernel configurations as values: one frozen config per kernel variant, built by per-arch rules, with
an override table for tuning.

``forward_config``, ``backward_config`` and ``reduce_config`` build the configs of ``rmsnorm_fwd``,
``rmsnorm_bwd`` and ``dw_reduce``; the FP8 forward's (``quant_config``) builds on the forward's rules
and shares the override table. A kernel class takes its whole config value, which is part of the
compile-cache key, so a changed config never loads an object compiled for another. No config depends
on T (batch invariance). Where a rule differs by architecture, the rule says so; docs/performance.md
names the measurement behind each rule.

``overridden(kind, arch, dtype, hidden, **choices)`` replaces some choices for one variant while the
context is open (``benchmarks/tune.py``); derived values follow. Code that caches anything derived
from a config registers with ``on_override_change``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

from ..vocab import dtype_bytes
from .tiling import (
    MAX_CTAS_PER_SM,
    MAX_REGISTERS_PER_THREAD,
    MAX_THREADS_PER_CTA,
    MAX_THREADS_PER_SM,
    REGISTERS_PER_SM,
    SMEM_PER_SM,
    SMEM_RESERVED_PER_CTA,
    SMEM_STATIC_PER_CTA,
    RowTiling,
    backward_tiling,
    forward_tiling,
    vector_width,
)

HOPPER = "sm_90a"
MAX_HINTED_REGISTERS = 255  # what a thread may hold when the register hint allows one CTA per SM
# The backward reads its upstream gradient as up to this many summands (``rmsnorm_bwd``: q/k/v dgrads).
MAX_G_PARTS = 3
# The memory-efficient backward (``rmsnorm_bwd``, ``from_output``) recomputes xhat = y / s from the saved
# y, with s = w + weight_offset clamped in magnitude to at least this FP32 value, as Apex's
# FusedRMSNorm(memory_efficient=True) clamps (by its eps there). Not eps: the backward never sees eps,
# and one constant keeps one variant. 2^-20 (about 1e-6): small enough that no scale a model
# initializes or trains reaches it, a power of two so that a clamped column's y is scaled exactly, and
# it turns s = 0 (y = 0) into xhat = 0 instead of 0 / 0. A column with |s| below it gets a wrong xhat,
# so a wrong dW and dx, by construction (docs/memory.md).
SCALE_FLOOR = 2.0**-20
# Partial rows a row lane of the reduction loads before adding them (``dw_reduce.ColumnSum``): the
# reduction is bound by the latency of its loads from the L2, and up to this many of a lane's rows then
# cost one round trip (the additions keep their order, so dw keeps its bits whatever the value).
REDUCE_ROWS_IN_FLIGHT = 8


@dataclass(frozen=True)
class ForwardConfig:
    """The forward kernel: its row tiling and its ``min_blocks_per_mp`` register hint (0: none)."""

    tiling: RowTiling
    min_ctas_per_sm: int

    def describe(self) -> str:
        return f"{self.tiling.describe()} min_ctas/SM={self.min_ctas_per_sm or '-'}"


@dataclass(frozen=True)
class BackwardConfig:
    """The backward kernel.

    ``dw_in_smem``: 512-thread CTAs whose lanes own more than one vector keep the FP32 dW accumulator in
    shared memory and read g and h from global memory twice (the second read an L2 hit) instead of
    staging them; otherwise g and h stream through a ring of ``ring_depth`` slots, each a row tile per
    part of g and one of h. ``register_budget`` is held through ``min_ctas_per_sm``; ``smem_bytes`` bounds
    one CTA's shared memory; ``ctas_per_sm`` CTAs are resident on an SM (the persistent grid launches
    exactly that many)."""

    tiling: RowTiling
    dw_in_smem: bool
    ring_depth: int  # 0 when dw_in_smem (no ring)
    register_budget: int
    min_ctas_per_sm: int
    smem_bytes: int
    ctas_per_sm: int
    dw_in_launch: bool = False  # the backward sums its partial rows itself (``dw_finish``)
    cooperative: bool = True  # that launch is cooperative

    def describe(self) -> str:
        ring = "dW in smem, g/h re-read" if self.dw_in_smem else f"ring={self.ring_depth}"
        finish = (
            (" dW in launch" + ("" if self.cooperative else " non-cooperative")) if self.dw_in_launch else ""
        )
        return (
            f"{self.tiling.describe()} {ring} regs<={self.register_budget} "
            f"smem={self.smem_bytes}B ctas/SM={self.ctas_per_sm}{finish}"
        )


@dataclass(frozen=True)
class ReduceConfig:
    """The dW reduction: a CTA of ``threads`` threads covers ``col_lanes`` vectors of ``vec`` FP32 columns
    and splits the partial rows over ``threads // col_lanes`` row lanes, whose number fixes the summation
    order. A row lane loads ``rows_in_flight`` partial rows before adding them, which leaves dw's bits
    unchanged."""

    hidden: int
    vec: int
    col_lanes: int
    after_backward: bool  # launched with programmatic dependent launch behind the backward
    threads: int = 256
    rows_in_flight: int = REDUCE_ROWS_IN_FLIGHT

    @property
    def row_lanes(self) -> int:
        return self.threads // self.col_lanes

    @property
    def cols_per_cta(self) -> int:
        return self.col_lanes * self.vec

    def describe(self) -> str:
        pdl = " pdl" if self.after_backward else ""
        batch = f" in_flight={self.rows_in_flight}" if self.rows_in_flight > 1 else ""
        return f"vec={self.vec} col_lanes={self.col_lanes} row_lanes={self.row_lanes}{batch}{pdl}"


# ------------------------------------------------------------------------------------ override table

CHOICES = {
    "fwd": ("tiling", "min_ctas_per_sm"),
    "bwd": ("tiling", "ring_depth", "register_budget", "ctas_per_sm", "dw_in_launch", "cooperative"),
    "dw": ("col_lanes", "after_backward", "threads", "rows_in_flight"),
    "quant": ("tiling", "min_ctas_per_sm", "amax_scatter", "programs_per_sm"),
    "gated_bwd": ("dw_in_launch", "cooperative"),
}
_overrides: dict[tuple[str, str, str, int], dict] = {}
_listeners: list[Callable[[], None]] = []


def override_choices(kind: str, arch: str, dtype: str, hidden: int) -> dict:
    """The overridden choices for one (kind, arch, dtype, H); ``dtype`` is dW's output dtype for ``"dw"``."""
    return _overrides.get((kind, arch, dtype, hidden), {})


def on_override_change(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear`` (a cache of values derived from configs) to run whenever overrides change."""
    _listeners.append(clear)
    return clear


def _overrides_changed() -> None:
    for cached in (forward_config, backward_config, reduce_config):
        cached.cache_clear()
    for clear in _listeners:
        clear()


def _check_choices(kind: str, dtype: str, hidden: int, choices: dict) -> None:
    if kind not in CHOICES:
        raise ValueError(f"kind must be one of {', '.join(CHOICES)}, got {kind!r}")
    unknown = sorted(set(choices) - set(CHOICES[kind]))
    if unknown:
        raise ValueError(
            f"a {kind} config has no choice {', '.join(unknown)}; it has {', '.join(CHOICES[kind])}"
        )
    tiling = choices.get("tiling")
    if tiling is not None and tiling.hidden != hidden:
        raise ValueError(f"an overridden tiling must be one of H = {hidden}, got one of H = {tiling.hidden}")
    if tiling is not None and tiling.vec != vector_width(hidden, dtype_bytes(dtype)):
        # The tensor views and alignment checks assume the vector width of the dtype and H.
        raise ValueError(f"an overridden tiling must keep vec={vector_width(hidden, dtype_bytes(dtype))}")


@contextmanager
def overridden(kind: str, arch: str, dtype: str, hidden: int, **choices) -> Iterator[None]:
    """Use ``choices`` for one (kind, arch, dtype, H) while the context is open.

    Parameters
    ----------
    kind, arch, dtype, hidden
        ``"fwd"``, ``"bwd"``, ``"dw"``, ``"quant"`` or ``"gated_bwd"``; a compile target; the rows' dtype
        name (dW's output dtype for ``"dw"``); H (the whole row's for ``"gated_bwd"``). A backward entry
        applies to both w dtypes and every mode, a quant entry to both recipes, a gated backward entry to
        every group size.
    **choices
        Values for the entry's ``CHOICES``; the rest keep their rules, and derived values follow.

    Raises
    ------
    ValueError
        An unknown kind or choice, or a tiling of another H or vector width.
    """
    _check_choices(kind, dtype, hidden, choices)
    key = (kind, arch, dtype, hidden)
    previous = _overrides.get(key)
    _overrides[key] = {**(previous or {}), **choices}
    _overrides_changed()
    try:
        yield
    finally:
        if previous is None:
            del _overrides[key]
        else:
            _overrides[key] = previous
        _overrides_changed()


# --------------------------------------------------------------------------------------------- forward


def forward_register_hint(tiling: RowTiling, arch: str) -> int:
    """The forward's ``min_blocks_per_mp`` hint: none on sm_90a; on Blackwell the 128-register cap for the
    cluster variants its compiler would squeeze into spilling."""
    if arch == HOPPER or tiling.cluster_n == 1:
        return 0
    return tiling.min_ctas_per_sm


@cache
def forward_config(arch: str, act_dtype: str, hidden: int) -> ForwardConfig:
    choices = override_choices("fwd", arch, act_dtype, hidden)
    tiling = choices.get("tiling") or forward_tiling(hidden, act_dtype)
    hint = choices.get("min_ctas_per_sm", forward_register_hint(tiling, arch))
    return ForwardConfig(tiling, hint)


# -------------------------------------------------------------------------------------------- backward


def backward_ring_depth(tiling: RowTiling, act_dtype: str, residual: bool) -> int:
    """Row tiles of g and h a staged backward CTA cycles through: 4 for plain rows one CTA holds, else 2.
    The exceptions measured slower with more stages: residual mode (its g_residual group would force a
    tile early), cluster tilings (a CTA waits out every DSMEM row sum), and one-row CTAs whose lanes hold
    one 2-byte vector each (bf16/fp16 H = 1024-4096) at the training shapes."""
    if residual or tiling.cluster_n > 1:
        return 2
    if tiling.vecs_per_thread == 1 and tiling.rows_per_cta == 1 and dtype_bytes(act_dtype) == 2:
        return 2
    return 4


def parts_ring_depth(ring_depth: int, g_parts: int) -> int:
    """Slots of the ring when g arrives as ``g_parts`` summands (a slot stages g_parts + 1 tiles): the
    one-g ring's number of tiles in whole slots, since shared memory bounds the CTAs per SM, and never
    fewer than two slots. Two-slot rings thus stage more per slot, and where that crosses half an SM's
    shared memory one CTA per SM remains instead of two. One g keeps its ring."""
    return max(2, ring_depth * 2 // (g_parts + 1))


def backward_register_budget(tiling: RowTiling, arch: str) -> int:
    """Registers per backward thread: 128, or a lean budget (80, or 64 for 512-thread CTAs) when each
    thread owns at most two vectors, needs no column predicates and shares its CTA with at most one other
    row, so more CTAs hide the per-row latency. Narrower tilings spill under 80, and so do some sm_100a
    variants, which keep 128 (the lean budgets are tuned on Hopper)."""
    lean = tiling.vecs_per_thread <= 2 and tiling.covers_row_exactly and tiling.rows_per_cta <= 2
    if not lean or arch != HOPPER:
        return MAX_REGISTERS_PER_THREAD
    return 64 if tiling.threads_per_cta >= MAX_THREADS_PER_CTA else 80


def smem_bound_register_budget(tiling: RowTiling, budget: int, smem_bytes: int) -> int:
    """Registers per thread of a backward variant that needs more (g in parts, or the memory-efficient
    mode): where shared memory admits fewer CTAs than ``budget``'s hint asks for, the hint would only
    squeeze registers, so the budget grows to those CTAs' share of the register file, at most
    ``MAX_HINTED_REGISTERS``. Residency is unchanged."""
    fit = resident_ctas_per_sm(tiling, smem_bytes, MAX_CTAS_PER_SM)
    share = REGISTERS_PER_SM // (fit * tiling.threads_per_cta)
    return max(budget, min(MAX_HINTED_REGISTERS, share))


def backward_smem_bytes(
    tiling: RowTiling,
    act_dtype: str,
    w_dtype: str,
    residual: bool,
    g_parts: int,
    ring_depth: int,
    dw_in_smem: bool,
) -> int:
    """Shared memory of one backward CTA, an upper bound; w's tile in its own dtype, which under autocast
    can decide whether two CTAs fit."""
    tile = tiling.rows_per_cta * tiling.cols_per_cta
    reduction = 4 * 2 * tiling.rows_per_cta * (tiling.warps_per_row + 1) + 64
    act_bytes = dtype_bytes(act_dtype)
    staging = (1 if residual else 0) * tile * act_bytes
    staging += 4 * tile if dw_in_smem else ring_depth * (g_parts + 1) * tile * act_bytes
    staging += 4 * tile if tiling.rows_per_cta > 1 else 0
    return reduction + dtype_bytes(w_dtype) * tile + staging + SMEM_STATIC_PER_CTA + 256


def resident_ctas_per_sm(tiling: RowTiling, smem_bytes: int, min_ctas_per_sm: int) -> int:
    """CTAs resident on one SM: registers, shared memory and thread slots all bound it."""
    by_smem = SMEM_PER_SM // (smem_bytes + SMEM_RESERVED_PER_CTA)
    by_threads = MAX_THREADS_PER_SM // tiling.threads_per_cta
    return max(1, min(min_ctas_per_sm, by_smem, by_threads, MAX_CTAS_PER_SM))


@cache
def backward_config(
    arch: str,
    act_dtype: str,
    w_dtype: str,
    hidden: int,
    residual: bool,
    g_parts: int = 1,
    from_output: bool = False,
) -> BackwardConfig:
    """The backward's config for g in ``g_parts`` summands (1 to ``MAX_G_PARTS``). An overridden
    ``ring_depth`` is the one-g ring's. The memory-efficient variant (``from_output``) keeps the
    default's tiling, ring, shared memory and residency; like a parts variant it may take more registers
    where shared memory leaves them free.

    Raises
    ------
    ValueError
        ``g_parts`` out of range, or an overridden ring deeper than 2 in residual mode.
    """
    if not 1 <= g_parts <= MAX_G_PARTS:
        raise ValueError(f"g arrives as 1 to {MAX_G_PARTS} parts, got g_parts={g_parts}")
    choices = override_choices("bwd", arch, act_dtype, hidden)
    tiling = choices.get("tiling") or backward_tiling(hidden, act_dtype, residual)
    dw_in_smem = tiling.threads_per_cta >= MAX_THREADS_PER_CTA and tiling.vecs_per_thread > 1
    ring_depth = (
        0 if dw_in_smem else choices.get("ring_depth") or backward_ring_depth(tiling, act_dtype, residual)
    )
    if residual and ring_depth > 2:
        # A g_residual group committed behind a tile's g and h would force that tile's arrival early.
        raise ValueError(f"residual mode keeps a ring of 2 row tiles, got ring_depth={ring_depth}")
    if not dw_in_smem:
        ring_depth = parts_ring_depth(ring_depth, g_parts)
    smem = backward_smem_bytes(tiling, act_dtype, w_dtype, residual, g_parts, ring_depth, dw_in_smem)
    budget = choices.get("register_budget") or backward_register_budget(tiling, arch)
    if (g_parts > 1 or from_output) and "register_budget" not in choices:
        budget = smem_bound_register_budget(tiling, budget, smem)
    min_ctas = max(1, REGISTERS_PER_SM // (budget * tiling.threads_per_cta))
    per_sm = choices.get("ctas_per_sm") or resident_ctas_per_sm(tiling, smem, min_ctas)
    finish = {k: choices[k] for k in ("dw_in_launch", "cooperative") if k in choices}
    return BackwardConfig(tiling, dw_in_smem, ring_depth, budget, min_ctas, smem, per_sm, **finish)


# ---------------------------------------------------------------------------------------- dW reduction


# A dW reduction of at most NARROW_REDUCE_MAX_CTAS column CTAs (H <= 256 in 4-column vectors) cannot
# fill the GPU: there, CTAs of NARROW_REDUCE_THREADS threads (1024 row lanes, measured fastest; the lane
# count is part of the summation order, so it stays as shipped).
NARROW_REDUCE_MAX_CTAS = 64
NARROW_REDUCE_THREADS = 1024


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def finish_team(reduce: ReduceConfig, threads: int) -> int:
    """Threads of one team of the in-launch dW finish: a column vector's row lanes, at most a power of two."""
    return min(reduce.row_lanes, largest_power_of_two(threads))


def finish_cells_bytes(reduce: ReduceConfig, threads: int) -> int:
    """Shared memory of the dW finish in a backward CTA: each warp's FP32 column vector for every team."""
    team = finish_team(reduce, threads)
    return -(-threads // team) * max(1, team // 32) * reduce.vec * 4


@cache
def reduce_config(arch: str, out_dtype: str, hidden: int) -> ReduceConfig:
    """The reduction's config for ``hidden`` FP32 partial sums: 4-column vectors when H allows, column
    lanes halved for narrow rows so the work spreads over many CTAs, ``NARROW_REDUCE_THREADS`` threads
    where few CTAs remain, ``REDUCE_ROWS_IN_FLIGHT`` rows in flight. Only the row lanes fix dw's
    summation order."""
    vec = 4 if hidden % 4 == 0 else 1
    choices = override_choices("dw", arch, out_dtype, hidden)
    col_lanes = choices.get("col_lanes")
    narrow = -(-hidden // vec) <= NARROW_REDUCE_MAX_CTAS
    threads = choices.get("threads", NARROW_REDUCE_THREADS if narrow else ReduceConfig.threads)
    in_flight = choices.get("rows_in_flight", ReduceConfig.rows_in_flight)
    if col_lanes is None:
        col_vecs = -(-hidden // vec)
        col_lanes = 1
        while col_lanes < 32 and col_lanes * 2 * threads <= col_vecs:
            col_lanes *= 2
    return ReduceConfig(hidden, vec, col_lanes, choices.get("after_backward", True), threads, in_flight)
