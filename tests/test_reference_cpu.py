"""The FP64 references (cake_cute/reference.py) checked against independent formulas, on the CPU.

Every GPU test measures the kernels against ``forward_reference`` / ``backward_reference``; if those
were wrong the GPU tests would pass against the wrong target. Here they are compared with
``torch.nn.functional.rms_norm`` (forward) and with PyTorch autograd through a float64 RMSNorm written
out by hand (backward), including residual mode and ``weight_offset``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance

from ._helpers import DTYPE_IDS, DTYPES, fixed_seed  # noqa: F401 (autouse fixture)

EPS = 1e-6
HIDDEN = (1, 7, 64, 513)
OFFSETS = (0.0, 1.0, 0.5)


def _inputs(shape, dtype, w_dtype=None, residual=False):
    H = shape[-1]
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    w = (torch.randn(H, dtype=torch.float64) * 0.5 + 1.0).to(w_dtype or dtype)
    res = torch.randn(shape, dtype=torch.float64).to(dtype) if residual else None
    return x, w, res


def _rmsnorm64(h64, w64, eps, weight_offset):
    """RMSNorm written out in float64, differentiable (the 'straightforward formula')."""
    ms = (h64 * h64).sum(dim=-1, keepdim=True) / h64.shape[-1]
    return h64 / torch.sqrt(ms + eps) * (w64 + weight_offset)


# ---------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("shape_kind", ["2d", "3d"])
@pytest.mark.parametrize("weight_offset", OFFSETS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_forward_reference_matches_functional_rms_norm(dtype, H, residual, weight_offset, shape_kind):
    shape = (5, H) if shape_kind == "2d" else (2, 3, H)
    x, w, res = _inputs(shape, dtype, residual=residual)
    y, rstd, h = forward_reference(x, w, EPS, residual=res, weight_offset=weight_offset)

    # h: the SPEC's rounding, round(float32(x) + float32(residual)) to x's dtype (x itself without one).
    expected_h = x if res is None else (x.float() + res.float()).to(dtype)
    assert h.dtype == dtype and h.shape == x.shape
    assert torch.equal(h.contiguous().view(torch.int8), expected_h.contiguous().view(torch.int8))  # bitwise

    # y against torch's own RMSNorm in float64 (weight = w + offset).
    h64 = expected_h.double()
    expected_y = F.rms_norm(h64, (H,), weight=w.double() + weight_offset, eps=EPS)
    assert y.dtype == torch.float64 and y.shape == x.shape
    torch.testing.assert_close(y, expected_y, rtol=1e-12, atol=1e-12)

    # rstd against 1/sqrt(||h||^2 / H + eps) with the norm from torch.linalg.
    norms = torch.linalg.vector_norm(h64.reshape(-1, H), dim=-1)
    expected_rstd = 1.0 / torch.sqrt(norms * norms / H + EPS)
    assert rstd.shape == (math.prod(shape[:-1]),)
    torch.testing.assert_close(rstd, expected_rstd, rtol=1e-12, atol=0.0)


def test_forward_reference_fp32_weight_with_bf16_activations():
    x, _, res = _inputs((4, 33), torch.bfloat16, residual=True)
    w = torch.randn(33, dtype=torch.float32)
    y, rstd, h = forward_reference(x, w, EPS, residual=res)
    expected = F.rms_norm(
        (x.float() + res.float()).to(torch.bfloat16).double(), (33,), weight=w.double(), eps=EPS
    )
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_forward_reference_zero_row_and_eps():
    x = torch.randn(3, 16, dtype=torch.float64)
    x[1] = 0
    w = torch.randn(16, dtype=torch.float64)
    y, rstd, _ = forward_reference(x, w, 1e-2)
    assert rstd[1].item() == pytest.approx(10.0, rel=1e-14)  # 1/sqrt(eps)
    assert torch.all(y[1] == 0)
    # eps enters as mean(h^2) + eps, not (rms + eps) nor mean(h^2 + eps) per element summed.
    expected = 1.0 / math.sqrt((x[0] ** 2).mean().item() + 1e-2)
    assert rstd[0].item() == pytest.approx(expected, rel=1e-14)


def test_forward_reference_fp32_compute_close_to_fp64():
    x, w, res = _inputs((8, 300), torch.bfloat16, residual=True)
    y64, r64, h64 = forward_reference(x, w, EPS, residual=res)
    y32, r32, h32 = forward_reference(x, w, EPS, residual=res, compute_dtype=torch.float32)
    assert y32.dtype == torch.float32 and r32.dtype == torch.float32
    assert torch.equal(h64, h32)
    assert rel_error(y32, y64) < 1e-6
    assert rel_error(r32, r64) < 1e-6


# --------------------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("shape_kind", ["2d", "3d"])
@pytest.mark.parametrize("weight_offset", OFFSETS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_backward_reference_matches_float64_autograd(dtype, H, residual, weight_offset, shape_kind):
    shape = (6, H) if shape_kind == "2d" else (2, 3, H)
    x, w, res = _inputs(shape, dtype, residual=residual)
    g = torch.randn(shape, dtype=torch.float64).to(dtype)
    g_h = torch.randn(shape, dtype=torch.float64).to(dtype) if residual else None
    _, rstd, h = forward_reference(x, w, EPS, residual=res, weight_offset=weight_offset)

    dx, dw = backward_reference(g, h, w, rstd, g_residual=g_h, weight_offset=weight_offset)

    # Autograd through the written-out float64 RMSNorm, at the same (rounded) h.
    h64 = h.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    y64 = _rmsnorm64(h64, w64, EPS, weight_offset)
    loss = (y64 * g.double()).sum()
    if residual:
        loss = loss + (h64 * g_h.double()).sum()  # h_new is an output too: its gradient adds into dh
    loss.backward()

    assert dx.shape == x.shape and dw.shape == (H,)
    assert dx.dtype == torch.float64 and dw.dtype == torch.float64
    scale = h64.grad.abs().max().item() + 1.0
    torch.testing.assert_close(dx, h64.grad, rtol=1e-9, atol=1e-12 * scale)
    torch.testing.assert_close(dw, w64.grad, rtol=1e-9, atol=1e-12 * (w64.grad.abs().max().item() + 1.0))


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_backward_reference_residual_gives_both_gradients(weight_offset):
    """Residual mode end to end in float64: h = x + residual feeds both outputs; autograd's x.grad and
    residual.grad are both the reference's single dx (the SPEC's 'gradient of both x and residual')."""
    T, H = 5, 24
    x64 = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    r64 = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w64 = (torch.randn(H, dtype=torch.float64) * 0.5 + 1).requires_grad_(True)
    g = torch.randn(T, H, dtype=torch.float64)
    g_h = torch.randn(T, H, dtype=torch.float64)
    h = x64 + r64
    y = _rmsnorm64(h, w64, EPS, weight_offset)
    ((y * g).sum() + (h * g_h).sum()).backward()

    h_plain = (x64 + r64).detach()
    _, rstd, _ = forward_reference(h_plain, w64.detach(), EPS, weight_offset=weight_offset)
    dx, dw = backward_reference(g, h_plain, w64.detach(), rstd, g_residual=g_h, weight_offset=weight_offset)
    torch.testing.assert_close(dx, x64.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dx, r64.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, w64.grad, rtol=1e-10, atol=1e-12)


def test_backward_reference_dw_is_a_plain_row_sum():
    """dw_j = sum_t g_tj * h_tj * rstd_t, spelled out with Python loops on a tiny case."""
    T, H = 3, 4
    g = torch.randn(T, H, dtype=torch.float64)
    h = torch.randn(T, H, dtype=torch.float64)
    w = torch.randn(H, dtype=torch.float64)
    rstd = torch.rand(T, dtype=torch.float64) + 0.5
    _, dw = backward_reference(g, h, w, rstd, weight_offset=1.0)
    for j in range(H):
        expected = sum(g[t, j].item() * h[t, j].item() * rstd[t].item() for t in range(T))
        assert dw[j].item() == pytest.approx(expected, rel=1e-13, abs=1e-15)


# ------------------------------------------------------------------------------ rel_error and tolerance


def test_rel_error_definition():
    e = torch.randn(100, dtype=torch.float64)
    assert rel_error(e, e) == 0.0
    assert rel_error(e * 1.01, e) == pytest.approx(0.01, rel=1e-9)
    assert rel_error(torch.empty(0), torch.empty(0)) == 0.0
    # Expected all zero: the absolute error norm.
    assert rel_error(torch.full((4,), 0.5), torch.zeros(4)) == pytest.approx(1.0)
    # NaN in the result is never "small".
    bad = e.clone()
    bad[3] = float("nan")
    assert not rel_error(bad, e) <= 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_tolerance_admits_one_rounding_and_rejects_a_wrong_result(dtype):
    x, w, _ = _inputs((64, 1024), dtype)
    y, _, _ = forward_reference(x, w, EPS)
    tol = tolerance(dtype)
    # One rounding of the exact result to the output dtype is within tolerance (with room for the FP32
    # accumulation the kernels add on top).
    assert rel_error(y.to(dtype), y) <= tol / 2
    # A result that is off by 5% (a wrong rstd, a missing weight offset, ...) is not.
    assert rel_error((y * 1.05).to(dtype), y) > tol
    # And a result with a single corrupted row out of 64 is not either.
    corrupt = y.to(dtype).clone()
    corrupt[7] = -corrupt[7]
    assert rel_error(corrupt, y) > tol


def test_tolerance_fp32_rejects_half_precision_rounding():
    """An FP32 path that secretly rounds through fp16/bf16 must fail the FP32 tolerance."""
    x, w, _ = _inputs((64, 1024), torch.float32)
    y, _, _ = forward_reference(x, w, EPS)
    assert rel_error(y.to(torch.float16).float(), y) > tolerance(torch.float32)
    assert rel_error(y.to(torch.bfloat16).float(), y) > tolerance(torch.float32)
