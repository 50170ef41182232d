"""The per-kernel report of ``cake-cute warmup --report``: registers, spills, atomics, load and store
widths and the config each variant compiles with, read from the cubins in the disk cache."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..runtime.cache import KernelSpec, ReduceSpec
from .warmup import default_jobs


def describe_config(spec: KernelSpec | ReduceSpec) -> str:
    """The configuration ``spec`` compiles with, as text: ``build.config_for(spec).describe()``."""
    from ..runtime.build import config_for

    return config_for(spec).describe()


def programs_fit(spec: KernelSpec | ReduceSpec, registers: int) -> bool:
    """Whether a persistent kernel with ``programs_per_sm`` holds all of an SM's programs at once with
    its registers; True for other kernels."""
    from ..kernels.tiling import REGISTERS_PER_SM
    from ..runtime.build import config_for

    config = config_for(spec)
    programs = getattr(config, "programs_per_sm", 0)
    return not programs or registers * programs * config.tiling.threads_per_cta <= REGISTERS_PER_SM


def collect_reports(specs: list[KernelSpec], jobs: int | None = None, *, sass: bool = True) -> list[dict]:
    """Cubin reports of ``specs`` (compiled where missing) with their config and ``programs_fit``."""
    from .cubin import kernel_report

    def report(spec: KernelSpec) -> dict:
        found = kernel_report(spec, sass=sass)
        return {
            **found,
            "config": describe_config(spec),
            "programs_fit": programs_fit(spec, found["registers"]),
        }

    with ThreadPoolExecutor(max_workers=jobs or default_jobs()) as pool:
        return list(pool.map(report, specs))


REPORT_COLUMNS = (
    ("kernel", lambda r: r["name"]),
    ("regs", lambda r: r["registers"]),
    ("stack B", lambda r: r["stack_bytes"]),
    ("local B", lambda r: r["local_bytes"]),
    ("LDL/STL", lambda r: f"{r['local_loads']}/{r['local_stores']}"),
    ("atomics", lambda r: r["data_atomics"]),
    ("cluster", lambda r: r["cluster_n"]),
    ("threads", lambda r: r["threads"] if r["threads"] is not None else "?"),
    ("ld bits", lambda r: r["global_load_width_bits"]),
    ("st bits", lambda r: r["global_store_width_bits"]),
    ("config", lambda r: r["config"]),
)
TEXT_COLUMNS = ("kernel", "config")
REPORT_LEGEND = (
    "regs: registers per thread; stack B / local B: stack frame and local memory per thread in bytes "
    "(non-zero means spills); LDL/STL: local loads/stores in the SASS; atomics: global atomics on data "
    "in the SASS (floating-point: non-zero breaks determinism; a grid barrier's integer counter is not "
    "data); cluster: CTAs per cluster; "
    "threads: per CTA; ld/st bits: widest global load/store per thread; config: the config value the "
    "kernel compiles with (vec: elements per vector, tpr: threads per row, vpt: vectors per thread, "
    "rows/cta: rows per CTA, min_ctas/SM: register hint, ring: staged row tiles, regs<=: register "
    "budget, smem: shared memory per CTA in bytes (sized at launch, so the cubin does not record it), "
    "ctas/SM: resident CTAs, col_lanes/row_lanes: the dW reduction's lanes over columns / partial rows)."
)


def format_report(reports: list[dict]) -> str:
    """A plain-text table of ``collect_reports`` output, then ``REPORT_LEGEND``."""
    rows = [[str(get(r)) for _, get in REPORT_COLUMNS] for r in reports]
    header = [name for name, _ in REPORT_COLUMNS]
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    left = [name in TEXT_COLUMNS for name in header]

    def line(cells):
        return "  ".join(c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(cells, widths, left)).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows] + [REPORT_LEGEND])
