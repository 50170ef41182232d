"""The ``cake-cute`` command: warmup (fill the kernel cache, no GPU needed), info, check, bench.

Without a subcommand it does what makes sense on the machine: on a GPU ``check`` then ``bench``;
without one the default ``warmup`` (so a CI job can run the bare command).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from ..vocab import SILU
from . import EXIT_USAGE  # also for a bad --cache-dir and a missing GPU
from .bench.cases import RESIDUAL_MODES
from .info import cmd_info

EXIT_FAILED = 1
EXIT_NO_GPU = 2

BARE_COMMAND = (
    "Without a command: on a supported GPU, `check` then `bench`; without one, `warmup` with its "
    "defaults (every supported arch: sm_90a, sm_100a, sm_103a; bf16; H = 4096; residual off and on)."
)


def _csv(convert, what: str):
    """An argparse type for comma-separated values; an empty list or a bad item is a usage error."""

    def parse(text: str):
        try:
            values = [convert(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected one or more {what} separated by commas, got {text!r}")
        return values

    return parse


def _dtype(name: str) -> str:
    from ..vocab import DTYPE_NAMES

    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}: choose from {', '.join(DTYPE_NAMES)}")
    return name


def _hidden(text: str) -> int:
    from .warmup import check_hidden

    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"hidden size {text!r} is not an integer") from None
    return check_hidden(value)


def _gated_form(text: str) -> tuple[int, int]:
    """``H`` -> (H, H); ``H/G`` -> (H, G), G dividing H."""
    hidden_text, _, group_text = text.partition("/")
    hidden = _hidden(hidden_text)
    group = _hidden(group_text) if group_text else hidden
    if hidden % group:
        raise ValueError(f"group size {group} does not divide the hidden size {hidden}")
    return hidden, group


def _gate_activation(name: str) -> str:
    from ..validation import check_gate_activation

    return check_gate_activation(name)


def _arch(name: str) -> str:
    from .warmup import normalize_arch

    return normalize_arch(name)


def _recipe(name: str) -> str:
    from ..validation import check_recipe

    return check_recipe(name)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


W_MODES = {"same": ("same",), "fp32": ("fp32",), "both": ("same", "fp32")}


def _add_variant_arguments(p, hidden_default) -> None:
    p.add_argument(
        "--arch",
        type=_csv(_arch, "archs"),
        help="e.g. sm_90a,sm_100a,sm_103a (default: the local GPU's, else all three)",
    )
    p.add_argument(
        "--dtype", type=_csv(_dtype, "dtypes"), default=["bf16"], help="bf16,fp16,fp32 (default bf16)"
    )
    p.add_argument(
        "--hidden", type=_csv(_hidden, "hidden sizes"), default=hidden_default, help="hidden sizes"
    )


def _add_warmup(sub) -> None:
    p = sub.add_parser("warmup", help="compile kernels into the on-disk cache (works without a GPU)")
    _add_variant_arguments(p, [4096])
    p.add_argument(
        "--residual",
        choices=sorted(RESIDUAL_MODES),
        default="both",
        help="residual-add variants (default both)",
    )
    p.add_argument(
        "--w-dtype",
        choices=sorted(W_MODES),
        default="same",
        help="weight dtype: the activation dtype, fp32, or both (default same)",
    )
    p.add_argument(
        "--weight-offset",
        type=_finite_float,
        default=0.0,
        help="the constant added to w, compiled into the kernels (1.0 for Gemma-style norms; default 0)",
    )
    p.add_argument(
        "--fp8",
        type=_csv(_recipe, "FP8 recipes"),
        default=[],
        help="also the quantizing forwards of these recipes (mxfp8,1x128), with and without y",
    )
    p.add_argument(
        "--gated",
        type=_csv(_gated_form, "gated forms"),
        default=[],
        help="also the gated norms' kernels for these forms: H (statistics over whole rows, as the "
        "norm-then-gate classes) or H/G (per group of G columns, as the Mamba-2 family), e.g. 128,8192/1024",
    )
    p.add_argument(
        "--gate-activation",
        type=_csv(_gate_activation, "gate activations"),
        default=[SILU],
        help="the gate activations of the --gated kernels: silu (default), sigmoid (Kimi Linear, GLM-5 "
        "Next, Bailing hybrid), or silu,sigmoid",
    )
    p.add_argument(
        "--memory-efficient",
        action="store_true",
        help="also the backwards of the memory-efficient mode (memory_efficient=True), which read the "
        "forward's output",
    )
    p.add_argument(
        "--cache-dir", help="kernel cache directory (default $CAKE_CUTE_CACHE_DIR or ~/.cache/cake_cute)"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="print registers, spills, atomics, access widths and the config per kernel; exit 1 if any "
        "kernel spills or has a global atomic",
    )
    p.add_argument("--jobs", type=_positive_int, help="worker processes (default: the CPU count)")


def build_parser() -> argparse.ArgumentParser:
    """The ``cake-cute`` argument parser (``bench`` has its own, in ``cake_cute.tools.bench.cli``)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="cake-cute",
        description="Fused RMSNorm training kernels (CuTe DSL): cache warmup, info, self-check, bench. "
        + BARE_COMMAND,
    )
    parser.add_argument("--version", action="version", version=f"cake-cute {__version__}")
    sub = parser.add_subparsers(dest="command")
    _add_warmup(sub)
    info = sub.add_parser("info", help="versions, GPU, cache location and contents")
    info.add_argument(
        "--hidden",
        type=_csv(_hidden, "hidden sizes"),
        help="also show the config chosen per kernel kind for these hidden sizes",
    )
    info.add_argument("--dtype", type=_csv(_dtype, "dtypes"), default=["bf16"], help="for --hidden")
    info.add_argument("--arch", type=_csv(_arch, "archs"), help="for --hidden (default as for warmup)")
    check = sub.add_parser("check", help="correctness self-test on the current GPU (FP64 reference)")
    check.add_argument("--quick", action="store_true", help="a smaller matrix")
    sub.add_parser("bench", add_help=False, help="performance sweep (`cake-cute bench --help` lists options)")
    parser.subcommand_parsers = dict(sub.choices)  # whose usage an unknown option of each prints
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; an unknown option is the usage error of the subcommand it follows."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        follows_command = args.command is not None and argv.index(args.command) < argv.index(unknown[0])
        owner = parser.subcommand_parsers[args.command] if follows_command else parser
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _use_cache_dir(explicit: str | None) -> str | None:
    """Point the cache at ``explicit`` (through the environment, for spawned workers) and check it once."""
    from ..runtime.cache import cache_dir
    from .warmup import cache_dir_problem

    if explicit:
        os.environ["CAKE_CUTE_CACHE_DIR"] = os.path.abspath(explicit)
    return cache_dir_problem(cache_dir(), create_parents=not explicit)


