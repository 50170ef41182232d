"""Ahead-of-time compilation into the on-disk kernel cache (``cake-cute warmup``); no GPU needed, so a
training job never compiles on its hot path. Variants compile in spawned worker processes (the DSL's
state is not fork-safe); one already on disk costs a ``stat``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from ..kernels.tiling import MAX_HIDDEN
from ..runtime import build
from ..runtime.cache import KernelSpec, ReduceSpec, get_kernel_and_source, is_cached_on_disk
from ..runtime.specs import GatedSpec
from ..vocab import SILU, SUPPORTED_ARCHS

DEFAULT_ARCHS = SUPPORTED_ARCHS  # without a GPU: every arch the kernels compile for
ARCH_ALIASES = {arch.removesuffix("a"): arch for arch in SUPPORTED_ARCHS}  # sm_90 -> sm_90a
MAX_ERROR_LINES = 20


def normalize_arch(name: str) -> str:
    """``sm_90`` -> ``sm_90a`` (the kernels need the arch-specific features); unknown -> ValueError."""
    arch = ARCH_ALIASES.get(name.strip(), name.strip())
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {name!r}: cake_cute compiles for {', '.join(SUPPORTED_ARCHS)}")
    return arch


def check_hidden(hidden: int) -> int:
    """``hidden`` itself when the kernels support it, else ValueError."""
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is outside [1, {MAX_HIDDEN}]")
    return hidden


def local_archs() -> tuple[str, ...]:
    """The supported archs of this machine's GPUs, or every supported arch when there is none."""
    import torch

    from ..vocab import ARCH_BY_CAPABILITY

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
    memory_efficient: bool = False,
) -> list[KernelSpec]:
    """Every kernel a training step can launch for these settings.

    Parameters
    ----------
    archs, dtypes, hiddens : iterables
        Arch names (``sm_90a``...), activation dtype names (``bf16``...) and hidden sizes.
    residuals : iterable of bool
        Residual-add modes to compile.
    w_modes : iterable of {"same", "fp32"}
        w in the activation dtype, in FP32, or both.
    weight_offset : float
        The constant added to w (compiled in; 1.0 for Gemma).
    memory_efficient : bool
        Also the memory-efficient mode's backward.

    Returns
    -------
    list of KernelSpec
        Forward and backward per (arch, dtype, w dtype, H, residual) and what the backward launches to
        return dW in FP32 (the functional API) and in w's dtype (autograd); duplicates removed, order
        kept.
    """
    modes = (False, True) if memory_efficient else (False,)
    specs = []
    for arch, act, hidden, residual, w_mode in itertools.product(archs, dtypes, hiddens, residuals, w_modes):
        w = act if w_mode == "same" else "fp32"
        variant = (arch, act, w, hidden)
        kernels = [KernelSpec("fwd", *variant, residual=residual, weight_offset=weight_offset)]
        kernels += [
            KernelSpec("bwd", *variant, residual=residual, weight_offset=weight_offset, memory_efficient=mode)
            for mode in modes
        ]
        specs += with_dw_outputs(kernels, ("fp32", w))
    return list(dict.fromkeys(specs))


BACKWARD_KINDS = ("bwd", "gated_bwd")


def with_dw_outputs(kernels: list, outs: Iterable[str]) -> list:
    """``kernels`` and what their backwards launch to return dW in each dtype of ``outs`` (reductions, or
    a backward variant per output)."""
    outs = list(dict.fromkeys(outs))
    specs, reduced = [], None
    for spec in kernels:
        if spec.kind in BACKWARD_KINDS and build.config_for(spec).dw_in_launch:
            specs += [replace(spec, dw_dtype=out) for out in outs]
            continue
        specs.append(spec)
        reduced = spec if spec.kind in BACKWARD_KINDS else reduced
    if reduced is not None:
        specs += [ReduceSpec(reduced.arch, out, reduced.hidden) for out in outs]
    return specs


GATED_KINDS = ("gated_fwd", "gated_bwd")


