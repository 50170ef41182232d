"""The native host path without a GPU: it builds and loads here, a failed build falls back to the Python
path with one one-line warning, ``CAKE_CUTE_PYTHON_PATH=1`` builds nothing, and its routing hands every
call it must not serve (CPU tensors, unregistered signatures, bad arguments) back to the Python path.
What it launches is compared bit for bit with the Python path on a GPU (tests/test_gpu_native.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import tvm_ffi

import cake_cute
from cake_cute import native


@pytest.fixture
def fresh_native(monkeypatch):
    """The loader as in a new process (not tried yet, nothing registered); restored afterwards."""
    monkeypatch.setattr(native, "fast", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_registered", set())
    monkeypatch.delenv(native.PYTHON_PATH_ENV, raising=False)


@pytest.fixture(scope="module")
def module():
    """The extension, built here (CI builds it with this test) and loaded."""
    return native._import(native.build())


def test_extension_builds_and_loads(module):
    assert native.library_path().exists()
    assert {"rmsnorm", "forward", "backward", "register", "clear"} <= set(dir(module))
    assert module.signature_count() >= 0


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
    assert y.shape == (3, 8) and native.fast is None


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


def test_routing_refuses_what_it_must_not_serve(module):
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
    assert module.backward(g, x, w, rstd, None, 0.0, torch.float32, True) is None
    assert module.backward(g, x, w, rstd, None, 0.0, torch.int32, True) is None
    assert module.backward(g, x, w, rstd, None, 0.0, torch.float32, 1) is None
    with pytest.raises(TypeError, match="rmsnorm takes 5 arguments"):
        module.rmsnorm(x, w)
    with pytest.raises(TypeError, match="register needs tensors"):
        module.register(1, w, 0.0, False, 1, 2, 2, print)
    module.clear()
    assert module.signature_count() == 0


def test_cpu_calls_keep_the_python_path_with_the_extension_loaded(module, fresh_native, monkeypatch):
    monkeypatch.setattr(native, "fast", module)
    x, w = torch.randn(5, 16, requires_grad=True), torch.rand(16, requires_grad=True)
    y = cake_cute.cake_rmsnorm(x, w, 1e-6)
    assert "CakeRMSNormFunction" in y.grad_fn.name()
    with pytest.raises(ValueError, match="eps"):
        cake_cute.cake_rmsnorm(x, w, -1.0)
