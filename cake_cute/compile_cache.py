"""Compile once per kernel variant; keep it in memory and on disk.

A variant is a ``KernelSpec`` (kind, arch, dtypes, H, residual, weight offset). The number of rows is a
runtime value of every kernel, so a change of T never compiles. Compiled functions use TVM-FFI (torch
tensors are passed straight in, the launch costs microseconds) and are exported as object files to
``cache_dir()`` under a name that hashes the spec with everything that could change the code: the
kernel sources, this package's version, the DSL and TVM-FFI versions. A stale or foreign file therefore
never matches; a file that fails to load is discarded and rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import __version__

KINDS = ("fwd", "bwd", "dw")

compile_count = 0  # kernels compiled by this process (tests count these)
_memory: dict["KernelSpec", Callable] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class KernelSpec:
    kind: str  # "fwd", "bwd" or "dw"
    arch: str  # "sm_90a", "sm_100a", "sm_103a"
    act_dtype: str  # "bf16", "fp16", "fp32" (for "dw": the output dtype)
    w_dtype: str
    hidden: int
    residual: bool = False
    weight_offset: float = 0.0

    def name(self) -> str:
        offset = f"_off{self.weight_offset:g}".replace(".", "p").replace("-", "m")
        res = "_res" if self.residual else ""
        return f"cake_{self.kind}_{self.arch}_{self.act_dtype}_w{self.w_dtype}_h{self.hidden}{res}{offset}"


def cache_dir() -> Path:
    root = os.environ.get("CAKE_CUTE_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cake_cute"


def _kernel_source_hash() -> str:
    from . import kernels

    digest = hashlib.sha256()
    kernel_dir = Path(kernels.__file__).resolve().parent
    sources = sorted(kernel_dir.glob("*.py")) + [Path(__file__).resolve().parent / "dispatch.py"]
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_fingerprint: str | None = None


def fingerprint() -> str:
    """Everything besides the spec that decides the compiled code."""
    global _fingerprint
    if _fingerprint is None:
        import cutlass
        import tvm_ffi

        parts = [__version__, cutlass.__version__, getattr(tvm_ffi, "__version__", "?"), _kernel_source_hash()]
        _fingerprint = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return _fingerprint


def object_path(spec: KernelSpec) -> Path:
    key = hashlib.sha256(f"{fingerprint()}|{sorted(asdict(spec).items())}".encode()).hexdigest()[:24]
    return cache_dir() / fingerprint() / f"{spec.name()}-{key}.o"


def _load_object(path: Path, spec: KernelSpec) -> Callable | None:
    import cutlass.cute as cute

    try:
        return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[spec.name()]
    except Exception:  # a truncated, corrupted or foreign file: rebuild it
        return None


def _write_object(compiled, path: Path, spec: KernelSpec) -> None:
    """Export to a temporary file and rename it into place: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".o.tmp")
    os.close(fd)
    try:
        compiled.export_to_c(tmp, function_name=spec.name())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile(spec: KernelSpec):
    global compile_count
    from .dispatch import compile_kernel

    compiled = compile_kernel(spec)
    compile_count += 1
    return compiled


def get_kernel(spec: KernelSpec, *, use_disk: bool = True) -> Callable:
    """The compiled function for ``spec``: from memory, else from disk, else compiled (and saved)."""
    fn = _memory.get(spec)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(spec)
        if fn is not None:
            return fn
        path = object_path(spec)
        if use_disk and path.exists():
            fn = _load_object(path, spec)
            if fn is None:
                path.unlink(missing_ok=True)
        if fn is None:
            compiled = _compile(spec)
            fn = compiled
            if use_disk:
                _write_object(compiled, path, spec)
                # Load the exported object, so a warm process and a cold one run the same code path.
                fn = _load_object(path, spec) or compiled
        _memory[spec] = fn
        return fn


def is_cached_on_disk(spec: KernelSpec) -> bool:
    return object_path(spec).exists()


def clear_memory() -> None:
    _memory.clear()
