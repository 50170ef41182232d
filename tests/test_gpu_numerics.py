"""Numerical edge cases on the GPU: NaN/Inf isolation, zero rows, extreme magnitudes.

What the SPEC's math implies (all arithmetic in FP32, eps an FP32 scalar):
* rows are independent: a NaN or Inf in one row can only affect that row's y, rstd and dx. dw sums
  over rows, so dw_j picks up every non-finite g_tj * xhat_tj: a NaN in h makes the whole row of xhat
  NaN (rstd is NaN) and so every dw_j; an Inf in h gives sum h^2 = Inf, rstd = 1/sqrt(Inf) = 0, xhat =
  Inf*0 = NaN at that column only (0 elsewhere), so only dw at that column.
* an all-zero row: rstd = 1/sqrt(eps), y = 0, and dx = rstd * g * (w + offset) -- finite but NOT zero
  (d y_j / d h_j = w_j / sqrt(eps) at h = 0).
* sum_j h_j^2 is an FP32 sum: for |h| ~ 1e30 (or bf16 values near its 3.4e38 maximum) it overflows
  to Inf, so rstd = 0 and y = h * 0 = 0 and dx = 0 -- not the O(1) values FP64 gives. PyTorch's eager
  FP32 RMSNorm behaves the same way. The tests assert this documented FP32 behavior.
* tiny values: h^2 underflows in FP32 below ~1e-19; with eps = 1e-6 that is harmless (eps dominates,
  exactly as in FP64), and with eps = 0 values down to ~1e-15 still match FP64.
"""

from __future__ import annotations

import pytest
import torch

from cake_cute import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward
from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    DTYPE_IDS,
    EPS,
    assert_bitwise_equal,
    fixed_seed,
    poison,
    prewarm_kernels,
    rand_weight,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

DEV = "cuda"
F32 = torch.float32
ROWS = 8
ISOLATION = [
    (torch.bfloat16, 64),
    (torch.bfloat16, 4096),
    (torch.float32, 4096),
    (torch.bfloat16, 65536),
    (torch.float16, 4097),
]
ids = lambda v: DTYPE_IDS.get(v, str(v))  # noqa: E731


def forward(x, w, eps=EPS, residual=None):
    rows = x.numel() // x.shape[-1]
    kwargs = dict(out=poison(x.shape, x.dtype), rstd=poison((rows,), F32), residual=residual)
    if residual is not None:
        kwargs["residual_out"] = poison(x.shape, x.dtype)
    return cake_rmsnorm_train_forward(x, w, eps, **kwargs)


def backward(g, h, w, rstd, g_residual=None):
    return cake_rmsnorm_train_backward(
        g, h, w, rstd, g_residual=g_residual, dx=poison(h.shape, h.dtype), dw=poison((h.shape[-1],), F32)
    )


def other_rows(bad):
    return [r for r in range(ROWS) if r not in bad]


# --------------------------------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("dtype, hidden", ISOLATION, ids=ids)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_nan_in_x_stays_in_its_row(dtype, hidden, residual):
    x = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    res = torch.randn(ROWS, hidden, device=DEV).to(dtype) if residual else None
    clean = forward(x, w, residual=res)
    bad_row, col = 3, hidden // 2
    x_bad = x.clone()
    x_bad[bad_row, col] = float("nan")
    out = forward(x_bad, w, residual=res)
    y, rstd = out[0], out[1]
    keep = other_rows([bad_row])
    # Other rows: finite and bit-identical to the clean run (and so to the reference).
    for a, b, name in zip(out, clean, ("y", "rstd", "h_new")):
        assert_bitwise_equal(a[keep], b[keep], f"{name} of the other rows")
    assert torch.isfinite(y[keep]).all() and torch.isfinite(rstd[keep]).all()
    y_ref, _, _ = forward_reference(x_bad[keep], w, EPS, residual=None if res is None else res[keep])
    assert rel_error(y[keep], y_ref) <= tolerance(dtype)
    # The NaN row: rstd NaN, so all of y NaN.
    assert torch.isnan(rstd[bad_row]) and torch.isnan(y[bad_row]).all()
    if residual:
        assert torch.isnan(out[2][bad_row, col])

    # Backward with that row: other rows' dx unaffected; dw is NaN everywhere (the row's xhat is NaN).
    g = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    h_bad = x_bad if res is None else out[2]
    h_clean = x if res is None else clean[2]
    dx, dw = backward(g, h_bad, w, rstd)
    dx_clean, _ = backward(g, h_clean, w, clean[1])
    assert_bitwise_equal(dx[keep], dx_clean[keep], "dx of the other rows")
    assert torch.isfinite(dx[keep]).all()
    assert torch.isnan(dx[bad_row]).all()
    assert torch.isnan(dw).all(), "a NaN row makes every dw_j NaN (SPEC math)"


