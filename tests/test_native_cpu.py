"""The native host path without a GPU: it builds and loads here, a failed build falls back to the Python
path with one one-line warning, ``CAKE_CUTE_PYTHON_PATH=1`` builds nothing, and its routing hands every
call it must not serve (CPU tensors, unregistered signatures, bad arguments) back to the Python path.
What it launches is compared bit for bit with the Python path on a GPU (tests/test_gpu_native.py)."""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch
import tvm_ffi

import cake_cute
from cake_cute.runtime import native


@pytest.fixture
def fresh_native(monkeypatch):
    """The loader as in a new process (not tried yet, nothing registered); restored afterwards."""
    monkeypatch.setattr(native, "extension", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_looked_for_library", False)
    monkeypatch.setattr(native, "_registered", set())
    monkeypatch.setattr(native, "_handed_eps", set())
    monkeypatch.delenv(native.PYTHON_PATH_ENV, raising=False)


@pytest.fixture(scope="module")
def module():
    """The extension, built here (CI builds it with this test) and loaded."""
    return native._import(native.build())


def test_extension_builds_and_loads(module):
    assert native.library_path().exists()
    assert {"rmsnorm", "forward", "backward", "register", "clear"} <= set(dir(module))
    assert module.signature_count() >= 0


def test_loading_installs_the_op_kernels(fresh_native):
    """The custom ops' CUDA and AutogradCUDA kernels come from the extension once it is loaded (what they
    compute is compared with the ops' Python bodies on a GPU); other devices keep the Python ones."""
    assert native.load() is not None
    for op, keys in (
        ("rmsnorm_fwd", ("CUDA", "AutogradCUDA")),
        ("rmsnorm_bwd", ("CUDA",)),
        ("rmsnorm_bwd_parts", ("CUDA",)),
        ("rmsnorm_fp8_fwd", ("CUDA", "AutogradCUDA")),
    ):
        table = dict(
            line.split(": ", 1)
            for line in torch._C._dispatch_dump(f"cake_cute::{op}").splitlines()
            if ": registered at" in line
        )
        for key in keys:
            assert "csrc/op_kernels.cpp" in table[key], (op, key, table[key])
        assert "library_ops.py" in table["CompositeExplicitAutograd[alias]"]


@pytest.mark.parametrize("compiler", ["/nonexistent/c++", "false"], ids=["no-compiler", "build-fails"])
def test_failed_build_warns_once_on_one_line(compiler, fresh_native, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.load() is None
        assert native.load() is None
        y = cake_cute.cake_rmsnorm(torch.randn(3, 8), torch.ones(8))  # the Python path serves
    messages = [str(w.message) for w in caught if "native host path" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert "take the Python path" in messages[0]
    assert y.shape == (3, 8) and native.extension is None


def test_python_path_switch_builds_nothing(fresh_native, monkeypatch):
    monkeypatch.setenv(native.PYTHON_PATH_ENV, "1")
    monkeypatch.setattr(native, "build", lambda: pytest.fail("CAKE_CUTE_PYTHON_PATH=1 must not build"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load() is None
    assert native.python_path_forced()


def _registered_cpu_signature(module, x, w, offset=0.0):
    """Register (x, w, offset) with a stand-in handle: the routing must refuse CPU tensors before any
    launch, so the handle is never called."""
    stand_in = tvm_ffi.convert(lambda *args: pytest.fail("a refused call reached a kernel"))
    module.register(x, w, offset, False, stand_in.__chandle__(), 2, 2, lambda *a: pytest.fail("planned"))
    return stand_in


def test_routing_refuses_what_it_must_not_serve(module, monkeypatch):
    x, w, g = torch.randn(4, 8), torch.ones(8), torch.randn(4, 8)
    rstd = torch.ones(4)
    _keep = _registered_cpu_signature(module, x, w)
    assert module.signature_count() >= 1
    # CPU tensors (registered or not), None, numbers and odd arguments: None, i.e. the Python path.
    assert module.rmsnorm(x, w, 1e-6, None, 0.0) is None
    assert module.rmsnorm(x, w, 1e-6, x, 0.0) is None
    assert module.rmsnorm(None, w, 1e-6, None, 0.0) is None
    assert module.rmsnorm(x, w, "1e-6", None, 0.0) is None
    assert module.rmsnorm(x, w, 1e-6, None, "0") is None
    assert module.forward(x, w, 1e-6, None, 0.0) is None
    assert module.backward(g, x, w, rstd, None, 0.0, torch.float32) is None
    assert module.backward(g, x, w, rstd, None, 0.0, torch.int32) is None
    with pytest.raises(TypeError, match="rmsnorm takes 5 arguments"):
        module.rmsnorm(x, w)
    with pytest.raises(TypeError, match="register needs tensors"):
        module.register(1, w, 0.0, False, 1, 2, 2, print)
    monkeypatch.setattr(native, "extension", module)
    native.clear()  # as after a config override: both sides forget every signature
    assert module.signature_count() == 0 and not native._registered


def test_fp8_registration_checks_its_arguments(module):
    """register_fp8 adds a signature (or a kernel to one: one-tile or persistent); it refuses an unknown
    recipe, a missing handle."""
    x, w = torch.randn(4, 32), torch.ones(32)
    stand_in = tvm_ffi.convert(lambda *args: pytest.fail("registering must not call the kernel"))
    handle = stand_in.__chandle__()
    planner = lambda *args: pytest.fail("planned")  # noqa: E731
    before = module.signature_count()
    module.register_fp8(x, w, 0.625, True, "1x128", True, False, 0, 2048, handle, 2, 2, planner)
    assert module.signature_count() == before + 1
    module.register_fp8(x, w, 0.625, False, "mxfp8", False, True, 528, 2048, handle, 2, 2, planner)
    assert module.signature_count() == before + 1  # the same signature, another of its kernels
    with pytest.raises(ValueError, match="unknown recipe nvfp4"):
        module.register_fp8(x, w, 0.625, False, "nvfp4", False, False, 0, 2048, handle, 2, 2, planner)
    with pytest.raises(TypeError, match="register needs tensors"):
        module.register_fp8(x, w, 0.625, False, "mxfp8", False, False, 0, 2048, 0, 2, 2, planner)


def test_eager_fp8_calls_on_cpu_take_the_op_with_the_extension_loaded(module, monkeypatch):
    """CPU tensors take the op by the routing rule (its CPU body, the reference), never the C++ kernels."""
    monkeypatch.setattr(native, "extension", module)
    x, w = torch.randn(5, 64, requires_grad=True), torch.rand(64, requires_grad=True)
    out = cake_cute.cake_rmsnorm_fp8(x, w, 1e-6)
    assert "rmsnorm_fp8_fwd" in out.y.grad_fn.name()


def test_cpu_calls_keep_the_op_path_with_the_extension_loaded(module, fresh_native, monkeypatch):
    """A CPU call takes the custom op (its CPU kernel and registered autograd), not the C++ node."""
    monkeypatch.setattr(native, "extension", module)
    x, w = torch.randn(5, 16, requires_grad=True), torch.rand(16, requires_grad=True)
    y = cake_cute.cake_rmsnorm(x, w, 1e-6)
    assert "cake_cute_rmsnorm_fwd" in y.grad_fn.name()
    with pytest.raises(ValueError, match="eps"):
        cake_cute.cake_rmsnorm(x, w, -1.0)


# --- the argument conventions csrc/launch.cpp launches with, against the compiled kernels' own checks -----


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", ctypes.c_int32 * 2),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_uint8 * 2),  # DLDataType: code, bits, then lanes
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Any(ctypes.Structure):
    _fields_ = [("type_index", ctypes.c_int32), ("padding", ctypes.c_uint32), ("value", ctypes.c_int64)]


# kDLBfloat, kDLFloat, kDLUInt (the e4m3 data and E8M0 scales, passed as bytes)
_DL_CODES = {torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.float32: (2, 32), torch.uint8: (1, 8)}


def _tensor(keep, dtype, shape, strides):
    """A DLTensor on CUDA device 0 at a fake aligned address, passed as kTVMFFIDLTensorPtr (7)."""
    dims = (ctypes.c_int64 * len(shape))(*shape)
    steps = (ctypes.c_int64 * len(shape))(*strides)
    dl = _DLTensor(1 << 20, (2, 0), len(shape), (ctypes.c_uint8 * 2)(*_DL_CODES[dtype]), 1, dims, steps, 0)
    keep.append((dims, steps, dl))
    return _Any(7, 0, ctypes.addressof(dl))


def _call(kernel, args) -> str:
    """Call a compiled kernel through TVMFFIFunctionCall; its error as 'kind: message' ('' for none)."""
    import tvm_ffi.libinfo

    lib = ctypes.CDLL(tvm_ffi.libinfo.find_libtvm_ffi())
    result = _Any(0, 0, 0)
    packed = (_Any * len(args))(*args)
    if (
        lib.TVMFFIFunctionCall(ctypes.c_void_p(kernel.__chandle__()), packed, len(args), ctypes.byref(result))
        == 0
    ):
        return ""
    error = ctypes.c_void_p()
    lib.TVMFFIErrorMoveFromRaised(ctypes.byref(error))
    kind_ptr, kind_len, msg_ptr, msg_len = (ctypes.c_uint64 * 4).from_address(
        error.value + 24
    )  # after the header
    text = f"{ctypes.string_at(kind_ptr, kind_len).decode()}: {ctypes.string_at(msg_ptr, msg_len).decode()}"
    lib.TVMFFIObjectDecRef(error)
    return text


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake device addresses must never reach a GPU")
@pytest.mark.parametrize("hidden", [4096, 1001])
def test_kernels_accept_the_native_argument_conventions(hidden):
    """csrc/launch.cpp passes (rows, H) tensors with explicit strides as DLTensor pointers, None for an unused
    residual (or y), eps as a float, the program count as an int, g's other summands after it, and the
    FP8 forward's e4m3 data and E8M0 scales as bytes (the persistent one's program count after eps).
    Called that way, each compiled kernel gets past all its argument checks to the launch, which fails
    here for want of a GPU; a wrong H is refused as an argument error (the control)."""
    from cake_cute.runtime.build import quant_kind
    from cake_cute.runtime.cache import get_kernel
    from cake_cute.runtime.specs import KernelSpec, ReduceSpec

    bf16, f32, rows, padded = torch.bfloat16, torch.float32, 16, -(-hidden // 4) * 4
    none, keep = _Any(0, 0, 0), []

    def act(h=hidden):
        return _tensor(keep, bf16, (rows, h), (h, 1))

    def vec(dtype, n):
        return _tensor(keep, dtype, (n,), (1,))

    eps = _Any(3, 0, ctypes.c_int64.from_buffer_copy(ctypes.c_double(1e-6)).value)
    partials = _tensor(keep, f32, (8, hidden), (padded, 1))
    variant = ("sm_90a", "bf16", "bf16", hidden)
    forward = get_kernel(KernelSpec("fwd", *variant))
    backward = get_kernel(KernelSpec("bwd", *variant, residual=True))
    backward_parts = get_kernel(KernelSpec("bwd", *variant, residual=True, g_parts=3))
    reduce = get_kernel(ReduceSpec("sm_90a", "bf16", hidden))
    mxfp8 = get_kernel(KernelSpec(quant_kind("mxfp8", False), *variant))
    mxfp8_persistent = get_kernel(KernelSpec(quant_kind("mxfp8", False, True), *variant))
    blockwise_y = get_kernel(KernelSpec(quant_kind("1x128", True), *variant, residual=True))
    data = _tensor(keep, torch.uint8, (rows, hidden), (hidden, 1))

    def scales(dtype, block):
        blocks = -(-hidden // block)
        return _tensor(keep, dtype, (rows, blocks), (blocks, 1))

    calls = {
        "forward": (forward, [act(), none, vec(bf16, hidden), act(), none, vec(f32, rows), eps]),
        "backward": (
            backward,
            [act(), act(), vec(bf16, hidden), vec(f32, rows), act(), act(), partials, _Any(1, 0, 8)],
        ),
        "backward of 3 summands": (
            backward_parts,
            [
                act(),
                act(),
                vec(bf16, hidden),
                vec(f32, rows),
                act(),
                act(),
                partials,
                _Any(1, 0, 8),
                act(),
                act(),
            ],
        ),
        "dW reduction": (reduce, [partials, vec(bf16, hidden)]),
        "MXFP8 forward": (
            mxfp8,
            [act(), none, vec(bf16, hidden), none, none, vec(f32, rows), data, scales(torch.uint8, 32), eps],
        ),
        "persistent MXFP8 forward": (
            mxfp8_persistent,
            [
                act(),
                none,
                vec(bf16, hidden),
                none,
                none,
                vec(f32, rows),
                data,
                scales(torch.uint8, 32),
                eps,
                _Any(1, 0, 528),
            ],
        ),
        "1x128 forward with y and h_new": (
            blockwise_y,
            [act(), act(), vec(bf16, hidden), act(), act(), vec(f32, rows), data, scales(f32, 128), eps],
        ),
    }
    for name, (fn, args) in calls.items():
        error = _call(fn, args)
        assert error.startswith("RuntimeError") and "Cuda" in error, f"{name}: {error}"
    wrong_h = [act(hidden + 8), none, vec(bf16, hidden), act(), none, vec(f32, rows), eps]
    assert _call(forward, wrong_h).startswith("ValueError: Mismatched")


def test_a_call_never_builds_the_extension(fresh_native, monkeypatch, tmp_path):
    """``native.load_built`` (what a call in a step uses) loads only a library already on disk: with none
    there it answers None and builds nothing; ``cake_cute.prepare()`` is where the build happens."""
    monkeypatch.setattr(native, "_looked_for_library", False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "build", lambda: pytest.fail("a call must not build the extension"))
    assert native.load_built() is None
    assert native.load_built() is None  # looked once
    assert not native._tried  # an explicit prepare() may still build and load it
