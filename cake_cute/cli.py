"""The ``cake-cute`` command: warmup (fill the kernel cache, no GPU needed), info, check, bench.

Without a subcommand it does what makes sense on the machine: on a GPU ``check`` then ``bench``;
without one the default ``warmup`` (so a CI job can run the bare command).
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_FAILED = 1
EXIT_NO_GPU = 2


def _csv(convert):
    """An argparse type for comma-separated values; a bad item is reported as a usage error."""

    def parse(text: str):
        try:
            return [convert(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _dtype(name: str) -> str:
    from .warmup import DTYPES

    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: choose from {', '.join(DTYPES)}")
    return name


def _hidden(text: str) -> int:
    from .warmup import check_hidden

    return check_hidden(int(text))


def _arch(name: str) -> str:
    from .warmup import normalize_arch

    return normalize_arch(name)


RESIDUAL_MODES = {"on": (True,), "off": (False,), "both": (False, True)}
W_MODES = {"same": ("same",), "fp32": ("fp32",), "both": ("same", "fp32")}


def _add_warmup(sub) -> None:
    p = sub.add_parser("warmup", help="compile kernels into the on-disk cache (works without a GPU)")
    p.add_argument("--arch", type=_csv(_arch), help="e.g. sm_90a,sm_100a (default: the local GPU, else both)")
    p.add_argument("--dtype", type=_csv(_dtype), default=["bf16"], help="bf16,fp16,fp32 (default bf16)")
    p.add_argument("--hidden", type=_csv(_hidden), default=[4096], help="hidden sizes (default 4096)")
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
        "--cache-dir", help="kernel cache directory (default $CAKE_CUTE_CACHE_DIR or ~/.cache/cake_cute)"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="print registers, spills and access widths per kernel; exit 1 if any kernel spills",
    )
    p.add_argument("--jobs", type=int, help="worker processes (default: the CPU count)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cake-cute",
        description="Fused RMSNorm training kernels (CuTe DSL): cache warmup, info, self-check, bench.",
    )
    sub = parser.add_subparsers(dest="command")
    _add_warmup(sub)
    sub.add_parser("info", help="versions, GPU, cache location and contents")
    check = sub.add_parser("check", help="correctness self-test on the current GPU (FP64 reference)")
    check.add_argument("--quick", action="store_true", help="a smaller matrix")
    sub.add_parser("bench", add_help=False, help="performance sweep (arguments go to cake_cute.bench)")
    return parser


def cmd_warmup(args) -> int:
    """Exit 1 if a variant fails to compile or, with --report, if a kernel spills (CI gates on both)."""
    from .cubin import spill_free
    from .warmup import collect_reports, format_report, local_archs, variant_specs, warm

    if args.cache_dir:
        # The environment (not a parameter) so spawned workers use the same directory.
        os.environ["CAKE_CUTE_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    archs = args.arch or local_archs()
    specs = variant_specs(
        archs, args.dtype, args.hidden, RESIDUAL_MODES[args.residual], W_MODES[args.w_dtype]
    )
    result = warm(specs, args.jobs)
    for outcome in result.failed:
        print(f"FAILED {outcome.spec.name()}:\n  " + outcome.error.replace("\n", "\n  "), file=sys.stderr)
    spilling = []
    if args.report:
        failed = {o.spec for o in result.failed}
        try:
            reports = collect_reports([s for s in specs if s not in failed], args.jobs)
        except Exception as exc:  # e.g. cuobjdump missing: say so, do not dump a traceback
            print(f"cake-cute warmup --report: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(format_report(reports))
        spilling = [r["name"] for r in reports if not spill_free(r)]
        if spilling:
            print(f"{len(spilling)} kernel(s) spill registers: " + ", ".join(spilling), file=sys.stderr)
    print(result.summary())
    return EXIT_FAILED if result.failed or spilling else 0


def _cache_contents() -> str:
    """Cached kernel objects: those of this code version, and all versions together."""
    from .compile_cache import cache_dir, fingerprint

    root = cache_dir()
    files = [p for p in root.rglob("*.o") if p.is_file()] if root.is_dir() else []
    current = sum(1 for p in files if p.parent.name == fingerprint())
    size = sum(p.stat().st_size for p in files)
    return f"{current} for this version, {len(files)} files in all, {size / 2**20:.1f} MiB"


def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return f"{version // 1000}.{version % 1000 // 10}" if int(err) == 0 else "?"
    except Exception:  # no driver library: the GPU line already says so
        return "?"


def _gpu_line() -> str:
    import torch

    from .vocab import ARCH_BY_CAPABILITY

    if not torch.cuda.is_available():
        return "no GPU"
    capability = torch.cuda.get_device_capability()
    arch = ARCH_BY_CAPABILITY.get(capability, f"sm_{capability[0]}{capability[1]} (not supported)")
    return (
        f"{torch.cuda.get_device_name()} ({arch}), {torch.cuda.device_count()} device(s), "
        f"driver CUDA {_driver_version()}"
    )


def _dsl_cuda_version(cutlass) -> str:
    """The CUDA toolkit flavour the DSL compiles with (cu12 or cu13 wheels)."""
    version = getattr(cutlass, "CUDA_VERSION", None)
    return f"{version.major}.{version.minor}" if hasattr(version, "major") else str(version)


def _cuobjdump_line() -> str:
    from .cubin import ToolNotFoundError, find_tool

    try:
        return str(find_tool("cuobjdump"))
    except ToolNotFoundError as exc:
        return f"not found ({exc}); warmup --report needs it"


def cmd_info(_args) -> int:
    import cutlass
    import torch
    import tvm_ffi

    from . import __version__
    from .compile_cache import cache_dir, fingerprint

    rows = [
        ("cake_cute", __version__),
        ("nvidia-cutlass-dsl", f"{cutlass.__version__} (CUDA {_dsl_cuda_version(cutlass)})"),
        ("apache-tvm-ffi", getattr(tvm_ffi, "__version__", "?")),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("GPU", _gpu_line()),
        ("cache", f"{cache_dir()} (version {fingerprint()})"),
        ("cached kernels", _cache_contents()),
        ("cuobjdump", _cuobjdump_line()),
    ]
    for key, value in rows:
        print(f"{key:<20}{value}")
    return 0


def cmd_check(args) -> int:
    from .selfcheck import gpu_problem, run_check

    problem = gpu_problem()
    if problem:
        print(f"cake-cute check needs a supported GPU: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    return run_check(quick=args.quick)


def cmd_bench(argv: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(argv)


def cmd_default() -> int:
    """On a GPU: check, then bench. Without one: the default warmup."""
    from .selfcheck import gpu_problem

    problem = gpu_problem()
    if problem:
        print(f"cake-cute: {problem}; running `cake-cute warmup` with its defaults", file=sys.stderr)
        return cmd_warmup(build_parser().parse_args(["warmup"]))
    return cmd_check(argparse.Namespace(quick=False)) or cmd_bench([])


COMMANDS = {"warmup": cmd_warmup, "info": cmd_info, "check": cmd_check}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after "bench" belongs to the bench's own parser
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command is None:
        return cmd_default()
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
