"""The routing rule (``cake_cute.routing``): one answer for every entry, non-tensor arguments refused with
a named ``TypeError`` before anything runs, and ``CakeRMSNormFunction.apply`` routed as ``cake_rmsnorm``
(the C++ node where the rule says ``NATIVE``; traced by torch.compile without graph breaks)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo

import cake_cute
from cake_cute import CakeRMSNorm, autograd, casts, routing
from cake_cute.reference import forward_reference
from cake_cute.runtime import native

EPS = 1e-6
H = 32


def _tensors(residual=False, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, H, generator=gen, requires_grad=requires_grad)
    w = torch.rand(H, generator=gen).add_(0.5).requires_grad_(requires_grad)
    r = torch.randn(3, H, generator=gen, requires_grad=requires_grad) if residual else None
    return x, w, r


NOT_TENSORS = [None, [1.0, 2.0], "x"]


def _entries():
    """(label, call(x, w, residual)) for every public entry that takes x, w and residual."""
    return [
        ("cake_rmsnorm", lambda x, w, r: cake_cute.cake_rmsnorm(x, w, EPS, r)),
        ("apply", lambda x, w, r: cake_cute.CakeRMSNormFunction.apply(x, w, EPS, r, True)),
        ("cake_rmsnorm_fp8", lambda x, w, r: cake_cute.cake_rmsnorm_fp8(x, w, EPS, r)),
        ("train_forward", lambda x, w, r: cake_cute.cake_rmsnorm_train_forward(x, w, EPS, residual=r)),
    ]


# None is a valid residual (plain mode).
BAD_ARGUMENTS = [(a, v) for a in ("x", "w", "residual") for v in NOT_TENSORS if (a, v) != ("residual", None)]


@pytest.mark.parametrize("entry", [e[0] for e in _entries()])
@pytest.mark.parametrize(
    "argument, value", BAD_ARGUMENTS, ids=[f"{a}-{type(v).__name__}" for a, v in BAD_ARGUMENTS]
)
def test_non_tensor_arguments_raise_a_named_type_error(entry, argument, value):
    call = dict(_entries())[entry]
    x, w, r = _tensors(residual=True)
    args = {"x": x, "w": w, "residual": r, argument: value}
    with pytest.raises(TypeError, match=rf"^{argument} must be a torch\.Tensor, got {type(value).__name__}"):
        call(args["x"], args["w"], args["residual"])


@pytest.mark.parametrize("argument", ["g", "x", "w", "rstd"])
@pytest.mark.parametrize("value", NOT_TENSORS, ids=["None", "list", "str"])
def test_the_functional_backward_names_a_non_tensor_argument(argument, value):
    x, w, _ = _tensors()
    args = {"g": torch.ones_like(x), "x": x, "w": w, "rstd": torch.ones(3), argument: value}
    with pytest.raises(TypeError, match=rf"^{argument}(\[0\])? must be"):  # g may be a list of summands
        cake_cute.cake_rmsnorm_train_backward(args["g"], args["x"], args["w"], args["rstd"])


def test_cpu_tensors_take_the_op():
    x, w, _ = _tensors(residual=True)
    assert routing.route(x, w) == routing.OP


class _StandInExtension:
    """Answers ``rmsnorm`` calls with a marker, as the C++ node would for a served signature."""

    def __init__(self):
        self.calls = []

    def rmsnorm(self, x, w, eps, residual, weight_offset):
        self.calls.append((eps, residual is not None, weight_offset))
        return "served"


def test_apply_asks_the_extension_where_cake_rmsnorm_does(monkeypatch):
    stand_in = _StandInExtension()
    monkeypatch.setattr(native, "extension", stand_in)
    monkeypatch.setattr(autograd, "route", lambda x, w: routing.NATIVE)
    x, w, r = _tensors(residual=True)
    assert cake_cute.CakeRMSNormFunction.apply(x, w, EPS, r, True, 0.5) == "served"
    assert cake_cute.CakeRMSNormFunction.apply(x, w, EPS) == "served"
    assert cake_cute.cake_rmsnorm(x, w, EPS, r, weight_offset=0.5) == "served"
    assert stand_in.calls == [(EPS, True, 0.5), (EPS, False, 0.0), (EPS, True, 0.5)]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_apply_under_compile_fullgraph_matches_eager(residual):
    """``CakeRMSNormFunction.apply`` traces in one graph (fullgraph) with its routing ``apply``, and
    gives eager's values and gradients."""

    def step(x, w, r):
        out = cake_cute.CakeRMSNormFunction.apply(x, w, EPS, r, True)
        return out[0] * 2 + out[1] if r is not None else out * 2

    torch._dynamo.reset()
    x, w, r = _tensors(residual, requires_grad=True)
    leaves = [t for t in (x, w, r) if t is not None]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, r)
    want = step(x, w, r)
    assert torch.equal(compiled, want)
    y_ref, _, h_ref = forward_reference(x.detach(), w.detach(), EPS, None if r is None else r.detach())
    want_ref = y_ref.float() * 2 + (h_ref if residual else 0)
    assert torch.allclose(want, want_ref, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(compiled.sum(), leaves)
    expected = torch.autograd.grad(want.sum(), leaves)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def _entered(call) -> list[tuple[str, str]]:
    """(module, function) of every cake_cute function ``call()`` enters, in order."""
    entered = []

    def profile(frame, event, _arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("cake_cute."):
            entered.append((module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def _entered_modules(call) -> list[str]:
    """The cake_cute modules ``call()`` enters, in order; a module is listed again only where a function
    of it is called after a function of another module was."""
    modules = []
    for module, _ in _entered(call):
        if not modules or modules[-1] != module:
            modules.append(module)
    return modules


class _StandInNode:
    """The C++ node's answer for a served call: y, or (y, h_new)."""

    def rmsnorm(self, x, w, eps, residual, weight_offset):
        return x if residual is None else (x, x + residual)


@pytest.fixture
def native_route(monkeypatch) -> list:
    """Module calls routed to a stand-in of the C++ node; the list collects each routing decision."""
    monkeypatch.setattr(native, "extension", _StandInNode())
    routes = []
    monkeypatch.setattr(casts, "route", lambda x, w: routes.append(routing.route(x, w)) or routing.NATIVE)
    return routes


@pytest.mark.parametrize("shape", [(3, H), (H,)], ids=["rows", "[H]"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_a_module_call_descends_once(native_route, residual, shape):
    """``CakeRMSNorm.forward`` on the native route: its tensors checked once into the call value, the
    route decided once, and every module entered once, from the module down to the native node (the
    C++ node's own recognition of its signatures aside)."""
    routes = native_route
    norm = CakeRMSNorm(H, eps=EPS, weight_offset=0.5)
    x, r = torch.randn(shape), (torch.randn(shape) if residual else None)
    entered = _entered_modules(lambda: norm(x, residual=r))
    assert len(routes) == 1
    assert len(entered) == len(set(entered)), entered
    order = [f"cake_cute.{name}" for name in ("module", "calls", "casts", "autograd", "dispatch")]
    assert [m for m in entered if m in order] == order, entered


def test_a_module_call_checks_no_setting(native_route):
    """The settings were checked when they were set: a call checks none of them again, and setting a
    bad one is refused by name."""
    norm = CakeRMSNorm(H, eps=EPS, weight_offset=0.5)
    x, _, r = _tensors(residual=True)
    functions = {name for _, name in _entered(lambda: norm(x, residual=r))}
    assert "module_call" in functions
    assert not functions & {"check_eps", "check_weight_offset", "check_memory_efficient", "check_cast_policy"}
    with pytest.raises(ValueError, match="eps"):
        norm.eps = -1.0
    with pytest.raises(TypeError, match="memory_efficient"):
        norm.memory_efficient = 1
    assert norm.eps == EPS and norm.memory_efficient is False
