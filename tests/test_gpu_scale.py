"""Tensors past 2^31 elements: T = 2^19 rows of H = 8192 bf16 (2^32 elements, 8 GiB per tensor), so
every row offset past row 2^18 overflows 32 bits. Forward and backward are checked on rows sampled
across the whole range (the first, the last, and rows on both sides of the 2^31-element mark) against
FP64, and dW over all rows against an FP64 sum computed in chunks."""

import pytest
import torch

import cake_cute
from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance

pytestmark = pytest.mark.gpu

ROWS, HIDDEN = 1 << 19, 8192
BOUNDARY = (1 << 31) // HIDDEN  # first row whose offset needs more than 31 bits
SAMPLE = torch.tensor([0, 1, BOUNDARY - 1, BOUNDARY, BOUNDARY + 1, ROWS - 2, ROWS - 1])


def _needs_memory():
    free, _ = torch.cuda.mem_get_info()
    if free < 48 * 2**30:
        pytest.skip(f"needs ~48 GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def test_forward_and_backward_past_2_31_elements():
    _needs_memory()
    torch.manual_seed(31)
    dev = torch.device("cuda")
    x = torch.randn(ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    assert x.numel() > 2**31
    y, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
    y_ref, rstd_ref, _ = forward_reference(x[SAMPLE], w, 1e-6)
    assert rel_error(y[SAMPLE], y_ref) <= tolerance(torch.bfloat16)
    assert rel_error(rstd[SAMPLE], rstd_ref) <= 1e-5
    del y

    g = torch.randn_like(x)
    dx, dw = cake_cute.cake_rmsnorm_train_backward(g, x, w, rstd)
    dx_ref, _ = backward_reference(g[SAMPLE], x[SAMPLE], w, rstd[SAMPLE])
    assert rel_error(dx[SAMPLE], dx_ref) <= tolerance(torch.bfloat16)
    del dx

    dw_ref = torch.zeros(HIDDEN, dtype=torch.float64, device=dev)
    for start in range(0, ROWS, 1 << 15):
        rows = slice(start, start + (1 << 15))
        xhat = x[rows].double() * rstd[rows].double()[:, None]
        dw_ref += (g[rows].double() * xhat).sum(dim=0)
    assert rel_error(dw, dw_ref) <= 1e-5
