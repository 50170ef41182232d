"""The native host path on a GPU: bit for bit the Python path's results (forward, backward, plain and
residual, every dtype, odd H, a weight offset), CUDA-graph capture, the named errors, and the calls it
hands back to the Python path (views, partial gradients). The Python path is the engine's apply of
``CakeRMSNormFunction`` (``python_apply``, below its routing) and ``dispatch.python_forward``; the native
path serves ``cake_rmsnorm`` and ``CakeRMSNormFunction.apply`` once the Python path registered the
signature (their grad_fn then is the C++ node). The custom ops' C++ kernels (CUDA and AutogradCUDA keys,
what torch.compile's graphs call), the FP8 forward's included, against the ops' Python bodies and the
eager path."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from cake_cute import (
    CakeRMSNormFunction,
    cake_rmsnorm,
    cake_rmsnorm_fp8,
    cake_rmsnorm_train_backward,
    cake_rmsnorm_train_forward,
    dispatch,
    fp8,
    launch_fp8,
    library_ops,
)
from cake_cute.calls import norm_call
from cake_cute.dispatch import python_forward
from cake_cute.runtime import launch_plan, native
from cake_cute.runtime.device import device_facts

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    DTYPE_IDS,
    DTYPES,
    EPS,
    assert_bitwise_equal,
    fixed_seed,
    prewarm_kernels,
    rand_weight,
    warm_up_before_capture,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

DEV = "cuda"
SHAPES = [(1, 4096), (129, 4096), (17, 1001)]  # one row, a partial tile, an odd H


@pytest.fixture(scope="module", autouse=True)
def extension():
    """The GPU machine has a compiler: the native path must be there (no silent fallback here)."""
    module = native.load()
    assert module is not None, "the native host path did not build or load (see the warning)"
    return module


def leaves(rows, hidden, dtype, residual):
    x = torch.randn(rows, hidden, device=DEV).to(dtype).requires_grad_()
    w = rand_weight(hidden, dtype).requires_grad_()
    r = torch.randn(rows, hidden, device=DEV).to(dtype).requires_grad_() if residual else None
    return x, w, r


def step(norm, x, w, r, weight_offset, gy, gh):
    """Outputs and gradients of one forward + backward through ``norm``, and the grad_fn's name."""
    out = norm(x, w, EPS, r, True, weight_offset)
    outs = out if isinstance(out, tuple) else (out,)
    leaves_ = [t for t in (x, w, r) if t is not None]
    grads = torch.autograd.grad(outs, leaves_, (gy, gh)[: len(outs)])
    return [t.detach() for t in outs], list(grads), outs[0].grad_fn.name()


# The Python path's node for a call an entry checked (``cake_rmsnorm``, the module).
CHECKED_CALL_NODE = "CheckedRMSNormFunctionBackward"

# CakeRMSNormFunction on the Python path whatever the routing rule says (the engine's Function.apply).
python_apply = partial(torch.autograd.Function.apply.__func__, CakeRMSNormFunction)


def python_then_native(x, w, r, weight_offset=0.0):
    """(Python path results, native path results) of the same step; the first call registers."""
    gy = torch.randn_like(x)
    gh = torch.randn_like(x) if r is not None else None
    python = step(python_apply, x, w, r, weight_offset, gy, gh)
    fast = step(cake_rmsnorm, x, w, r, weight_offset, gy, gh)
    assert "CakeRMSNormFunction" in python[2] and "NormFunction" in fast[2], (python[2], fast[2])
    assert "CakeRMSNormFunction" not in fast[2], "the native path did not serve the call"
    return python, fast


def assert_same(python, fast):
    for name, a, b in zip(("outputs", "grads"), python[:2], fast[:2]):
        for i, (pa, fa) in enumerate(zip(a, b)):
            assert_bitwise_equal(fa, pa, f"{name}[{i}]")


