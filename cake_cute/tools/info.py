"""``cake-cute info``: versions, GPU, cache location and contents, the native host path, and with
``--hidden`` the config each kernel kind compiles with."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from . import EXIT_USAGE


def _native_status() -> str:
    """Whether the native host path is built for this torch, TVM-FFI and Python (builds nothing)."""
    from ..runtime import native

    if native.python_path_forced():
        return f"off ({native.PYTHON_PATH_ENV}=1)"
    try:
        path = native.library_path()
    except RuntimeError as err:  # no compiler
        return f"cannot be built: {err}"
    return f"{path} ({'built' if path.exists() else 'not built yet: cake-cute warmup builds it'})"


def _cache_contents() -> str:
    """Cached kernel objects: those of this code version, and all versions together."""
    from ..runtime.cache import cache_dir, fingerprint

    root = cache_dir()
    files = [p for p in root.rglob("*.o") if p.is_file()] if root.is_dir() else []
    current = sum(1 for p in files if p.parent.name == fingerprint())
    size = sum(p.stat().st_size for p in files)
    return f"{current} for this version, {len(files)} files in all, {size / 2**20:.1f} MiB"


def cache_dir_conflict(root: Path) -> str | None:
    """Why ``root`` cannot be the kernel cache directory, without creating anything; None otherwise."""
    existing = next(p for p in (root, *root.parents) if p.exists())
    if existing.is_dir():
        return None
    source = "CAKE_CUTE_CACHE_DIR" if os.environ.get("CAKE_CUTE_CACHE_DIR") else "the default location"
    problem = "is not a directory" if existing == root else f"lies under {existing}, which is not a directory"
    return f"the kernel cache path {root} ({source}) {problem}; point CAKE_CUTE_CACHE_DIR at a directory"


def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return f"{version // 1000}.{version % 1000 // 10}" if int(err) == 0 else "?"
    except Exception:  # no driver library: the GPU line already says so
        return "?"


def _gpu_line() -> str:
    import torch

    from ..vocab import ARCH_BY_CAPABILITY

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


def config_lines(archs, dtypes, hiddens) -> list[str]:
    """One line per kernel of (arch, dtype, H), with the config it compiles with."""
    from ..fp8 import fp8_variant_specs
    from ..runtime.specs import KernelSpec, ReduceSpec
    from .kernel_report import describe_config

    lines = []
    for arch, dtype, hidden in itertools.product(archs, dtypes, hiddens):
        specs = [
            KernelSpec(kind, arch, dtype, dtype, hidden, residual=res)
            for kind in ("fwd", "bwd")
            for res in (False, True)
        ]
        specs.append(ReduceSpec(arch, "fp32", hidden))
        specs += fp8_variant_specs([arch], [dtype], [hidden], emit_ys=(False,))
        for spec in specs:
            label = spec.kind.replace("_", " ") + (" residual" if getattr(spec, "residual", False) else "")
            lines.append(
                f"{f'{arch} {dtype} H={hidden} {label}':<{CONFIG_LABEL_WIDTH}}{describe_config(spec)}"
            )
    return lines


CONFIG_LABEL_WIDTH = 46  # "sm_100a fp16 H=262144 fwd mxfp8 persistent" and a gap


def cmd_info(args) -> int:
    """Versions, GPU, cache and (``--hidden``) configs; exit 2 when the cache path is not a directory."""
    import cutlass
    import torch
    import tvm_ffi

    from .. import __version__
    from ..runtime.cache import cache_dir, fingerprint

    conflict = cache_dir_conflict(cache_dir())
    rows = [
        ("cake_cute", __version__),
        ("nvidia-cutlass-dsl", f"{cutlass.__version__} (CUDA {_dsl_cuda_version(cutlass)})"),
        ("apache-tvm-ffi", getattr(tvm_ffi, "__version__", "?")),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("GPU", _gpu_line()),
        ("cache", f"{cache_dir()} (version {fingerprint()})"),
        ("cached kernels", "none: the cache path is not a directory" if conflict else _cache_contents()),
        ("cuobjdump", _cuobjdump_line()),
        ("native host path", _native_status()),
    ]
    for key, value in rows:
        print(f"{key:<20}{value}")
    if args.hidden:
        from .warmup import local_archs

        print("config per kernel (what it compiles with; w in the activation dtype):")
        print("\n".join(config_lines(args.arch or local_archs(), args.dtype, args.hidden)))
    if conflict:
        print(f"cake-cute info: {conflict}", file=sys.stderr)
        return EXIT_USAGE
    return 0
