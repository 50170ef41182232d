"""cake_rmsnorm / CakeRMSNormFunction end to end on the GPU.

* forward + backward of a random upstream gradient against an FP32 eager PyTorch RMSNorm (plain and
  residual, bf16 and fp32, weight_offset 0 and 1);
* torch.autograd.gradcheck on small fp32 inputs (finite differences in fp32, hence eps=1e-3 and
  atol=rtol=1e-2: still far below the O(0.1) error of a wrong formula), and the vector-Jacobian
  products against float64 autograd at 1e-5;
* what is saved for the backward: exactly (x or h_new, w, rstd), nothing else of size [T, H];
* a missing output gradient (only h_new used, or only y used).
"""

from __future__ import annotations

import pytest
import torch

from cake_cute import CakeRMSNormFunction, cake_rmsnorm, cake_rmsnorm_train_forward
from cake_cute.reference import rel_error, tolerance

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    DTYPE_IDS,
    EPS,
    assert_bitwise_equal,
    fixed_seed,
    prewarm_kernels,
    rand_weight,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

DEV = "cuda"
F32 = torch.float32
DW_TOL_FP32 = 2e-5


def eager_fp32(x, w, eps, residual=None, weight_offset=0.0, gy=None, gh=None):
    """FP32 eager PyTorch RMSNorm, forward and backward. h is rounded to x's dtype like the SPEC
    says, with a straight-through estimator so the gradients themselves stay FP32.
    Returns (y, h, dx, dw, dresidual) in FP32."""
    xr = x.detach().float().requires_grad_(True)
    wr = w.detach().float().requires_grad_(True)
    rr = None if residual is None else residual.detach().float().requires_grad_(True)
    if rr is None:
        h = xr
    else:
        s = xr + rr
        h = s + (s.detach().to(x.dtype).float() - s.detach())
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * (wr + weight_offset)
    outputs, grads = [], []
    if gy is not None:
        outputs.append(y)
        grads.append(gy.float())
    if gh is not None:
        outputs.append(h)
        grads.append(gh.float())
    torch.autograd.backward(outputs, grads)
    return y.detach(), h.detach(), xr.grad, wr.grad, (None if rr is None else rr.grad)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


CASES = [(4096, 257, 0.0), (65536, 33, 0.0), (1000, 129, 1.0)]