@pytest.mark.parametrize("rows,hidden", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_autograd_native_matches_python_bitwise(dtype, residual, rows, hidden):
    python, fast = python_then_native(*leaves(rows, hidden, dtype, residual))
    assert_same(python, fast)
    assert fast[1][1].dtype == dtype  # dw in w's dtype
    if residual:
        assert_bitwise_equal(fast[1][2], fast[1][0], "d_residual vs dx")


def test_served_after_a_functorch_transform_has_run():
    """torch.func (and AOTAutograd under torch.compile) leave functorch's thread state behind: with no
    transform active the native path still serves."""
    torch.func.vmap(torch.sin)(torch.ones(2, device=DEV))
    python, fast = python_then_native(*leaves(33, 2048, torch.bfloat16, False))
    assert_same(python, fast)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_autograd_weight_offset_and_fp32_weight(residual):
    x, _, r = leaves(64, 2048, torch.bfloat16, residual)
    w = rand_weight(2048, torch.float32).requires_grad_()
    python, fast = python_then_native(x, w, r, weight_offset=1.0)
    assert_same(python, fast)
    assert fast[1][1].dtype == torch.float32


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_functional_native_matches_python_bitwise(dtype, residual, monkeypatch):
    x, w, r = (t.detach() if t is not None else None for t in leaves(129, 4096, dtype, residual))
    python_fwd = python_forward(norm_call(x, w, EPS, r))  # registers the signature
    assert native.extension.forward(x, w, EPS, r, 0.0) is not None, (
        "the native path did not serve the forward"
    )
    fast_fwd = cake_rmsnorm_train_forward(x, w, EPS, residual=r)
    for a, b in zip(fast_fwd, python_fwd):
        assert_bitwise_equal(a, b, "forward output")
    g = torch.randn_like(x)
    h = python_fwd[2] if residual else x
    g_res = torch.randn_like(x) if residual else None
    served = native.extension.backward(g, h, w, python_fwd[1], g_res, 0.0, torch.float32)
    assert served is not None, "the native path did not serve the backward"
    fast_bwd = cake_rmsnorm_train_backward(g, h, w, python_fwd[1], g_residual=g_res)
    monkeypatch.setattr(native, "extension", None)  # the same call on the Python path
    python_bwd = cake_rmsnorm_train_backward(g, h, w, python_fwd[1], g_residual=g_res)
    for a, b in zip(fast_bwd, python_bwd):
        assert_bitwise_equal(a, b, "backward output")
    assert fast_bwd[1].dtype == torch.float32


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_native_step_captures_in_a_cuda_graph(residual):
    x, w, r = leaves(256, 4096, torch.bfloat16, residual)
    gy = torch.randn_like(x)
    python_then_native(x, w, r)  # registered, kernels and plans loaded: nothing compiles in capture
    eager = step(cake_rmsnorm, x, w, r, 0.0, gy, torch.zeros_like(x) if residual else None)
    warm_up_before_capture(
        lambda: step(cake_rmsnorm, x, w, r, 0.0, gy, torch.zeros_like(x) if residual else None)
    )
    graph = torch.cuda.CUDAGraph()
    gh = torch.zeros_like(x) if residual else None
    with torch.cuda.graph(graph):
        captured = step(cake_rmsnorm, x, w, r, 0.0, gy, gh)
    graph.replay()
    torch.cuda.synchronize()
    assert "CakeRMSNormFunction" not in captured[2]
    assert_same(eager, captured)


def test_a_new_eps_is_checked_in_python_then_served():
    """The native path serves only eps values the Python path validated: a new one takes the Python path
    once (checked, launched, handed over), then the native one, with the same bits."""
    x, w, r = leaves(16, 4096, torch.bfloat16, True)
    python_then_native(x, w, r)
    eps = 3.0e-4  # no other test hands this one over
    first = cake_rmsnorm(x, w, eps, r)[0]
    served = cake_rmsnorm(x, w, eps, r)[0]
    assert first.grad_fn.name() == CHECKED_CALL_NODE
    assert served.grad_fn.name() != CHECKED_CALL_NODE
    assert_bitwise_equal(served, first, "y")


def test_named_errors_after_registration():
    x, w, r = leaves(16, 4096, torch.bfloat16, True)
    python_then_native(x, w, r)
    with pytest.raises(ValueError, match="eps"):
        cake_rmsnorm(x, w, -1.0)
    with pytest.raises(ValueError, match="eps"):
        cake_rmsnorm(x, w, float("nan"))
    with pytest.raises(TypeError, match="eps"):
        cake_rmsnorm(x, w, "1e-6")
    with pytest.raises(ValueError, match="w must have shape"):
        cake_rmsnorm(x, w[:-1])
    with pytest.raises(TypeError, match="residual"):
        cake_rmsnorm(x, w, EPS, residual=r.float())
    with pytest.raises(ValueError, match="residual"):
        cake_rmsnorm(x, w, EPS, residual=r[:-1])
    with pytest.raises(TypeError, match="weight_offset"):
        cake_rmsnorm(x, w, EPS, None, True, "1")
    with pytest.raises(TypeError, match="deterministic"):
        cake_rmsnorm_train_backward(
            x.detach(), x.detach(), w.detach(), torch.ones(16, device=DEV), deterministic=1
        )


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_function_apply_takes_the_native_path(residual):
    """``CakeRMSNormFunction.apply(x, w, eps, residual, deterministic)`` (FlashInfer's call) is served by the
    C++ node once the signature is registered (the node saves (x or h_new, w, rstd) as the Function
    does): bit for bit the Python path."""
    x, w, r = leaves(64, 4096, torch.bfloat16, residual)
    python_then_native(x, w, r)  # registers the signature
    gy = torch.randn_like(x)
    gh = torch.randn_like(x) if residual else None
    python = step(python_apply, x, w, r, 0.0, gy, gh)
    served = step(CakeRMSNormFunction.apply, x, w, r, 0.0, gy, gh)
    assert "CakeRMSNormFunction" not in served[2] and "NormFunction" in served[2], served[2]
    assert_same(python, served)


def test_views_and_expanded_gradients(monkeypatch):
    """A strided view of x takes the Python path; an expanded gradient (sum loss) is copied by the native
    backward: both give the contiguous call's bits."""
    x, w, _ = leaves(64, 4096, torch.bfloat16, False)
    python_then_native(x, w, None)
    wide = torch.randn(64, 8192, device=DEV).to(torch.bfloat16)
    view = wide[:, :4096].requires_grad_()
    y_view = cake_rmsnorm(view, w, EPS)
    assert y_view.grad_fn.name() == CHECKED_CALL_NODE
    same = view.detach().contiguous().requires_grad_()
    y = cake_rmsnorm(same, w, EPS)
    assert y.grad_fn.name() != CHECKED_CALL_NODE
    assert_bitwise_equal(y_view.detach(), y.detach(), "y of a view")
    dx_native, dw_native = torch.autograd.grad(y.sum(), (same, w))
    dx_python, dw_python = torch.autograd.grad(python_apply(same, w, EPS).sum(), (same, w))
    assert_bitwise_equal(dx_native, dx_python, "dx of a sum loss")
    assert_bitwise_equal(dw_native, dw_python, "dw of a sum loss")


def test_unused_gradients_stay_unmaterialized():
    x, w, r = leaves(32, 4096, torch.float32, True)
    python_then_native(x, w, r)
    w.requires_grad_(False)
    y, h_new = cake_rmsnorm(x, w, EPS, r)
    gh = torch.randn_like(x)
    dx, dr = torch.autograd.grad(h_new, (x, r), gh)  # only h_new used: its gradient flows unchanged
    assert_bitwise_equal(dx, gh, "dx")
    assert_bitwise_equal(dr, gh, "d_residual")
    y, _ = cake_rmsnorm(x, w, EPS, r)
    y.backward(torch.randn_like(y))
    assert w.grad is None and x.grad is not None


# --- the custom ops' C++ kernels ------------------------------------------------------------------


@pytest.fixture
def python_bodies(monkeypatch):
    """Counts the calls that reach the ops' Python bodies' launch functions (the C++ kernels' fallback)."""
    calls = {"fwd": 0, "bwd": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, attribute, fn in (
        ("fwd", "cake_rmsnorm_train_forward", cake_rmsnorm_train_forward),
        ("bwd", "cake_rmsnorm_train_backward", cake_rmsnorm_train_backward),
    ):
        monkeypatch.setattr(dispatch, attribute, counted(name, fn))  # what the bodies call
    return calls


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_op_kernels_serve_registered_signatures_bitwise(dtype, residual, python_bodies):
    """3-D rows (rstd shaped x.shape[:-1]), a weight offset: the C++ kernels' outputs are the Python
    bodies' bit for bit, and the served calls never reach Python."""
    x, w, r = leaves(129, 4096, dtype, residual)
    x, w = x.detach().view(3, 43, 4096), w.detach()
    r = r.detach().view(3, 43, 4096) if residual else None
    expected = library_ops.rmsnorm_fwd(x, w, EPS, r, 1.0)  # registers the signature
    python_bodies.update(fwd=0, bwd=0)
    actual = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r, 1.0)
    assert actual[1].shape == x.shape[:-1] and actual[2].numel() == (x.numel() if residual else 0)
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, b, f"forward output {i}")
    g = torch.randn_like(x)
    g_res = torch.randn_like(x) if residual else None
    h = actual[2] if residual else x
    got = torch.ops.cake_cute.rmsnorm_bwd(g, h, w, actual[1], g_res, 1.0)
    assert python_bodies == {"fwd": 0, "bwd": 0}, "a served signature reached the Python body"
    want = library_ops.rmsnorm_bwd(g, h, w, actual[1], g_res, 1.0)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"backward output {i}")