@pytest.mark.parametrize("dtype, hidden", ISOLATION, ids=ids)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["+inf", "-inf"])
def test_inf_in_x_stays_in_its_row(dtype, hidden, sign):
    x = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    clean = forward(x, w)
    bad_row, col = 5, hidden - 1
    x_bad = x.clone()
    x_bad[bad_row, col] = sign * float("inf")
    y, rstd = forward(x_bad, w)
    keep = other_rows([bad_row])
    assert_bitwise_equal(y[keep], clean[0][keep], "y of the other rows")
    assert_bitwise_equal(rstd[keep], clean[1][keep], "rstd of the other rows")
    # sum h^2 = Inf -> rstd = 0 -> y = h * 0: NaN at the Inf, (signed) zero elsewhere, as in FP64.
    assert rstd[bad_row].item() == 0.0
    y_ref, rstd_ref, _ = forward_reference(x_bad[bad_row : bad_row + 1], w, EPS)
    assert rstd_ref.item() == 0.0
    assert torch.equal(torch.isnan(y[bad_row]), torch.isnan(y_ref[0])), "NaN exactly at the Inf column"
    others = torch.arange(hidden, device=DEV) != col
    assert (y[bad_row][others] == 0).all()

    g = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    dx, dw = backward(g, x_bad, w, rstd)
    dx_clean, dw_clean = backward(g, x, w, clean[1])
    assert_bitwise_equal(dx[keep], dx_clean[keep], "dx of the other rows")
    assert torch.isfinite(dx[keep]).all()
    # dw: NaN only at the Inf column (xhat = Inf * 0 there, 0 elsewhere in that row).
    assert torch.isnan(dw[col])
    assert torch.isfinite(dw[others]).all()
    _, dw_ref = backward_reference(g[keep], x[keep], w, clean[1][keep])
    assert rel_error(dw[others], dw_ref[others]) <= 2e-5


@pytest.mark.parametrize("dtype, hidden", ISOLATION, ids=ids)
def test_nan_in_gradient_stays_in_its_row(dtype, hidden):
    """A NaN in g at (row, col): that row's dx is NaN (c is NaN), other rows are untouched, and only
    dw[col] is NaN."""
    x = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    _, rstd = forward(x, w)
    g = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    dx_clean, dw_clean = backward(g, x, w, rstd)
    bad_row, col = 2, 0
    g_bad = g.clone()
    g_bad[bad_row, col] = float("nan")
    dx, dw = backward(g_bad, x, w, rstd)
    keep = other_rows([bad_row])
    assert_bitwise_equal(dx[keep], dx_clean[keep], "dx of the other rows")
    assert torch.isnan(dx[bad_row]).all()
    others = torch.arange(hidden, device=DEV) != col
    assert torch.isnan(dw[col]) and torch.isfinite(dw[others]).all()
    # The other columns of dw equal the reference without the bad element.
    g_zero = g_bad.clone()
    g_zero[bad_row, col] = 0
    _, dw_ref = backward_reference(g_zero, x, w, rstd)
    assert rel_error(dw[others], dw_ref[others]) <= 2e-5


# --------------------------------------------------------------------------------------------- zero row