@pytest.mark.parametrize("hidden, rows, weight_offset", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
def test_autograd_matches_fp32_eager(dtype, residual, hidden, rows, weight_offset):
    x = leaf(torch.randn(rows, hidden, device=DEV).to(dtype))
    w = leaf(
        rand_weight(hidden, dtype)
        if weight_offset == 0.0
        else (0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    )
    res = leaf(torch.randn(rows, hidden, device=DEV).to(dtype)) if residual else None
    gy = torch.randn(rows, hidden, device=DEV).to(dtype)
    gh = torch.randn(rows, hidden, device=DEV).to(dtype) if residual else None

    out = cake_rmsnorm(x, w, EPS, res, True, weight_offset)
    y, h_new = out if residual else (out, None)
    assert y.dtype == dtype and y.requires_grad and y.grad_fn is not None
    torch.autograd.backward([y] + ([h_new] if residual else []), [gy] + ([gh] if residual else []))

    y_ref, h_ref, dx_ref, dw_ref, dres_ref = eager_fp32(x, w, EPS, res, weight_offset, gy, gh)
    tol = tolerance(dtype)
    assert rel_error(y, y_ref) <= tol
    if residual:
        assert_bitwise_equal(h_new, (x.detach().float() + res.detach().float()).to(dtype), "h_new")
    assert x.grad is not None and x.grad.dtype == dtype and x.grad.shape == x.shape
    assert torch.isfinite(x.grad).all()
    e_dx = rel_error(x.grad, dx_ref)
    assert e_dx <= tol, f"x.grad rel error {e_dx:.3g} > {tol:g}"
    assert w.grad is not None and w.grad.dtype == w.dtype and w.grad.shape == (hidden,)
    e_dw = rel_error(w.grad, dw_ref)
    dw_tol = DW_TOL_FP32 if w.dtype == F32 else tolerance(w.dtype)
    assert e_dw <= dw_tol, f"w.grad rel error {e_dw:.3g} > {dw_tol:g}"
    if residual:
        assert_bitwise_equal(res.grad, x.grad, "residual.grad vs x.grad")
        assert res.grad.data_ptr() != x.grad.data_ptr(), "x.grad and residual.grad share memory"
        assert rel_error(res.grad, dres_ref) <= tol

    # Deterministic end to end: a second identical forward/backward gives the same bits.
    grads = [x.grad.clone(), w.grad.clone()] + ([res.grad.clone()] if residual else [])
    for t in [x, w] + ([res] if residual else []):
        t.grad = None
    out2 = cake_rmsnorm(x, w, EPS, res, True, weight_offset)
    outs2 = list(out2) if residual else [out2]
    torch.autograd.backward(outs2, [gy] + ([gh] if residual else []))
    for a, b, name in zip([x.grad, w.grad] + ([res.grad] if residual else []), grads, ("x", "w", "residual")):
        assert_bitwise_equal(a, b, f"{name}.grad on a repeated step")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_autograd_fp32_weight_with_bf16_activations(residual):
    rows, hidden, dtype = 257, 4096, torch.bfloat16
    x = leaf(torch.randn(rows, hidden, device=DEV).to(dtype))
    w = leaf(rand_weight(hidden, F32) + 1e-3 * torch.randn(hidden, device=DEV))
    res = leaf(torch.randn(rows, hidden, device=DEV).to(dtype)) if residual else None
    gy = torch.randn(rows, hidden, device=DEV).to(dtype)
    out = cake_rmsnorm(x, w, EPS, res)
    y = out[0] if residual else out
    assert y.dtype == dtype
    y.backward(gy)
    _, _, dx_ref, dw_ref, _ = eager_fp32(x, w, EPS, res, 0.0, gy, torch.zeros_like(gy) if residual else None)
    assert w.grad.dtype == F32
    assert rel_error(x.grad, dx_ref) <= tolerance(dtype)
    assert rel_error(w.grad, dw_ref) <= DW_TOL_FP32


def test_autograd_sum_loss_expanded_gradient():
    """y.sum() hands the backward an expanded gradient (all strides 0)."""
    rows, hidden, dtype = 129, 4096, torch.bfloat16
    x = leaf(torch.randn(rows, hidden, device=DEV).to(dtype))
    w = leaf(rand_weight(hidden, dtype))
    cake_rmsnorm(x, w, EPS).sum().backward()
    ones = torch.ones(rows, hidden, device=DEV, dtype=dtype)
    _, _, dx_ref, dw_ref, _ = eager_fp32(x, w, EPS, None, 0.0, ones, None)
    assert rel_error(x.grad, dx_ref) <= tolerance(dtype)
    assert rel_error(w.grad, dw_ref) <= tolerance(dtype)


def test_autograd_nd_input_and_partial_requires_grad():
    dtype, hidden = torch.bfloat16, 4096
    x = torch.randn(2, 3, hidden, device=DEV).to(dtype)  # no grad wanted for x
    w = leaf(rand_weight(hidden, dtype))
    gy = torch.randn(2, 3, hidden, device=DEV).to(dtype)
    y = cake_rmsnorm(x, w, EPS)
    assert y.shape == (2, 3, hidden)
    y.backward(gy)
    _, _, _, dw_ref, _ = eager_fp32(x, w, EPS, None, 0.0, gy, None)
    assert x.grad is None
    assert rel_error(w.grad, dw_ref) <= tolerance(dtype)


def test_function_apply_matches_cake_rmsnorm():
    dtype, hidden, rows = torch.bfloat16, 4096, 64
    x = torch.randn(rows, hidden, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    res = torch.randn(rows, hidden, device=DEV).to(dtype)
    a = CakeRMSNormFunction.apply(x, w, EPS, res, True, 0.0)
    b = cake_rmsnorm(x, w, EPS, res)
    c = cake_rmsnorm_train_forward(x, w, EPS, residual=res)
    assert_bitwise_equal(a[0], b[0], "y (apply vs cake_rmsnorm)")
    assert_bitwise_equal(a[1], b[1], "h_new (apply vs cake_rmsnorm)")
    assert_bitwise_equal(a[0], c[0], "y (autograd vs functional)")
    assert_bitwise_equal(a[1], c[2], "h_new (autograd vs functional)")


# --------------------------------------------------------------------------------- gradcheck / float64


@pytest.mark.filterwarnings("ignore:Input #")
@pytest.mark.parametrize("hidden", [8, 33])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_gradcheck_fp32(hidden, residual):
    rows = 3
    x = torch.randn(rows, hidden, device=DEV, requires_grad=True)
    w = (torch.randn(hidden, device=DEV) * 0.5 + 1.0).requires_grad_(True)
    inputs = [x, w] + ([torch.randn(rows, hidden, device=DEV, requires_grad=True)] if residual else [])

    def fn(x, w, *rest):
        return cake_rmsnorm(x, w, 1e-5, rest[0] if rest else None)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-3, atol=1e-2, rtol=1e-2, nondet_tol=0.0)


@pytest.mark.parametrize("hidden", [8, 33, 4096])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_vjp_matches_float64_autograd(hidden, residual):
    """The backward's vector-Jacobian products for fp32 inputs against float64 autograd of the plain
    formula (h = x + residual unrounded): only FP32 rounding separates them."""
    rows, eps = 5, 1e-5
    x = leaf(torch.randn(rows, hidden, device=DEV))
    w = leaf(torch.randn(hidden, device=DEV) * 0.5 + 1.0)
    res = leaf(torch.randn(rows, hidden, device=DEV)) if residual else None
    gy = torch.randn(rows, hidden, device=DEV)
    gh = torch.randn(rows, hidden, device=DEV) if residual else None
    out = cake_rmsnorm(x, w, eps, res)
    torch.autograd.backward(list(out) if residual else [out], [gy] + ([gh] if residual else []))

    x64, w64 = leaf(x.double()), leaf(w.double())
    r64 = leaf(res.double()) if residual else None
    h = x64 if r64 is None else x64 + r64
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * w64
    loss = (y * gy.double()).sum() + ((h * gh.double()).sum() if residual else 0.0)
    loss.backward()
    for name, ours, ref in [("x", x.grad, x64.grad), ("w", w.grad, w64.grad)] + (
        [("residual", res.grad, r64.grad)] if residual else []
    ):
        e = rel_error(ours, ref)
        assert e <= tolerance(F32), f"{name}.grad rel error {e:.3g} vs float64 autograd"


# ------------------------------------------------------------------------------------------ saved tensors


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_saves_exactly_h_w_rstd(residual):
    rows, hidden, dtype = 64, 512, torch.bfloat16  # T*H, H and T all differ
    x = leaf(torch.randn(rows, hidden, device=DEV).to(dtype))
    w = leaf(rand_weight(hidden, dtype))
    res = leaf(torch.randn(rows, hidden, device=DEV).to(dtype)) if residual else None
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = cake_rmsnorm(x, w, EPS, res)
    shapes = [tuple(t.shape) for t in packed]
    assert len(packed) == 3, f"saved {shapes}"
    big = [t for t in packed if t.numel() >= rows * hidden]
    assert len(big) == 1 and tuple(big[0].shape) == (rows, hidden), f"saved {shapes}"
    if residual:
        h_new = out[1]
        assert big[0].data_ptr() == h_new.data_ptr(), "residual mode must save h_new itself"
    else:
        assert big[0].data_ptr() == x.data_ptr(), "plain mode must save x itself"
    saved_w = [t for t in packed if tuple(t.shape) == (hidden,)]
    assert len(saved_w) == 1 and saved_w[0].data_ptr() == w.data_ptr()
    saved_rstd = [t for t in packed if tuple(t.shape) == (rows,)]
    assert len(saved_rstd) == 1 and saved_rstd[0].dtype == F32
    expected = cake_rmsnorm_train_forward(
        x.detach(), w.detach(), EPS, residual=None if res is None else res.detach()
    )
    assert_bitwise_equal(saved_rstd[0], expected[1], "saved rstd")
    # The backward works from what was saved.
    y = out[0] if residual else out
    y.backward(torch.randn_like(y))
    assert x.grad is not None and w.grad is not None and torch.isfinite(x.grad).all()


# ------------------------------------------------------------------------------------ missing gradients


def _residual_leaves(dtype, rows=129, hidden=4096):
    """x, w, residual (leaves that require grad) and one output gradient."""
    x = leaf(torch.randn(rows, hidden, device=DEV).to(dtype))
    w = leaf(rand_weight(hidden, dtype))
    res = leaf(torch.randn(rows, hidden, device=DEV).to(dtype))
    return x, w, res, torch.randn(rows, hidden, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
def test_only_h_new_used(dtype):
    """y unused: dL/dh_new flows to x and residual unchanged, and w gets no (or a zero) gradient."""
    x, w, res, gh = _residual_leaves(dtype)
    _, h_new = cake_rmsnorm(x, w, EPS, res)
    torch.autograd.backward([h_new], [gh])
    assert_bitwise_equal(x.grad, gh, "x.grad")
    assert_bitwise_equal(res.grad, gh, "residual.grad")
    assert w.grad is None or int(torch.count_nonzero(w.grad).item()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
def test_only_y_used(dtype):
    """h_new unused: the gradient is the plain RMSNorm backward at h_new, for x and residual alike."""
    x, w, res, gy = _residual_leaves(dtype)
    y, _ = cake_rmsnorm(x, w, EPS, res)
    y.backward(gy)
    _, _, dx_ref, dw_ref, dres_ref = eager_fp32(x, w, EPS, res, 0.0, gy, None)
    assert rel_error(x.grad, dx_ref) <= tolerance(dtype)
    assert rel_error(res.grad, dres_ref) <= tolerance(dtype)
    assert_bitwise_equal(res.grad, x.grad, "residual.grad vs x.grad")
    dw_tol = DW_TOL_FP32 if dtype == F32 else tolerance(dtype)
    assert rel_error(w.grad, dw_ref) <= dw_tol