def gated_variant_specs(
    archs: Iterable[str],
    dtypes: Iterable[str],
    forms: Iterable[tuple[int, int]],
    w_modes: Iterable[str] = ("same",),
    weight_offset: float = 0.0,
    activations: Iterable[str] = (SILU,),
) -> list[KernelSpec | GatedSpec | ReduceSpec]:
    """Every kernel a gated norm of these forms and activations can launch when called with a gate, under
    any cast policy (one called without a gate runs the plain kernels of ``variant_specs``).

    Parameters
    ----------
    archs, dtypes : iterables
        Arch names and activation dtype names, as for ``variant_specs``.
    forms : iterable of (int, int)
        (H, G): rows of H columns, statistics per group of G columns (G = H: whole rows).
    w_modes : iterable of {"same", "fp32"}
        The weight in the activation dtype, in FP32, or both.
    weight_offset : float
        The constant added to w, compiled into the fused kernels.
    activations : iterable of {"silu", "sigmoid"}
        The gate activations of the fused kernels.

    Returns
    -------
    list
        Per (arch, dtype, form): the fused forward and backward in both orders, what they launch to
        return dW, the statistics kernel (whole rows, SiLU: FlashInfer's functional backward), and the
        plain or unit-weight kernels the two-rounding policies launch. Duplicates removed, order kept.
    """
    specs: list = []
    activations = tuple(activations)
    for arch, act, (hidden, group), w_mode in itertools.product(archs, dtypes, forms, w_modes):
        w = act if w_mode == "same" else "fp32"
        kernels = [
            GatedSpec(
                kind,
                arch,
                act,
                w,
                hidden,
                group_size=group,
                norm_before_gate=norm_before_gate,
                weight_offset=weight_offset,
                activation=gate,
            )
            for gate, kind, norm_before_gate in itertools.product(activations, GATED_KINDS, (True, False))
        ]
        # dW into FP32 (the functional backward) and into w's dtype (autograd, FlashInfer's names).
        specs += with_dw_outputs(kernels, ("fp32", w))
        if group == hidden and SILU in activations:  # FlashInfer's functional backward recomputes rstd
            specs.append(
                GatedSpec("gated_rstd", arch, act, act, hidden, group_size=hidden, norm_before_gate=True)
            )
        # What the other policies launch where a rounding before the scale is not exact: a bf16 / fp16
        # x, or an FP32 x (the gate of another dtype included) with a bf16 / fp16 weight.
        unit = [
            GatedSpec(kind, arch, act, act, hidden, group_size=group, norm_before_gate=False, activation=gate)
            for gate, kind in itertools.product(activations, GATED_KINDS)
        ]
        specs += with_dw_outputs(unit, (act,))  # the unit weight's dW, x's dtype
        specs += variant_specs([arch], [act], [group], residuals=(False,))
        specs += _scale_then_round_specs(arch, act, hidden, group, w_mode, weight_offset)
    return list(dict.fromkeys(specs))


def _scale_then_round_specs(arch, act, hidden, group, w_mode, weight_offset) -> list:
    """The plain kernels norm then gate runs under ``"scale_then_round"``."""
    if group == hidden:
        return variant_specs([arch], [act], [hidden], (False,), (w_mode,), weight_offset=weight_offset)
    return variant_specs([arch], ["fp32"], [group], residuals=(False,))


COMPILED, LOADED, FAILED = "compiled", "loaded", "FAILED"


@dataclass
class Outcome:
    """What this process did for a variant: ``COMPILED``, ``LOADED`` after another's compile, ``FAILED``."""

    spec: KernelSpec
    seconds: float
    status: str
    error: str | None = None


@dataclass
class WarmupResult:
    """The variants of one warmup: found on disk, and what this process did with the others."""

    cached: list[KernelSpec] = field(default_factory=list)
    compiled: list[Outcome] = field(default_factory=list)
    loaded: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, outcome: Outcome) -> None:
        {COMPILED: self.compiled, LOADED: self.loaded, FAILED: self.failed}[outcome.status].append(outcome)

    def summary(self) -> str:
        """The one-line summary ``cake-cute warmup`` prints last."""
        total = len(self.cached) + len(self.compiled) + len(self.loaded) + len(self.failed)
        return (
            f"warmup: {total} variants, compiled {len(self.compiled)}, "
            f"loaded {len(self.loaded)} (compiled by another process meanwhile), "
            f"cached {len(self.cached)}, failed {len(self.failed)} ({self.seconds:.1f}s)"
        )


def _short_error(exc: BaseException) -> str:
    """The DSL's errors can carry whole IR dumps; keep the head, which names the problem."""
    lines = f"{type(exc).__name__}: {exc}".splitlines()
    return "\n".join(lines[:MAX_ERROR_LINES] + (["..."] if len(lines) > MAX_ERROR_LINES else []))