@pytest.mark.parametrize("dtype, hidden", ISOLATION, ids=ids)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_all_zero_row(dtype, hidden, residual):
    x = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    zero_row = 4
    res = torch.randn(ROWS, hidden, device=DEV).to(dtype) if residual else None
    if residual:
        x[zero_row] = -res[zero_row]  # h = x + residual = 0 exactly
    else:
        x[zero_row] = 0
    w = rand_weight(hidden, dtype)
    out = forward(x, w, residual=res)
    y, rstd = out[0], out[1]
    h = x if res is None else out[2]
    assert (h[zero_row] == 0).all()
    assert (y[zero_row] == 0).all(), "y of an all-zero row is 0"
    assert rstd[zero_row].item() == pytest.approx(1.0 / EPS**0.5, rel=1e-5)
    y_ref, rstd_ref, _ = forward_reference(x, w, EPS, residual=res)
    assert rel_error(y, y_ref) <= tolerance(dtype)
    assert rel_error(rstd, rstd_ref) <= 1e-5

    g = torch.randn(ROWS, hidden, device=DEV).to(dtype)
    gr = torch.randn(ROWS, hidden, device=DEV).to(dtype) if residual else None
    dx, dw = backward(g, h, w, rstd, g_residual=gr)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    dx_ref, dw_ref = backward_reference(g, h, w, rstd, g_residual=gr)
    # The zero row's dx is rstd * g * w (+ g_residual): large (rstd = 1000) but finite, not zero.
    assert rel_error(dx[zero_row], dx_ref[zero_row]) <= tolerance(dtype)
    assert rel_error(dx, dx_ref) <= tolerance(dtype)
    assert rel_error(dw, dw_ref) <= 2e-5


# ------------------------------------------------------------------------------------ extreme magnitudes


@pytest.mark.parametrize(
    "dtype, scale, eps, g_scale",
    [
        (torch.float32, 1e-30, EPS, 1.0),  # h^2 underflows to 0 in FP32; eps dominates, as in FP64
        (torch.float32, 1e-15, 0.0, 1.0),  # eps = 0: still representable squares, must match FP64
        (torch.float32, 1e15, EPS, 1.0),
        (torch.bfloat16, 1e15, EPS, 1.0),
        (torch.bfloat16, 1e-30, EPS, 1.0),
        # fp16 inputs partly in the subnormal range, eps = 0. rstd ~ 1e4, so g is scaled down to keep
        # dx = rstd * (g*w - ...) inside fp16's range.
        (torch.float16, 1e-4, 0.0, 1e-4),
    ],
    ids=str,
)
@pytest.mark.parametrize("hidden", [4096, 65536])
def test_extreme_but_representable_scales_match_fp64(dtype, scale, eps, g_scale, hidden):
    rows = 33
    x = (torch.randn(rows, hidden, device=DEV) * scale).to(dtype)
    assert (x != 0).float().mean() > 0.9  # the data really has that magnitude
    w = rand_weight(hidden, dtype)
    y, rstd = forward(x, w, eps=eps)
    y_ref, rstd_ref, _ = forward_reference(x, w, eps)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    assert rel_error(y, y_ref) <= tolerance(dtype)
    assert rel_error(rstd, rstd_ref) <= 1e-5
    g = (torch.randn(rows, hidden, device=DEV) * g_scale).to(dtype)
    dx, dw = backward(g, x, w, rstd)
    dx_ref, dw_ref = backward_reference(g, x, w, rstd)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    assert rel_error(dx, dx_ref) <= tolerance(dtype)
    assert rel_error(dw, dw_ref) <= 2e-5


