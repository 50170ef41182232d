"""Compile once per kernel variant; keep it in memory and on disk.

The key is a spec and the config its kernel is built from. The number of rows is a runtime value of
every kernel, so a change of T never compiles. Compiled functions use TVM-FFI and are exported as
object files to ``cache_dir()/fingerprint()/``.

- **Versions.** ``fingerprint()`` hashes what the compiled code depends on: the code of the modules
  the kernels are built from, docstrings and comments stripped (``code_of``), the Python, DSL and
  TVM-FFI versions and ``CACHE_FORMAT``. Modules are named by dotted name, so an editable install and
  a wheel of one commit share a cache; another version's directory is never matched nor touched.
- **Integrity.** Every object has a sidecar with the sha256 of its bytes, written after it (the commit
  mark). An object is loaded only when its bytes match, since a corrupted object can crash the JIT
  linker instead of raising; otherwise it is deleted and rebuilt, with a warning. Files are written
  to a temporary name and renamed, and the checksum catches a file emptied by a power loss.
- **Concurrency.** Per key, a thread lock and a file lock (given up after ``LOCK_TIMEOUT_S`` with an
  error naming the file) guard "check the disk, compile, export", so one missing key compiles once.
  A cache hit takes no lock (a read-only cache works); compiles run one at a time per process, as the
  DSL's compiler is not documented to be thread-safe.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import filelock

from ..kernels.config import on_override_change
from . import build
from .specs import KernelSpec, ReduceSpec

CACHE_FORMAT = 3  # bump when the on-disk layout changes (2: sha256 sidecars, 3: the config in the key)
LOCK_TIMEOUT_S = 600  # far above any one compile: a longer wait means a stuck process holds the lock

compile_count = 0  # kernels compiled by this process (tests count these)
_memory: dict = {}  # spec -> compiled function
_lock = threading.Lock()  # guards _key_locks
_key_locks: dict = {}
_compile_lock = threading.Lock()  # one DSL compile at a time in this process

Spec = KernelSpec | ReduceSpec


def cache_dir() -> Path:
    root = os.environ.get("CAKE_CUTE_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cake_cute"


def _package_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of ``cake_cute`` by dotted name: (its file, whether it is a package)."""
    root = Path(__file__).resolve().parents[1]  # the package, from runtime/
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(("cake_cute", *parts[: -1 if is_package else None]))] = (path.resolve(), is_package)
    return modules


def _imported_names(module: str, is_package: bool, tree: ast.Module) -> set[str]:
    """The absolute dotted names an import anywhere in ``tree`` may load."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if node.module:  # ``from . import x`` loads x; the package's own code is not what it is after
                names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def build_sources() -> dict[str, str]:
    """The source of every module the compiled code is made from: the kernels and ``runtime.build`` with
    what they import, directly or not; editing other modules recompiles nothing."""
    modules = _package_modules()
    pending = [
        name for name in modules if name == "cake_cute.runtime.build" or name.startswith("cake_cute.kernels")
    ]
    sources: dict[str, str] = {}
    while pending:
        name = pending.pop()
        if name in sources:
            continue
        path, is_package = modules[name]
        sources[name] = path.read_text()
        imported = _imported_names(name, is_package, ast.parse(sources[name]))
        pending += [other for other in imported if other in modules and other not in sources]
    return dict(sorted(sources.items()))


def _is_bare_constant(statement: ast.stmt) -> bool:
    """A statement that is only a constant (a docstring, a string used as a comment): it does nothing."""
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def code_of(source: str) -> str:
    """What of a module's source can change compiled code: its syntax tree without docstrings or lines."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body:
                kept = [statement for statement in body if not _is_bare_constant(statement)]
                setattr(node, field, kept or [ast.Pass()])
    return ast.dump(tree)