def compile_one(spec: KernelSpec) -> Outcome:
    """Bring ``spec`` into the disk cache in a worker; errors come back as text (DSL errors may not
    pickle)."""
    start = time.perf_counter()
    try:
        _, source = get_kernel_and_source(spec)
    except Exception as exc:  # reported per variant; the other variants still compile
        return Outcome(spec, time.perf_counter() - start, FAILED, _short_error(exc))
    return Outcome(spec, time.perf_counter() - start, COMPILED if source == "compiled" else LOADED)


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_all(specs: list[KernelSpec], jobs: int) -> Iterator[Outcome]:
    """Outcomes in completion order; a lone worker or variant compiles in this process."""
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
                yield Outcome(futures[future], 0.0, FAILED, f"worker failed: {exc!r}")


def warm(specs: list[KernelSpec], jobs: int | None = None, progress: TextIO | None = None) -> WarmupResult:
    """Compile the variants of ``specs`` not on disk yet with ``jobs`` workers, one line each to
    ``progress``; returns the ``WarmupResult``."""
    progress = progress or sys.stderr
    start = time.perf_counter()
    result = WarmupResult()
    pending = []
    for spec in specs:
        (result.cached if is_cached_on_disk(spec) else pending).append(spec)
    jobs = jobs or default_jobs()
    workers = min(jobs, len(pending)) if jobs > 1 and len(pending) > 1 else 1
    compiling = f", compiling them in {workers} process{'es' if workers > 1 else ''} ..." if pending else ""
    print(
        f"{len(specs)} variants: {len(result.cached)} cached, {len(pending)} to compile{compiling}",
        file=progress,
        flush=True,
    )
    width = len(str(len(pending)))
    for i, outcome in enumerate(_compile_all(pending, jobs), 1):
        print(
            f"[{i:>{width}}/{len(pending)}] {outcome.status:<8} {outcome.spec.name()} {outcome.seconds:.1f}s",
            file=progress,
            flush=True,
        )
        result.add(outcome)
    result.seconds = time.perf_counter() - start
    return result


BUILT, ON_DISK, SKIPPED, NOT_BUILT = "built", "already built", "skipped", "not built"


@dataclass
class NativeBuild:
    """What ``build_native`` did (``BUILT``, ``ON_DISK``, ``SKIPPED``, ``NOT_BUILT``) and the library's path
    or why there is none."""

    status: str
    detail: str
    seconds: float

    def line(self) -> str:
        """The line ``cake-cute warmup`` prints once the step is over."""
        if self.status in (BUILT, ON_DISK):
            return f"native host path: {self.detail}"
        if self.status == SKIPPED:
            return f"native host path: not built ({self.detail})"
        return f"native host path: not built, eager calls take the Python path ({self.detail})"

    def summary(self) -> str:
        """This step's part of the summary line."""
        return f"native host path {self.status} ({self.seconds:.1f}s)"


NATIVE_ANNOUNCEMENT = (
    "building the native host path (the C++ extension, once per torch and Python; "
    "a few minutes on a small CPU) ..."
)


def build_native(progress: TextIO | None = None) -> NativeBuild:
    """Build the native host path ahead of time; a failure is reported in the result, not raised."""
    from ..runtime import native

    progress = progress or sys.stderr
    if native.python_path_forced():
        return NativeBuild(SKIPPED, f"{native.PYTHON_PATH_ENV}=1", 0.0)
    start = time.perf_counter()
    try:
        on_disk = native.library_path().exists()
        if not on_disk:
            print(NATIVE_ANNOUNCEMENT, file=progress, flush=True)
        path = native.build()
    except Exception as err:  # no compiler, a failed build: said in the output, the warmup goes on
        return NativeBuild(NOT_BUILT, str(err), time.perf_counter() - start)
    return NativeBuild(ON_DISK if on_disk else BUILT, str(path), time.perf_counter() - start)


def cache_dir_problem(path: Path, *, create_parents: bool) -> str | None:
    """Why kernels cannot be cached in ``path``, or None; creates it, and its parents only with
    ``create_parents`` (an explicit ``--cache-dir`` must have a parent, catching typos)."""
    if path.exists() and not path.is_dir():
        return f"{path} is not a directory"
    if not path.exists():
        if not create_parents and not path.parent.is_dir():
            return f"{path}: its parent directory {path.parent} does not exist"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{path} cannot be created ({exc.strerror})"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror})"
    return None