def cmd_warmup(args) -> int:
    """Exit 1 if a variant fails or, with --report, a kernel spills, has a global atomic or cannot hold
    its programs; exit 2 for an unusable cache directory."""
    from .cubin import spill_free
    from .kernel_report import collect_reports, format_report
    from .warmup import build_native, gated_variant_specs, local_archs, variant_specs, warm

    start = time.perf_counter()
    problem = _use_cache_dir(args.cache_dir)
    if problem:
        print(f"cake-cute warmup: cannot use the cache directory: {problem}", file=sys.stderr)
        return EXIT_USAGE
    archs = args.arch or local_archs()
    specs = variant_specs(
        archs,
        args.dtype,
        args.hidden,
        RESIDUAL_MODES[args.residual],
        W_MODES[args.w_dtype],
        weight_offset=args.weight_offset,
        memory_efficient=args.memory_efficient,
    )
    if args.fp8:
        from ..fp8 import fp8_variant_specs

        residuals = RESIDUAL_MODES[args.residual]
        specs += fp8_variant_specs(
            archs, args.dtype, args.hidden, residuals, args.fp8, weight_offset=args.weight_offset
        )
    if args.gated:
        specs += gated_variant_specs(
            archs,
            args.dtype,
            args.gated,
            W_MODES[args.w_dtype],
            weight_offset=args.weight_offset,
            activations=args.gate_activation,
        )
    specs = list(dict.fromkeys(specs))
    result = warm(specs, args.jobs)
    native_build = build_native()
    print(native_build.line())
    parts = [result.summary(), native_build.summary()]
    for outcome in result.failed:
        print(f"FAILED {outcome.spec.name()}:\n  " + outcome.error.replace("\n", "\n  "), file=sys.stderr)
    spilling = atomic = crowded = []
    if args.report:
        failed = {o.spec for o in result.failed}
        reported = [s for s in specs if s not in failed]
        print(f"reading the cubins of {len(reported)} kernels (cuobjdump, nvdisasm) ...", file=sys.stderr)
        report_start = time.perf_counter()
        try:
            reports = collect_reports(reported, args.jobs)
        except Exception as exc:  # e.g. cuobjdump missing: say so, do not dump a traceback
            print(f"cake-cute warmup --report: {exc}", file=sys.stderr)
            return EXIT_FAILED
        parts.append(f"reports of {len(reports)} kernels ({time.perf_counter() - report_start:.1f}s)")
        print(format_report(reports))
        spilling = [r["name"] for r in reports if not spill_free(r) or r["local_loads"] or r["local_stores"]]
        atomic = [r["name"] for r in reports if r["data_atomics"]]
        crowded = [r["name"] for r in reports if not r["programs_fit"]]
        if spilling:
            print(f"{len(spilling)} kernel(s) spill registers: " + ", ".join(spilling), file=sys.stderr)
        if atomic:
            print(f"{len(atomic)} kernel(s) have atomics on data: " + ", ".join(atomic), file=sys.stderr)
        if crowded:
            message = (
                f"{len(crowded)} persistent kernel(s) hold too many registers for their programs per SM: "
            )
            print(message + ", ".join(crowded), file=sys.stderr)
    # Every step this command took, with its time, and the whole (the kernels' part comes first: its
    # counts are what scripts read).
    print("; ".join([*parts, f"total {time.perf_counter() - start:.1f}s"]))
    return EXIT_FAILED if result.failed or spilling or atomic or crowded else 0


