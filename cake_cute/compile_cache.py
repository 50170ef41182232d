"""Compile once per kernel variant; keep it in memory and on disk.

A variant is a ``KernelSpec`` (kind, arch, dtypes, H, residual, weight offset). The number of rows is a
runtime value of every kernel, so a change of T never compiles. Compiled functions use TVM-FFI (torch
tensors are passed straight in, the launch costs microseconds) and are exported as object files to
``cache_dir()/fingerprint()/``.

How the disk cache holds up:

- **Versions.** The directory name ``fingerprint()`` hashes everything that could change the code or
  the file format: the kernel sources, this package's version, the DSL and TVM-FFI versions and
  ``CACHE_FORMAT``. A cache made by another version lives in another directory, is never matched and
  is never touched (nor deleted) by this one.
- **Integrity.** Every object ``X.o`` has a sidecar ``X.o.sha256`` with the sha256 of its bytes, written
  after the object; the sidecar is the commit mark. An object is loaded only when its bytes match (a
  corrupted or truncated object can crash the JIT linker instead of raising, so it must never reach
  it); one that does not match, has no sidecar or fails to load is deleted and rebuilt, with a warning.
  Both files are written to a temporary file and renamed into place, so a reader never sees half a
  file; after a power loss a file may be empty, which the checksum catches (hence no fsync).
- **Concurrency.** Per key, a thread lock (threads of one process) and an ``fcntl.flock`` on
  ``X.o.lock`` (other processes) guard "check the disk, compile, export": N threads or processes
  asking for one missing key compile it once, the others wait and load the result. A cache hit needs
  no lock at all (it works on a read-only cache too), and different keys never wait for each other,
  except that the compiles themselves run one at a time per process (the DSL's compiler is not
  documented to be thread-safe, and it holds the GIL anyway).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock; atomic renames still keep the files whole
    fcntl = None

from . import __version__

CACHE_FORMAT = 2  # bump when the on-disk layout changes (2: sha256 sidecars)

compile_count = 0  # kernels compiled by this process (tests count these)
_memory: dict[KernelSpec, Callable] = {}
_by_fields: dict[tuple, Callable] = {}
_lock = threading.Lock()  # guards _key_locks
_key_locks: dict[KernelSpec, threading.Lock] = {}
_compile_lock = threading.Lock()  # one DSL compile at a time in this process


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
    """Everything besides the spec that decides the compiled code or the cache's file format."""
    global _fingerprint
    if _fingerprint is None:
        import cutlass
        import tvm_ffi

        parts = [
            __version__,
            cutlass.__version__,
            getattr(tvm_ffi, "__version__", "?"),
            _kernel_source_hash(),
            f"format{CACHE_FORMAT}",
        ]
        _fingerprint = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return _fingerprint


def object_path(spec: KernelSpec) -> Path:
    key = hashlib.sha256(f"{fingerprint()}|{sorted(asdict(spec).items())}".encode()).hexdigest()[:24]
    return cache_dir() / fingerprint() / f"{spec.name()}-{key}.o"


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _problem(path: Path) -> str | None:
    """Why the object at ``path`` must not be loaded, or None when its bytes match its checksum
    (hashing ~40 KB costs microseconds)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "missing"
    try:
        recorded = _checksum_path(path).read_text().strip()
    except FileNotFoundError:
        return "has no checksum (an interrupted write)"
    if hashlib.sha256(data).hexdigest() != recorded:
        return "does not match its checksum (truncated or corrupted)"
    return None


def _load(path: Path, spec: KernelSpec) -> tuple[Callable | None, str | None]:
    """(function, None) for a sound object file, else (None, what is wrong with it)."""
    problem = _problem(path)
    if problem is not None:
        return None, problem
    import cutlass.cute as cute

    try:
        return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[spec.name()], None
    except Exception as exc:
        return None, f"failed to load ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"


def _write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """``write(temporary path)``, then rename it into place: readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache may be shared between users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_object(compiled, path: Path, spec: KernelSpec) -> None:
    """The object first, then its checksum: a checksum on disk always describes a complete object."""
    _write_atomic(path, lambda tmp: compiled.export_to_c(tmp, function_name=spec.name()))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _write_atomic(_checksum_path(path), lambda tmp: Path(tmp).write_text(digest + "\n"))


def _discard(path: Path) -> None:
    """Delete an unusable object and its checksum (called only under the key's file lock)."""
    _checksum_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on ``<object>.lock`` between processes. The lock file is left in place:
    deleting it would let a third process lock a new file while a second still holds the old one."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed, also if we crash
        yield


def _key_lock(spec: KernelSpec) -> threading.Lock:
    with _lock:
        return _key_locks.setdefault(spec, threading.Lock())


def _compile(spec: KernelSpec):
    global compile_count
    from .dispatch import compile_kernel

    with _compile_lock:
        compiled = compile_kernel(spec)
        compile_count += 1
    return compiled


def _from_disk_or_compile(spec: KernelSpec) -> Callable:
    path = object_path(spec)
    fn, _ = _load(path, spec)  # the common case, without a lock: a warm or read-only cache
    if fn is not None:
        return fn
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        fn, problem = _load(path, spec)  # another process may have written it while we waited
        if fn is not None:
            return fn
        if problem != "missing":
            warnings.warn(
                f"cake_cute: discarding cached kernel {path}: it {problem}; compiling it again",
                RuntimeWarning,
                stacklevel=3,
            )
        _discard(path)
        compiled = _compile(spec)
        _write_object(compiled, path, spec)
        # Load the exported object, so a warm process and a cold one run the same code path.
        fn, problem = _load(path, spec)
        if fn is None:
            warnings.warn(
                f"cake_cute: the kernel just cached at {path} {problem}; using it from memory",
                RuntimeWarning,
                stacklevel=3,
            )
            fn = compiled
        return fn


def get_kernel(spec: KernelSpec, *, use_disk: bool = True) -> Callable:
    """The compiled function for ``spec``: from memory, else from disk, else compiled (and saved)."""
    fn = _memory.get(spec)
    if fn is not None:
        return fn
    with _key_lock(spec):
        fn = _memory.get(spec)
        if fn is None:
            fn = _from_disk_or_compile(spec) if use_disk else _compile(spec)
            _memory[spec] = fn
        return fn


def kernel(*fields) -> Callable:
    """``get_kernel(KernelSpec(*fields))`` for the hot path: one dict lookup on the plain field tuple,
    without building and hashing a dataclass on every call."""
    fn = _by_fields.get(fields)
    if fn is None:
        fn = _by_fields[fields] = get_kernel(KernelSpec(*fields))
    return fn


def is_cached_on_disk(spec: KernelSpec) -> bool:
    """A sound object file (its checksum matches) is on disk for ``spec``."""
    return _problem(object_path(spec)) is None


def clear_memory() -> None:
    _memory.clear()
    _by_fields.clear()
