"""Ahead-of-time compilation into the on-disk kernel cache (``cake-cute warmup``); no GPU needed.

A training job then loads every kernel from disk and never compiles on its hot path. Compiling is
CPU-bound and independent per variant, so it runs in worker processes (spawned: the DSL's state is
not fork-safe); a variant that is already on disk costs one ``stat``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TextIO

from .compile_cache import KernelSpec, ReduceSpec, get_kernel, is_cached_on_disk
from .kernels.tiling import MAX_HIDDEN
from .vocab import SUPPORTED_ARCHS

DEFAULT_ARCHS = ("sm_90a", "sm_100a")
ARCH_ALIASES = {"sm_90": "sm_90a", "sm_100": "sm_100a", "sm_103": "sm_103a"}
DTYPES = ("bf16", "fp16", "fp32")
MAX_ERROR_LINES = 20


def normalize_arch(name: str) -> str:
    """``sm_90`` -> ``sm_90a`` (the kernels need the arch-specific features); unknown -> ValueError."""
    arch = ARCH_ALIASES.get(name.strip(), name.strip())
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {name!r}: cake_cute compiles for {', '.join(SUPPORTED_ARCHS)}")
    return arch


def check_hidden(hidden: int) -> int:
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is outside [1, {MAX_HIDDEN}]")
    return hidden


def local_archs() -> tuple[str, ...]:
    """The supported archs of this machine's GPUs, or the default pair when there is none."""
    import torch

    from .vocab import ARCH_BY_CAPABILITY

    if not torch.cuda.is_available():
        return DEFAULT_ARCHS
    found = {
        ARCH_BY_CAPABILITY.get(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())
    }
    found.discard(None)
    return tuple(sorted(found)) or DEFAULT_ARCHS


def variant_specs(
    archs: Iterable[str],
    dtypes: Iterable[str],
    hiddens: Iterable[int],
    residuals: Iterable[bool] = (False, True),
    w_modes: Iterable[str] = ("same",),
    weight_offset: float = 0.0,
) -> list[KernelSpec]:
    """Every kernel a training step can launch for these settings: forward and backward per
    (arch, dtype, w dtype, H, residual), and the dW reduction for both outputs it is asked for
    (FP32 from the functional API, w's dtype from autograd). Duplicates removed, order kept."""
    specs = []
    for arch, act, hidden, residual, w_mode in itertools.product(archs, dtypes, hiddens, residuals, w_modes):
        w = act if w_mode == "same" else "fp32"
        specs += [KernelSpec(kind, arch, act, w, hidden, residual, weight_offset) for kind in ("fwd", "bwd")]
        specs += [ReduceSpec(arch, out, hidden) for out in ("fp32", w)]
    return list(dict.fromkeys(specs))


@dataclass
class Outcome:
    spec: KernelSpec
    seconds: float
    error: str | None = None


@dataclass
class WarmupResult:
    cached: list[KernelSpec] = field(default_factory=list)
    compiled: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"warmup: {len(self.cached) + len(self.compiled) + len(self.failed)} variants, "
            f"compiled {len(self.compiled)}, cached {len(self.cached)}, failed {len(self.failed)} "
            f"({self.seconds:.1f}s)"
        )


def _short_error(exc: BaseException) -> str:
    """The DSL's errors can carry whole IR dumps; keep the head, which names the problem."""
    lines = f"{type(exc).__name__}: {exc}".splitlines()
    return "\n".join(lines[:MAX_ERROR_LINES] + (["..."] if len(lines) > MAX_ERROR_LINES else []))


def compile_one(spec: KernelSpec) -> Outcome:
    """Compile ``spec`` into the disk cache (in a worker); errors come back as text, since DSL
    exceptions do not always pickle."""
    start = time.perf_counter()
    try:
        get_kernel(spec)
    except Exception as exc:  # reported per variant; the other variants still compile
        return Outcome(spec, time.perf_counter() - start, _short_error(exc))
    return Outcome(spec, time.perf_counter() - start)


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_all(specs: list[KernelSpec], jobs: int) -> Iterator[Outcome]:
    """Outcomes in completion order; one worker or one variant compiles in this process (a worker
    costs a few seconds of imports)."""
    if jobs <= 1 or len(specs) <= 1:
        yield from map(compile_one, specs)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context) as pool:
        futures = {pool.submit(compile_one, spec): spec for spec in specs}
        for future in as_completed(futures):
            try:
                yield future.result()
            except Exception as exc:  # the worker died (e.g. BrokenProcessPool after a crash)
                yield Outcome(futures[future], 0.0, f"worker failed: {exc!r}")


def warm(specs: list[KernelSpec], jobs: int | None = None, progress: TextIO = sys.stderr) -> WarmupResult:
    """Compile the variants of ``specs`` that are not on disk yet, printing one line per compile."""
    start = time.perf_counter()
    result = WarmupResult()
    pending = []
    for spec in specs:
        (result.cached if is_cached_on_disk(spec) else pending).append(spec)
    print(f"{len(specs)} variants: {len(result.cached)} cached, {len(pending)} to compile", file=progress)
    width = len(str(len(pending)))
    for i, outcome in enumerate(_compile_all(pending, jobs or default_jobs()), 1):
        status = "FAILED  " if outcome.error else "compiled"
        print(
            f"[{i:>{width}}/{len(pending)}] {status} {outcome.spec.name()} {outcome.seconds:.1f}s",
            file=progress,
            flush=True,
        )
        (result.failed if outcome.error else result.compiled).append(outcome)
    result.seconds = time.perf_counter() - start
    return result


def collect_reports(specs: list[KernelSpec], jobs: int | None = None, *, sass: bool = True) -> list[dict]:
    """Cubin reports of cached variants; the tools run as subprocesses, so threads parallelize them."""
    from .cubin import kernel_report

    with ThreadPoolExecutor(max_workers=jobs or default_jobs()) as pool:
        return list(pool.map(lambda spec: kernel_report(spec, sass=sass), specs))


REPORT_COLUMNS = (
    ("kernel", lambda r: r["name"]),
    ("regs", lambda r: r["registers"]),
    ("stack", lambda r: r["stack_bytes"]),
    ("local", lambda r: r["local_bytes"]),
    ("LDL/STL", lambda r: f"{r['local_loads']}/{r['local_stores']}"),
    ("smem", lambda r: r["shared_bytes"]),
    ("cluster", lambda r: r["cluster_n"]),
    ("threads", lambda r: r["threads"] if r["threads"] is not None else "?"),
    ("ld bits", lambda r: r["global_load_width_bits"]),
    ("st bits", lambda r: r["global_store_width_bits"]),
)


def format_report(reports: list[dict]) -> str:
    """A plain-text table: the kernel name left-aligned, numbers right-aligned."""
    rows = [[str(get(r)) for _, get in REPORT_COLUMNS] for r in reports]
    header = [name for name, _ in REPORT_COLUMNS]
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header)] + [line(r) for r in rows])
