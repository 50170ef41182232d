"""The native host path: ``csrc/`` built and loaded, and the signatures the Python path hands it.

A Python ``autograd.Function`` costs the host more than the step it wraps; the extension is a C++
autograd node (and functional forward / backward, and the custom ops' CUDA kernels) launching the same
compiled kernels through TVM-FFI's C ABI. The Python path stays the authority: once it has validated
and launched a signature it registers it, and later calls of that signature in the plain layout run in
C++; every other call keeps the Python path, where the named errors are raised.

The extension is built once per (source, torch, TVM-FFI, Python), without CUDA headers, and only
outside a training step (``cake-cute warmup``, ``cake_cute.prepare()``); a call inside a step only
loads a library already built. A failed build warns once and leaves the Python path;
``CAKE_CUTE_PYTHON_PATH=1`` chooses it without building.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from functools import partial
from pathlib import Path

import torch

from ..kernels.config import on_override_change
from . import launch_plan
from .cache import _file_lock, _write_atomic
from .views import vector_align_bytes

PYTHON_PATH_ENV = "CAKE_CUTE_PYTHON_PATH"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# The translation units, compiled together into one extension; the build hash covers every file of
# ``SOURCE_DIR`` (the shared header ``native.h`` too).
CPP_SOURCES = tuple(sorted(SOURCE_DIR.glob("*.cpp")))
MODULE_NAME = "cake_cute_native"  # the name the source's PyInit_ function carries

extension = None  # the loaded extension module, or None while calls take the Python path
_tried = False
_registered: set = set()


def python_path_forced() -> bool:
    """``CAKE_CUTE_PYTHON_PATH=1``: every call takes the Python path."""
    return os.environ.get(PYTHON_PATH_ENV) == "1"


def _toolchain() -> tuple[str, list[str], list[str]]:
    """(compiler, compile flags, link flags) for this torch (its C++ ABI flag) and TVM-FFI."""
    import tvm_ffi.libinfo
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; set $CXX)")
    tvm_lib = str(Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent)
    includes = [
        tvm_ffi.libinfo.find_include_path(),
        *cpp_extension.include_paths(),
        sysconfig.get_paths()["include"],
    ]
    libraries = [*cpp_extension.library_paths(), tvm_lib]
    compile_flags = [
        "-O2",
        "-std=c++20",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in includes),
    ]
    link_flags = [
        *(f"-L{path}" for path in libraries),
        *(f"-Wl,-rpath,{path}" for path in libraries),
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        "-ltvm_ffi",
    ]
    return compiler, compile_flags, link_flags


def library_path() -> Path:
    """Where the extension for these sources, torch, TVM-FFI and Python lives, built or not."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    compiler, compile_flags, link_flags = _toolchain()
    for part in (
        torch.__version__,
        torch.version.git_version,
        sys.version,
        compiler,
        *compile_flags,
        *link_flags,
    ):
        digest.update(part.encode() + b"\0")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"{MODULE_NAME}-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Build the extension unless it is on disk already (other processes wait for one build).

    Returns
    -------
    Path
        The shared library.

    Raises
    ------
    RuntimeError
        No C++ compiler, or the build failed (the compiler's output is in ``<library>.log``).
    """
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        if not path.exists():
            _write_atomic(path, _compile)
    return path


def _compile(output: str) -> None:
    """Compile each source to an object in parallel, then link them into ``output``."""
    compiler, compile_flags, link_flags = _toolchain()
    objects = [f"{output}.{source.stem}.o" for source in CPP_SOURCES]
    log = Path(output).with_name(library_path().name + ".log")
    try:
        compiles = [
            subprocess.Popen(
                [compiler, *compile_flags, "-c", str(source), "-o", obj],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for source, obj in zip(CPP_SOURCES, objects)
        ]
        messages = [job.communicate()[0] for job in compiles]
        failed = next((job.returncode for job in compiles if job.returncode != 0), 0)
        if not failed:
            link = subprocess.run(
                [compiler, "-shared", *objects, "-o", output, *link_flags], capture_output=True, text=True
            )
            messages.append(link.stdout + link.stderr)
            failed = link.returncode
        log.write_text("".join(messages))
    finally:
        for obj in objects:
            Path(obj).unlink(missing_ok=True)
    if failed:
        raise RuntimeError(f"the C++ build failed (exit {failed}; compiler output in {log})")


def _import(path: Path):
    import tvm_ffi  # noqa: F401  (its libtvm_ffi first: the kernels and the extension share that one)

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The extension, built if needed and loaded; None when calls take the Python path (warned once)."""
    global extension, _tried
    if not _tried:
        _tried = True
        if not python_path_forced():
            try:
                extension = _import(build())
                _install_op_kernels(extension)
            except Exception as err:  # no compiler, a failed build or load: the Python path serves
                reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
                warnings.warn(
                    f"cake_cute: native host path unavailable, eager calls take the Python path ({reason})",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return extension


_looked_for_library = False


def load_built():
    """``load`` only when the library is already on disk: what a call inside a training step uses."""
    global _looked_for_library
    if extension is not None or _tried or _looked_for_library:
        return extension
    _looked_for_library = True
    try:
        built = not python_path_forced() and library_path().exists()
    except RuntimeError:  # no C++ compiler: nothing can have been built for it
        built = False
    return load() if built else None


_op_bodies: tuple | None = None  # the custom ops' Python bodies (``library_ops`` hands them over)


def provide_op_bodies(
    forward_body, backward_body, backward_parts_body, fp8_forward_body, differentiable_backward
) -> None:
    """Take the ops' Python bodies and the differentiable backward, which the C++ kernels call for what
    they do not serve; installs the kernels if the extension is loaded."""
    global _op_bodies
    _op_bodies = (forward_body, backward_body, backward_parts_body, fp8_forward_body, differentiable_backward)
    if extension is not None:
        _install_op_kernels(extension)


def _install_op_kernels(module) -> None:
    """The custom ops' C++ kernels for CUDA tensors (see ``csrc/``), once the ops exist."""
    if _op_bodies is not None:
        module.install_op_kernels(*_op_bodies)


def register(operands, x, w, weight_offset: float, residual: bool, forward_kernel, plan_backward) -> None:
    """Hand a signature the Python path has just validated and launched to the extension, with
    ``plan_backward``, which it asks for the backward's kernels and plan once per shape."""

    def send(module, handle, act_align, w_align, planner):
        module.register(x, w, weight_offset, residual, handle, act_align, w_align, planner)

    _hand_over((residual,), operands, x, w, weight_offset, forward_kernel, plan_backward, send)


def register_fp8(
    operands,
    x,
    w,
    weight_offset: float,
    residual: bool,
    recipe: str,
    emit_y: bool,
    programs: int,
    kernel,
    plan_backward,
) -> None:
    """``register`` for the forward to FP8 of ``recipe`` and ``emit_y``, with the launch rule that picks
    ``kernel`` by row count."""
    persistent = programs > 0

    def send(module, handle, act_align, w_align, planner):
        most_rows, most_programs = launch_plan.fp8_forward_rule(
            operands.hidden, operands.act, residual, operands.facts
        )
        fields = (x, w, weight_offset, residual, recipe, emit_y, persistent, most_programs, most_rows)
        module.register_fp8(*fields, handle, act_align, w_align, planner)

    _hand_over(
        (residual, recipe, emit_y, persistent), operands, x, w, weight_offset, kernel, plan_backward, send
    )


def _hand_over(variant: tuple, operands, x, w, weight_offset: float, kernel, plan_backward, send) -> None:
    """``send`` once per (signature, ``variant``) when the extension is loaded and ``kernel`` has a handle."""
    module = load_built()
    key = (operands, weight_offset, *variant)
    if module is None or key in _registered:
        return
    handle = kernel_handle(kernel)
    if handle == 0:
        return
    vec = launch_plan.vector_elems(operands.hidden, operands.act)
    act_align, w_align = vec * x.element_size(), vector_align_bytes(vec, w.element_size())
    send(module, handle, act_align, w_align, partial(plan_backward, operands, weight_offset))
    _registered.add(key)


_handed_eps: set[float] = set()


def accept_eps(eps: float) -> None:
    """Hand the extension an eps the Python path validated; it declines others, so the rule stays in
    Python."""
    if eps not in _handed_eps and load_built() is not None:
        extension.accept_eps(eps)
        _handed_eps.add(eps)


def handed_over(operands, weight_offset: float, *variant) -> bool:
    """Whether the signature with ``variant`` is already registered with the extension."""
    return (operands, weight_offset, *variant) in _registered


def kernel_handle(kernel) -> int:
    """The TVM-FFI function handle of a compiled kernel (what the extension calls), 0 for none."""
    return getattr(kernel, "__chandle__", lambda: 0)()


@on_override_change
def clear() -> None:
    """Forget every registered signature (a config override changes the kernels)."""
    _registered.clear()
    if extension is not None:
        extension.clear()