def test_op_kernels_hand_other_calls_to_python(python_bodies):
    """A strided view and an unregistered H reach the Python bodies; bad arguments raise their named
    errors through the dispatcher."""
    x, w, _ = (t.detach() if t is not None else None for t in leaves(64, 4096, torch.bfloat16, False))
    library_ops.rmsnorm_fwd(x, w, EPS)  # registers the signature
    python_bodies.update(fwd=0)
    wide = torch.randn(64, 8192, device=DEV).to(torch.bfloat16)
    y_view = torch.ops.cake_cute.rmsnorm_fwd(wide[:, :4096], w, EPS)[0]
    assert python_bodies["fwd"] == 1
    assert_bitwise_equal(y_view, torch.ops.cake_cute.rmsnorm_fwd(wide[:, :4096].contiguous(), w, EPS)[0], "y")
    odd = torch.randn(5, 4093, device=DEV).to(torch.bfloat16)
    torch.ops.cake_cute.rmsnorm_fwd(odd, rand_weight(4093, torch.bfloat16), EPS)
    assert python_bodies["fwd"] == 2  # the contiguous copy was served
    with pytest.raises(ValueError, match="w must have shape"):
        torch.ops.cake_cute.rmsnorm_fwd(x, w[:-1], EPS)
    with pytest.raises(ValueError, match="eps"):
        torch.ops.cake_cute.rmsnorm_fwd(x, w, -1.0)
    with pytest.raises(TypeError, match="residual"):
        torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, x.float())


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_op_autograd_node_matches_the_eager_path_bitwise(residual):
    x, w, r = leaves(129, 4096, torch.bfloat16, residual)
    gy, gh = torch.randn_like(x), torch.randn_like(x)
    python_then_native(x, w, r)
    outs = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r, 0.0)
    assert "OpNormFunction" in outs[0].grad_fn.name(), outs[0].grad_fn.name()
    assert not outs[1].requires_grad and outs[2].requires_grad == residual
    used = (outs[0], outs[2]) if residual else (outs[0],)
    leaves_ = [t for t in (x, w, r) if t is not None]
    grads = torch.autograd.grad(used, leaves_, (gy, gh)[: len(used)])
    eager = step(cake_rmsnorm, x, w, r, 0.0, gy, gh)
    for i, (a, b) in enumerate(zip(grads, eager[1])):
        assert_bitwise_equal(a, b, f"grad {i}")
    if residual:  # only h_new used: its gradient reaches x and residual unchanged, w gets none
        h_only = torch.autograd.grad(
            torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r, 0.0)[2], (x, w, r), gh, allow_unused=True
        )
        assert h_only[1] is None
        assert_bitwise_equal(h_only[0], gh, "dx")
        assert_bitwise_equal(h_only[2], gh, "d_residual")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_compiled_steps_launch_from_cpp(residual, python_bodies):
    """After the first compiled call, a compiled step's ops run without entering Python."""
    x, w, r = leaves(256, 4096, torch.bfloat16, residual)
    gy = torch.randn_like(x)

    def norm(x, w, r):
        out = cake_rmsnorm(x, w, EPS, r)
        return out[0] if residual else out

    compiled = torch.compile(norm, fullgraph=True)
    leaves_ = [t for t in (x, w, r) if t is not None]
    expected = torch.autograd.grad(norm(x, w, r), leaves_, gy)
    torch.autograd.grad(compiled(x, w, r), leaves_, gy)
    python_bodies.update(fwd=0, bwd=0)
    for _ in range(3):
        actual = torch.autograd.grad(compiled(x, w, r), leaves_, gy)
    assert python_bodies == {"fwd": 0, "bwd": 0}
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, b, f"grad {i}")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_opcheck_with_the_cpp_kernels(residual):
    """torch.library.opcheck on CUDA tensors (schema, fake tensors, autograd registration, AOT dispatch)
    with a served signature, so the C++ kernels answer."""
    x, w, r = leaves(64, 2048, torch.bfloat16, residual)
    python_then_native(x, w, r)
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_fwd.default, (x, w, EPS, r, 0.0))
    rstd = torch.rand(64, device=DEV) + 0.5
    g_res = torch.randn_like(x) if residual else None
    bwd_args = (torch.randn_like(x), x.detach(), w.detach(), rstd, g_res, 0.0)
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_bwd.default, bwd_args)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_parts_op_kernel_serves_registered_signatures_bitwise(parts, residual, python_bodies):
    """rmsnorm_bwd_parts (g as its summands) on a registered signature: its Python body's bits, without
    entering it; a strided summand is handed to the Python body; opcheck with the C++ kernel answering."""
    x, w, _ = leaves(129, 4096, torch.bfloat16, False)
    x, w = x.detach(), w.detach()
    library_ops.rmsnorm_fwd(x, w, EPS)  # registers the signature
    rstd = torch.rand(129, device=DEV) + 0.5
    gs = [torch.randn_like(x) for _ in range(parts)]
    g_res = torch.randn_like(x) if residual else None
    python_bodies.update(bwd=0)
    got = torch.ops.cake_cute.rmsnorm_bwd_parts(gs, x, w, rstd, g_res, 0.0)
    assert python_bodies["bwd"] == 0, "a served signature reached the Python body"
    want = library_ops.rmsnorm_bwd_parts(gs, x, w, rstd, g_res, 0.0)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"backward output {i}")
    strided = torch.randn(129, 8192, device=DEV).to(torch.bfloat16)[:, :4096]
    strided.copy_(gs[0])
    python_bodies.update(bwd=0)
    handed = torch.ops.cake_cute.rmsnorm_bwd_parts([strided, *gs[1:]], x, w, rstd, g_res, 0.0)
    assert python_bodies["bwd"] == 1
    for i, (a, b) in enumerate(zip(handed, want)):
        assert_bitwise_equal(a, b, f"strided backward output {i}")
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_bwd_parts.default, (gs, x, w, rstd, g_res, 0.0))