def source_digest(sources: dict[str, str]) -> str:
    """A hash of the code (``code_of``) of ``{module name: source text}``, in sorted order of name."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + hashlib.sha256(code_of(sources[name]).encode()).digest())
    return digest.hexdigest()


_fingerprint: str | None = None


def fingerprint() -> str:
    """What besides the spec and config decides the compiled code or the cache's file format."""
    global _fingerprint
    if _fingerprint is None:
        import cutlass
        import tvm_ffi

        parts = [
            f"python{sys.version_info.major}.{sys.version_info.minor}",
            cutlass.__version__,
            getattr(tvm_ffi, "__version__", "?"),
            source_digest(build_sources()),
            f"format{CACHE_FORMAT}",
        ]
        _fingerprint = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return _fingerprint


def object_path(spec: Spec) -> Path:
    """Where ``spec``'s object lives, keyed by the spec, its config and the fingerprint."""
    key = f"{fingerprint()}|{spec!r}|{build.config_for(spec)!r}"
    key = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / fingerprint() / f"{spec.name()}-{key}.o"


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _problem(path: Path) -> str | None:
    """Why the object at ``path`` must not be loaded, or None when its bytes match its checksum."""
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


def _load(path: Path, spec: Spec) -> tuple[Callable | None, str | None]:
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


def _write_object(compiled, path: Path, spec: Spec) -> None:
    """The object first, then its checksum: a checksum on disk always describes a complete object."""
    _write_atomic(path, lambda tmp: compiled.export_to_c(tmp, function_name=spec.name()))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _write_atomic(_checksum_path(path), lambda tmp: Path(tmp).write_text(digest + "\n"))


def _discard(path: Path) -> None:
    """Delete an unusable object and its checksum (called only under the key's file lock)."""
    _checksum_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _file_lock(path: Path) -> filelock.BaseFileLock:
    """Exclusive lock on ``<object>.lock`` between processes (released by the OS if the holder crashes)."""
    return filelock.FileLock(path.with_name(path.name + ".lock"), timeout=LOCK_TIMEOUT_S)


def _key_lock(spec: Spec) -> threading.Lock:
    with _lock:
        return _key_locks.setdefault(spec, threading.Lock())


def _compile(spec: Spec):
    global compile_count
    with _compile_lock:
        compiled = build.compile_kernel(spec)
        compile_count += 1
    return compiled


def _from_disk_or_compile(spec: Spec) -> tuple[Callable, str]:
    path = object_path(spec)
    fn, _ = _load(path, spec)  # the common case, without a lock: a warm or read-only cache
    if fn is not None:
        return fn, "disk"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _file_lock(path):
            return _compile_under_lock(path, spec)
    except filelock.Timeout as err:
        raise RuntimeError(
            f"cake_cute: waited {LOCK_TIMEOUT_S} s for the compile lock {err.lock_file}: another process "
            "holds it (a compile that hangs, or a stopped process); delete the lock file if no "
            "cake_cute process is running"
        ) from err


def _compile_under_lock(path: Path, spec: Spec) -> tuple[Callable, str]:
    fn, problem = _load(path, spec)  # another process may have written it while we waited
    if fn is not None:
        return fn, "disk after waiting"
    if problem != "missing":
        warnings.warn(
            f"cake_cute: discarding cached kernel {path}: it {problem}; compiling it again",
            RuntimeWarning,
            stacklevel=5,
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
            stacklevel=5,
        )
        fn = compiled
    return fn, "compiled"


def get_kernel_and_source(spec: Spec) -> tuple[Callable, str]:
    """The compiled function for ``spec`` and where this call found it."""
    fn = _memory.get(spec)
    if fn is not None:
        return fn, "memory"
    with _key_lock(spec):
        fn = _memory.get(spec)
        if fn is not None:  # another thread of this process got it while this one waited
            return fn, "memory"
        fn, source = _from_disk_or_compile(spec)
        _memory[spec] = fn
        return fn, source


def get_kernel(spec: Spec) -> Callable:
    """The compiled function for ``spec``: from memory, else from disk, else compiled (and saved)."""
    fn = _memory.get(spec)
    return fn if fn is not None else get_kernel_and_source(spec)[0]


def is_cached_on_disk(spec: Spec) -> bool:
    """A sound object file (its checksum matches) is on disk for ``spec``."""
    return _problem(object_path(spec)) is None


@on_override_change
def clear_memory() -> None:
    _memory.clear()