def cmd_check(args) -> int:
    """The self-check on this GPU; exit 2 without a supported one."""
    from .selfcheck import gpu_problem, run_check

    problem = gpu_problem()
    if problem:
        print(f"cake-cute check needs a supported GPU: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    return run_check(quick=args.quick)


def cmd_bench(argv: list[str]) -> int:
    from .bench.cli import main as bench_main

    return bench_main(argv)


def cmd_default() -> int:
    """On a GPU: check, then bench. Without one: the default warmup."""
    from .selfcheck import gpu_problem

    problem = gpu_problem()
    if problem:
        print(
            f"cake-cute: {problem}; running `cake-cute warmup` with its defaults: compiling the kernels "
            "into the cache, then building the native host path",
            file=sys.stderr,
        )
        return cmd_warmup(build_parser().parse_args(["warmup"]))
    return cmd_check(argparse.Namespace(quick=False)) or cmd_bench([])


COMMANDS = {"warmup": cmd_warmup, "info": cmd_info, "check": cmd_check}


def main(argv: list[str] | None = None) -> int:
    """The ``cake-cute`` command.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 success; 1 a failed compile, check, spill or atomic; 2 a usage error, an
        unusable cache directory or a missing GPU (argparse's own errors exit 2 through SystemExit).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after "bench" belongs to the bench's own parser
        return cmd_bench(argv[1:])
    args = _parse(argv)
    if args.command is None:
        return cmd_default()
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
