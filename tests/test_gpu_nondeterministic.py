"""``deterministic=False`` on the GPU: the atomic dW backward.

What it must keep: dx bitwise equal to the deterministic backward's (the atomics touch dw only); dw as
accurate as the deterministic one against FP64, and within FP32 rounding of it; the accumulator and
counters in the workspace back at zero after every call, so repeated calls on one workspace stay
correct without host writes; autograd and the functional API alike.
"""

from __future__ import annotations

import pytest
import torch

from cake_cute import (
    cake_rmsnorm,
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_backward_workspace_bytes,
    dispatch,
)

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    DTYPE_IDS,
    DTYPES,
    NONDETERMINISTIC_HIDDEN,
    assert_bitwise_equal,
    fixed_seed,
    poison_,
    prewarm_kernels,
    rand_weight,
    rows_for,
)
from .test_gpu_backward import DEV, Inputs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

GRID = [
    pytest.param(dtype, hidden, residual, rows, id=f"{DTYPE_IDS[dtype]}-H{hidden}-{'res' if residual else 'plain'}-T{rows}")
    for dtype in DTYPES
    for hidden in NONDETERMINISTIC_HIDDEN
    for residual in (False, True)
    for rows in rows_for(hidden, (1, 2, 129, 4096))
]


def _atomic_tail(workspace: torch.Tensor, hidden: int) -> torch.Tensor:
    nbytes = dispatch.atomic_dw_layout(hidden)[1]
    start = (workspace.numel() - nbytes) // 16 * 16
    return workspace[start:start + nbytes]


def _close_to_deterministic(dw: torch.Tensor, dw_det: torch.Tensor, inp: Inputs) -> None:
    """The two sums differ only in the order of FP32 additions: bounded by a few ulps of the sum of
    the terms' magnitudes."""
    hidden = inp.shape[-1]
    xhat = inp.h.double().reshape(-1, hidden) * inp.rstd.double().reshape(-1, 1)
    abs_sum = (inp.g.double().reshape(-1, hidden) * xhat).abs().sum(dim=0)
    rows = xhat.shape[0]
    bound = abs_sum * (2.0 ** -23) * max(8, rows).bit_length() * 4 + 1e-30
    gap = (dw.double() - dw_det.double()).abs()
    assert bool((gap <= bound).all()), f"dw differs from the deterministic one by up to {(gap / bound).max():.3g} bounds"


@pytest.mark.parametrize("dtype, hidden, residual, rows", GRID)
def test_nondeterministic_matches_fp64_and_the_deterministic_dx(dtype, hidden, residual, rows):
    inp = Inputs((rows, hidden), dtype, residual)
    dx, dw = inp.call_poisoned(deterministic=False)
    inp.check(dx, dw)
    dx_det, dw_det = inp.call()
    assert_bitwise_equal(dx, dx_det, "dx (deterministic=False vs True)")
    _close_to_deterministic(dw, dw_det, inp)


@pytest.mark.parametrize("dtype, hidden, rows", [(torch.bfloat16, 4096, 4096), (torch.float32, 4097, 129),
                                                 (torch.bfloat16, 262144, 33), (torch.float16, 7, 1000)],
                         ids=lambda v: DTYPE_IDS.get(v, str(v)))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_workspace_is_left_clean_and_reusable(dtype, hidden, rows, residual):
    """A workspace from the helper serves repeated nondeterministic calls (and deterministic calls in
    between) with no host writes; its atomic tail is zero after each one."""
    inp = Inputs((rows, hidden), dtype, residual)
    ws = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=residual)
    assert ws.numel() == cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, DEV, residual=residual)
    dx_det, dw_det = inp.call()
    for i in range(4):
        dx, dw = inp.call_poisoned(deterministic=False, workspace=ws)
        assert_bitwise_equal(dx, dx_det, f"dx, call {i}")
        _close_to_deterministic(dw, dw_det, inp)
        assert int(torch.count_nonzero(_atomic_tail(ws, hidden))) == 0, f"atomic scratch not zero after call {i}"
        dx2, dw2 = inp.call_poisoned(workspace=ws)  # deterministic, same workspace
        assert_bitwise_equal(dx2, dx_det, f"dx (deterministic between), call {i}")
        assert_bitwise_equal(dw2, dw_det, f"dw (deterministic between), call {i}")


def test_dw_in_weight_dtype():
    inp = Inputs((4096, 4096), torch.bfloat16, False)
    _, dw32 = inp.call(deterministic=False)
    _, dw16 = inp.call_poisoned(deterministic=False, dw_dtype=torch.bfloat16)
    assert dw16.dtype == torch.bfloat16
    # Each run may round differently in FP32; rounded to bf16 they agree within one bf16 ulp.
    assert torch.allclose(dw16.float(), dw32.to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_autograd_nondeterministic(residual):
    torch.manual_seed(3)
    shape, dtype = (4, 300, 4096), torch.bfloat16
    x0 = torch.randn(shape, device=DEV, dtype=dtype)
    r0 = torch.randn(shape, device=DEV, dtype=dtype) if residual else None
    w0 = rand_weight(shape[-1], dtype)
    g = [torch.randn(shape, device=DEV, dtype=dtype) for _ in range(2)]
    grads = {}
    for deterministic in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        r = r0.clone().requires_grad_() if residual else None
        out = cake_rmsnorm(x, w, 1e-6, residual=r, deterministic=deterministic)
        outs = out if residual else (out,)
        torch.autograd.backward(outs, g[: len(outs)])
        grads[deterministic] = (x.grad, w.grad, r.grad if residual else None)
    assert_bitwise_equal(grads[False][0], grads[True][0], "x.grad")
    if residual:
        assert_bitwise_equal(grads[False][2], grads[False][0], "residual.grad is x.grad")
    assert grads[False][1].dtype == dtype
    assert torch.allclose(grads[False][1].float(), grads[True][1].float(), rtol=2 ** -7, atol=1e-6)


def test_many_programs_contend_on_one_accumulator():
    """T large enough that every resident program adds into the same FP32 row."""
    inp = Inputs((32768, 1024), torch.bfloat16, False)
    ws = poison_(torch.empty(cake_rmsnorm_train_backward_workspace_bytes(32768, 1024, DEV), dtype=torch.uint8,
                             device=DEV))
    _atomic_tail(ws, 1024).zero_()
    dx, dw = inp.call_poisoned(deterministic=False, workspace=ws)
    inp.check(dx, dw)
    dx_det, dw_det = inp.call()
    assert_bitwise_equal(dx, dx_det, "dx")
    _close_to_deterministic(dw, dw_det, inp)


def test_warn_only_runs_nondeterministic():
    inp = Inputs((129, 4096), torch.bfloat16, False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="deterministic=False"):
            dx, dw = inp.call_poisoned(deterministic=False)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    inp.check(dx, dw)