@pytest.mark.parametrize("hidden", [4096, 65536])
def test_fp16_maxima_match_fp64(hidden):
    """fp16 values up to +-65504 and gradients of the same size: squares (4e9) and their sum stay far
    inside FP32, so everything matches FP64."""
    rows, dtype = 33, torch.float16
    x = ((torch.rand(rows, hidden, device=DEV) * 2 - 1) * 65504).to(dtype)
    x[:, ::97] = 65504.0
    x[:, 1::97] = -65504.0
    w = rand_weight(hidden, dtype)
    y, rstd = forward(x, w)
    y_ref, rstd_ref, _ = forward_reference(x, w, EPS)
    assert torch.isfinite(y).all()
    assert rel_error(y, y_ref) <= tolerance(dtype)
    assert rel_error(rstd, rstd_ref) <= 1e-5
    g = ((torch.rand(rows, hidden, device=DEV) * 2 - 1) * 65504).to(dtype)
    dx, dw = backward(g, x, w, rstd)
    dx_ref, dw_ref = backward_reference(g, x, w, rstd)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    assert rel_error(dx, dx_ref) <= tolerance(dtype)
    assert rel_error(dw, dw_ref) <= 2e-5


@pytest.mark.parametrize(
    "dtype, big",
    [(torch.float32, 1e30), (torch.bfloat16, 3.0e38), (torch.bfloat16, torch.finfo(torch.bfloat16).max)],
    ids=str,
)
@pytest.mark.parametrize("hidden", [4096, 65536])
def test_sum_of_squares_overflow_follows_fp32_math(dtype, big, hidden):
    """Rows whose FP32 sum of squares overflows: rstd = 1/sqrt(Inf) = 0, y = h * 0 = 0, dx = 0 (the
    SPEC's FP32 math, and PyTorch's eager FP32 RMSNorm). FP64 would give O(1) values: this is a
    documented limit of FP32 statistics, not a kernel error. Normal rows in the same batch are exact."""
    rows = 8
    big_rows = [1, 6]
    x = torch.randn(rows, hidden, device=DEV)
    x[big_rows] = x[big_rows].sign() * big * (0.5 + 0.5 * torch.rand(len(big_rows), hidden, device=DEV))
    x = x.to(dtype)
    assert torch.isfinite(x).all()
    w = rand_weight(hidden, dtype)
    y, rstd = forward(x, w)
    keep = other_rows(big_rows)

    # What the FP32 formula gives, computed by PyTorch eagerly.
    xf = x.float()
    rstd_eager = torch.rsqrt(xf.pow(2).mean(dim=-1) + EPS)
    assert (rstd_eager[big_rows] == 0).all()  # the premise: the FP32 sum of squares overflows
    assert (rstd[big_rows] == 0).all(), f"rstd of overflowing rows: {rstd[big_rows].tolist()}"
    assert torch.isfinite(y).all()
    assert (y[big_rows] == 0).all()
    y_ref, rstd_ref, _ = forward_reference(x[keep], w, EPS)
    assert rel_error(y[keep], y_ref) <= tolerance(dtype)
    assert rel_error(rstd[keep], rstd_ref) <= 1e-5

    g = torch.randn(rows, hidden, device=DEV).to(dtype)
    dx, dw = backward(g, x, w, rstd)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    assert (dx[big_rows] == 0).all()
    dx_ref, dw_ref = backward_reference(g[keep], x[keep], w, rstd[keep])
    assert rel_error(dx[keep], dx_ref) <= tolerance(dtype)
    assert rel_error(dw, dw_ref) <= 2e-5  # the overflowing rows contribute g * (h * 0) = 0


def test_fp16_residual_add_overflow_rounds_to_inf():
    """h = round(x + residual): 40000 + 40000 overflows fp16 to Inf in h_new, exactly as the SPEC's
    rounding says; that row's y is non-finite, the other rows are unaffected."""
    rows, hidden, dtype = 8, 4096, torch.float16
    x = torch.randn(rows, hidden, device=DEV).to(dtype)
    res = torch.randn(rows, hidden, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    clean = forward(x, w, residual=res)
    x[3, 10] = 40000.0
    res[3, 10] = 40000.0
    y, rstd, h_new = forward(x, w, residual=res)
    assert_bitwise_equal(h_new, (x.float() + res.float()).to(dtype), "h_new")
    assert torch.isinf(h_new[3, 10])
    keep = other_rows([3])
    assert_bitwise_equal(y[keep], clean[0][keep], "y of the other rows")
    assert not torch.isfinite(y[3]).all()