# --- cake_cute::rmsnorm_fp8_fwd's C++ kernels ------------------------------------------------------


@pytest.fixture
def fp8_bodies(monkeypatch):
    """Counts the FP8 op's launches from Python (``launch_fp8._forward_cuda``: the C++ kernel's fallback)."""
    calls = {"fp8": 0}
    launch = launch_fp8._forward_cuda

    def counted(*args):
        calls["fp8"] += 1
        return launch(*args)

    monkeypatch.setattr(launch_fp8, "_forward_cuda", counted)
    return calls


def assert_same_outputs(got, want, what):
    """Every output: dtype, shape, strides (the zero-memory y placeholder included) and bytes."""
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.stride() == b.stride(), f"{what} output {i}: strides {a.stride()} != {b.stride()}"
        assert_bitwise_equal(a, b, f"{what} output {i}")


@pytest.mark.parametrize("recipe", ["mxfp8", "1x128"])
@pytest.mark.parametrize("emit_y", [False, True], ids=["data", "with-y"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_fp8_op_kernel_serves_registered_signatures_bitwise(recipe, emit_y, residual, fp8_bodies):
    """3-D rows on a registered signature: the C++ kernel's five outputs are the Python body's, without
    entering it; a strided x is handed to the Python body; opcheck with the C++ kernels answering."""
    x, w, r = leaves(129, 4096, torch.bfloat16, residual)
    x, w = x.detach().view(3, 43, 4096), w.detach()
    r = r.detach().view(3, 43, 4096) if residual else None
    args = (x, w, EPS, r, recipe, emit_y, 0.0)
    want = fp8.rmsnorm_fp8_fwd(*args)  # the Python body: launches and registers
    fp8_bodies.update(fp8=0)
    got = torch.ops.cake_cute.rmsnorm_fp8_fwd(*args)
    assert fp8_bodies["fp8"] == 0, "a served signature reached the Python body"
    assert_same_outputs(got, want, "served")
    wide = torch.randn(3, 43, 8192, device=DEV).to(torch.bfloat16)
    wide[..., :4096].copy_(x)
    handed = torch.ops.cake_cute.rmsnorm_fp8_fwd(wide[..., :4096], *args[1:])
    assert fp8_bodies["fp8"] == 1
    assert_same_outputs(handed, want, "strided")
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_fp8_fwd.default, args)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("recipe", ["mxfp8", "1x128"])
def test_fp8_op_kernel_switches_kernels_at_the_persistent_row_limit(recipe, dtype, fp8_bodies):
    """Up to ``launch_plan.fp8_persistent_rows`` rows (of this dtype) the C++ kernel launches the
    persistent forward, above it the one-tile one, each once the Python body has registered it; a
    row's bytes are the same either way, and each served call is the Python body's."""
    hidden = 4096
    limit = launch_plan.fp8_persistent_rows(hidden, dtype)
    act = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.randn(limit + 1, hidden, device=DEV).to(act)
    w = torch.randn(hidden, device=DEV).to(act)
    facts = device_facts(x.device)
    assert launch_plan.fp8_forward_programs(limit, hidden, dtype, False, facts) > 0
    assert launch_plan.fp8_forward_programs(limit + 1, hidden, dtype, False, facts) == 0
    outs = {}
    for rows in (limit, limit + 1):
        args = (x[:rows], w, EPS, None, recipe, False, 0.0)
        want = fp8.rmsnorm_fp8_fwd(*args)  # launches and registers this row count's kernel
        fp8_bodies.update(fp8=0)
        outs[rows] = torch.ops.cake_cute.rmsnorm_fp8_fwd(*args)
        assert fp8_bodies["fp8"] == 0, f"{rows} rows reached the Python body"
        assert_same_outputs(outs[rows], want, f"served, {rows} rows")
    for i in (0, 1, 3):  # data, scales, rstd: the shared rows
        assert_bitwise_equal(outs[limit + 1][i][:limit], outs[limit][i], f"output {i} across the switch")


@pytest.mark.parametrize("emit_y", [False, True], ids=["data", "with-y"])
def test_eager_fp8_calls_take_the_op_kernels_once_registered(emit_y, fp8_bodies):
    """With the extension loaded, eager cake_rmsnorm_fp8 calls go through the custom op: the first launches
    from Python and registers, later ones launch from C++ with a C++ autograd node, and their outputs
    and gradients are the Python path's bitwise."""
    x, w, _ = leaves(129, 2560, torch.bfloat16, False)  # an H no other test registers
    g = torch.randn_like(x)
    first = cake_rmsnorm_fp8(x, w, EPS, emit_y=emit_y)
    assert fp8_bodies["fp8"] == 1
    fp8_bodies.update(fp8=0)
    served = cake_rmsnorm_fp8(x, w, EPS, emit_y=emit_y)
    assert fp8_bodies["fp8"] == 0, "a registered eager call reached the Python body"
    assert "OpFp8Function" in served.y.grad_fn.name(), served.y.grad_fn.name()
    for name in ("data", "scales", "rstd") + (("y",) if emit_y else ()):
        assert_bitwise_equal(getattr(served, name), getattr(first, name), name)
    got = torch.autograd.grad(served.y, (x, w), g)
    _, _, y, _, _ = fp8.CakeRMSNormFp8Function.apply(x, w, EPS, None, "mxfp8", emit_y, 0.0)
    for i, (a, b) in enumerate(zip(got, torch.autograd.grad(y, (x, w), g))):
        assert_bitwise_equal(a, b, f"grad {i}")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_fp8_op_autograd_node_matches_the_eager_path_bitwise(residual):
    """With a graph to record, the AutogradCUDA kernel's C++ node gives the Python autograd.Function's
    gradients."""
    x, w, r = leaves(129, 4096, torch.bfloat16, residual)
    gy, gh = torch.randn_like(x), torch.randn_like(x)
    cake_rmsnorm_fp8(x.detach(), w.detach(), EPS, residual=None if r is None else r.detach())  # registers
    outs = torch.ops.cake_cute.rmsnorm_fp8_fwd(x, w, EPS, r, "mxfp8", False, 0.0)
    assert "OpFp8Function" in outs[2].grad_fn.name(), outs[2].grad_fn.name()
    assert not (outs[0].requires_grad or outs[1].requires_grad or outs[3].requires_grad)
    leaves_ = [t for t in (x, w, r) if t is not None]
    used, grads_in = ((outs[2], outs[4]), (gy, gh)) if residual else ((outs[2],), (gy,))
    got = torch.autograd.grad(used, leaves_, grads_in)
    _, _, y, _, h_new = fp8.CakeRMSNormFp8Function.apply(x, w, EPS, r, "mxfp8", False, 0.0)
    want = torch.autograd.grad((y, h_new) if residual else (y,), leaves_, grads_in)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"grad {i}")
