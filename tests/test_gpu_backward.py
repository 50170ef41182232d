"""Backward on the GPU: dx and dw against the FP64 reference, layouts, workspace, determinism, T = 0.

Inputs follow what autograd hands the backward: h (x, or h_new = round(x + residual) in residual
mode), w, and the forward's FP32 rstd (taken from the FP64 reference here, so these tests do not
depend on the forward kernel). Caller-owned dx= / dw= buffers are NaN-poisoned.

Error measures:
* dx: relative-norm error <= reference.tolerance(dtype), measured by ``grad_rel_error`` (identical to
  ``rel_error`` unless the terms of rstd*(a - xhat*c) cancel, as they do for H = 1), and for bf16/fp16
  every element within one ulp of the exact value plus 1e-5 of the size of its terms.
* dw (FP32 output, FP32 accumulation over T rows): relative-norm error <= 2e-5, measured by
  ``sum_rel_error`` (identical to ``rel_error`` unless a short sum cancels).
"""

from __future__ import annotations

import math

import pytest
import torch

from cake_cute import (
    cake_rmsnorm_train_backward,
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_backward_workspace_bytes,
)
from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    DTYPE_IDS,
    EPS,
    INVARIANCE_SHAPES,
    WIDE,
    assert_bitwise_equal,
    assert_within_one_ulp,
    fixed_seed,
    foreign_cuda_kernels,
    grad_rel_error,
    peak_extra_bytes,
    poison,
    poison_,
    prewarm_kernels,
    rand_weight,
    suite_grid,
    sum_rel_error,
    warm_up_before_capture,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

DEV = "cuda"
F32 = torch.float32
ROWS = (1, 2, 129, 4096, 16231)
DW_TOL = 2e-5


GRID = suite_grid(ROWS)


class Inputs:
    """g, h, w, rstd (and g_residual) as the autograd backward receives them."""

    def __init__(self, shape, dtype, residual, w_dtype=None, weight_offset=0.0, g=None, g_residual=None):
        hidden = shape[-1]
        x = torch.randn(shape, device=DEV).to(dtype)
        self.w = (
            rand_weight(hidden, w_dtype or dtype)
            if weight_offset == 0.0
            else (0.1 * torch.randn(hidden, device=DEV)).to(w_dtype or dtype)
        )
        if residual:
            r = torch.randn(shape, device=DEV).to(dtype)
            self.h = (x.float() + r.float()).to(dtype)
        else:
            self.h = x
        self.rstd = forward_reference(self.h, self.w, EPS)[1].float()  # the forward's FP32 rstd
        self.g = torch.randn(shape, device=DEV).to(dtype) if g is None else g
        self.g_residual = (
            (torch.randn(shape, device=DEV).to(dtype) if g_residual is None else g_residual)
            if residual
            else None
        )
        self.weight_offset = weight_offset
        self.dtype = dtype
        self.shape = tuple(shape)

    def call(self, **kwargs):
        return cake_rmsnorm_train_backward(
            self.g,
            self.h,
            self.w,
            self.rstd,
            g_residual=self.g_residual,
            weight_offset=self.weight_offset,
            **kwargs,
        )

    def call_poisoned(self, **kwargs):
        """The backward with NaN-poisoned dx= / dw= (unless given); checks they hold the result."""
        dx_out = kwargs.pop("dx", None)
        dw_out = kwargs.pop("dw", None)
        dx_out = poison(self.shape, self.dtype) if dx_out is None else dx_out
        dw_out = poison((self.shape[-1],), kwargs.get("dw_dtype", F32)) if dw_out is None else dw_out
        dx, dw = self.call(dx=dx_out, dw=dw_out, **kwargs)
        assert_bitwise_equal(dx_out, dx, "dx= buffer")
        assert_bitwise_equal(dw_out, dw, "dw= buffer")
        return dx, dw

    def check(self, dx, dw, dw_tol=DW_TOL):
        dtype, hidden = self.dtype, self.shape[-1]
        rows = math.prod(self.shape[:-1])
        assert dx.shape == self.shape and dx.dtype == dtype and dx.device.type == torch.device(DEV).type
        assert dw.shape == (hidden,)
        dx_ref, dw_ref = backward_reference(
            self.g, self.h, self.w, self.rstd, g_residual=self.g_residual, weight_offset=self.weight_offset
        )
        # Sizes of the terms, for the conditioning-aware measures (see _helpers).
        g64 = self.g.double().reshape(-1, hidden)
        r64 = self.rstd.double().reshape(-1, 1)
        a = g64 * (self.w.double() + self.weight_offset)
        xhat = self.h.double().reshape(-1, hidden) * r64
        c = (a * xhat).sum(dim=-1, keepdim=True) / hidden
        scale = r64 * (a.abs() + (xhat * c).abs())
        if self.g_residual is not None:
            scale = scale + self.g_residual.double().reshape(-1, hidden).abs()
        abs_sum = (g64 * xhat).abs().sum(dim=0)
        del a, c

        assert torch.isfinite(dx).all(), "dx has non-finite values"
        assert torch.isfinite(dw).all(), "dw has non-finite values"
        e_dx = grad_rel_error(dx, dx_ref, scale)
        assert e_dx <= tolerance(dtype), f"dx rel error {e_dx:.3g} > {tolerance(dtype):g}"
        if dtype != F32:
            assert_within_one_ulp(dx, dx_ref.reshape(-1), dtype, slack=1e-5 * scale, what="dx")
        e_dw = sum_rel_error(dw, dw_ref, abs_sum, rows)
        assert e_dw <= dw_tol, f"dw rel error {e_dw:.3g} > {dw_tol:g}"


# ------------------------------------------------------------------------------------------------ grid


@pytest.mark.parametrize("dtype, hidden, residual, rows", GRID)
def test_backward_matches_fp64(dtype, hidden, residual, rows):
    inp = Inputs((rows, hidden), dtype, residual)
    dx, dw = inp.call_poisoned()
    assert dw.dtype == F32
    inp.check(dx, dw)


# ------------------------------------------------------------------------------------ dtypes / offset


@pytest.mark.parametrize(
    "dtype, hidden, residual",
    [
        (torch.bfloat16, 4096, False),
        (torch.bfloat16, 4096, True),
        (torch.float16, 4097, False),
        (torch.bfloat16, 65536, False),
        (torch.float16, 7, True),
    ],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_backward_fp32_weight(dtype, hidden, residual):
    rows = 129 if hidden >= WIDE else 1024
    inp = Inputs((rows, hidden), dtype, residual, w_dtype=F32)
    inp.w = inp.w + 1e-3 * torch.randn_like(inp.w)  # not representable in dtype
    dx, dw = inp.call_poisoned()
    assert dx.dtype == dtype and dw.dtype == F32
    inp.check(dx, dw)


@pytest.mark.parametrize(
    "dtype, hidden, residual",
    [
        (torch.bfloat16, 4096, False),
        (torch.bfloat16, 4096, True),
        (torch.float16, 4096, False),
        (torch.float32, 1000, True),
        (torch.bfloat16, 65536, False),
    ],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_backward_weight_offset_one(dtype, hidden, residual):
    rows = 129 if hidden >= WIDE else 2048
    inp = Inputs((rows, hidden), dtype, residual, weight_offset=1.0)
    dx, dw = inp.call_poisoned()
    inp.check(dx, dw)
    # Without the offset the result would be far off (w is ~0.1 here).
    dx_no_offset, _ = backward_reference(inp.g, inp.h, inp.w, inp.rstd, g_residual=inp.g_residual)
    assert rel_error(dx, dx_no_offset) > 0.3


@pytest.mark.parametrize("dw_dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_backward_dw_in_weight_dtype(dw_dtype):
    """dw_dtype (what autograd asks for, w's dtype): accumulated in FP32, rounded once."""
    inp = Inputs((2048, 4096), dw_dtype, False)
    dx, dw = inp.call_poisoned(dw_dtype=dw_dtype)
    assert dw.dtype == dw_dtype
    _, dw32 = inp.call()
    assert dw32.dtype == F32
    assert_bitwise_equal(dw, dw32.to(dw_dtype), "dw rounded once from the FP32 sum")
    _, dw_ref = backward_reference(inp.g, inp.h, inp.w, inp.rstd)
    assert rel_error(dw, dw_ref) <= tolerance(dw_dtype)


def test_backward_deterministic_false_is_correct():
    inp = Inputs((4096, 4096), torch.bfloat16, True)
    dx, dw = inp.call_poisoned(deterministic=False)
    inp.check(dx, dw)


# ----------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("shape", [(2, 3, 4096), (4, 1, 33, 7), (3, 43, 5120)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_nd_inputs(shape, residual):
    inp = Inputs(shape, torch.bfloat16, residual)
    assert inp.rstd.shape == (math.prod(shape[:-1]),)
    dx, dw = inp.call_poisoned()
    inp.check(dx, dw)
    flat = cake_rmsnorm_train_backward(
        inp.g.reshape(-1, shape[-1]),
        inp.h.reshape(-1, shape[-1]),
        inp.w,
        inp.rstd,
        g_residual=None if inp.g_residual is None else inp.g_residual.reshape(-1, shape[-1]),
    )
    assert_bitwise_equal(dx.reshape(flat[0].shape), flat[0], "N-D vs 2-D dx")
    assert_bitwise_equal(dw, flat[1], "N-D vs 2-D dw")


@pytest.mark.parametrize("shape", [(0, 4096), (2, 0, 4096), (0, 7), (0, 262144)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_empty_rows(shape, residual):
    dtype, hidden = torch.bfloat16, shape[-1]
    g = torch.randn(shape, device=DEV).to(dtype)
    h = torch.randn(shape, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    rstd = torch.empty(0, device=DEV)
    gr = torch.randn(shape, device=DEV).to(dtype) if residual else None
    dx_out, dw_out = poison(shape, dtype), poison((hidden,), F32)
    dx, dw = cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=gr, dx=dx_out, dw=dw_out)
    assert dx.shape == shape and dx.dtype == dtype
    assert dw.shape == (hidden,) and dw.dtype == F32
    assert torch.equal(dw_out, torch.zeros_like(dw_out)), "dw= must be zero-filled for T = 0"
    assert torch.equal(dw, torch.zeros_like(dw))
    # Without caller-owned outputs, too; and in w's dtype.
    dx2, dw2 = cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=gr)
    assert dx2.shape == shape and torch.equal(dw2, torch.zeros(hidden, device=DEV))
    _, dw3 = cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=gr, dw_dtype=dtype)
    assert dw3.dtype == dtype and torch.equal(dw3, torch.zeros(hidden, device=DEV, dtype=dtype))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_empty_rows_launch_no_kernel_of_ours(residual):
    """T = 0: dw is zero-filled (a PyTorch fill is fine) but no cake_cute kernel runs."""
    dtype, hidden = torch.bfloat16, 4096
    one = Inputs((1, hidden), dtype, residual)
    launched = foreign_cuda_kernels(lambda: one.call())
    if not launched:
        pytest.skip("the profiler does not see the backward kernels here; cannot count launches")
    g = torch.randn(0, hidden, device=DEV).to(dtype)
    gr = torch.randn(0, hidden, device=DEV).to(dtype) if residual else None
    rstd = torch.empty(0, device=DEV)
    ws = cake_rmsnorm_train_backward_workspace(0, hidden, DEV)
    launched = foreign_cuda_kernels(
        lambda: cake_rmsnorm_train_backward(g, g, one.w, rstd, g_residual=gr, workspace=ws)
    )
    assert launched == [], f"T = 0 launched {launched}"


def test_backward_h1_column_views():
    rows = 129
    g = torch.randn(1, rows, device=DEV).t()
    h = torch.randn(1, rows, device=DEV).t()
    assert g.shape == (rows, 1) and g.stride() == (1, rows)
    inp = Inputs((rows, 1), F32, False, g=g)
    inp.h = h
    inp.rstd = forward_reference(h, inp.w, EPS)[1].float()
    dx, dw = inp.call_poisoned()
    inp.check(dx, dw)
    dx_c, dw_c = cake_rmsnorm_train_backward(g.contiguous(), h.contiguous(), inp.w, inp.rstd)
    assert_bitwise_equal(dx, dx_c, "column views vs contiguous dx")
    assert_bitwise_equal(dw, dw_c, "column views vs contiguous dw")


# ---------------------------------------------------------------------------------------------- layouts


def _bare_call_extra_bytes(inp, rows, hidden):
    """Allocator bytes of one backward with caller-owned dx, dw and workspace (nothing else is
    needed, so anything of size [T, H] would be a copy of an input)."""
    dx_out = poison((rows, hidden), inp.dtype)
    dw_out = poison((hidden,), F32)
    ws = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=inp.g_residual is not None)
    inp.call(dx=dx_out, dw=dw_out, workspace=ws)  # warm up (kernel load) outside the measurement
    return peak_extra_bytes(lambda: inp.call(dx=dx_out, dw=dw_out, workspace=ws))


@pytest.mark.parametrize(
    "dtype, hidden",
    [(torch.bfloat16, 4096), (torch.float32, 4097), (torch.bfloat16, 65536)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_expanded_gradient(dtype, hidden, residual):
    """g = one row expanded over T rows (stride(0) == 0), as ``y.sum(0)``-style losses produce:
    read in place (no [T, H] copy) and correct."""
    rows = 129 if hidden >= WIDE else 4096
    g = torch.randn(1, hidden, device=DEV).to(dtype).expand(rows, hidden)
    gr = torch.randn(1, hidden, device=DEV).to(dtype).expand(rows, hidden) if residual else None
    assert g.stride(0) == 0
    inp = Inputs((rows, hidden), dtype, residual, g=g, g_residual=gr)
    extra = _bare_call_extra_bytes(inp, rows, hidden)
    assert extra < rows * hidden * g.element_size() // 2, (
        f"the expanded gradient was materialized ({extra} bytes)"
    )
    dx, dw = inp.call_poisoned()
    inp.check(dx, dw)
    dx_c, dw_c = cake_rmsnorm_train_backward(
        g.contiguous(), inp.h, inp.w, inp.rstd, g_residual=None if gr is None else gr.contiguous()
    )
    assert_bitwise_equal(dx, dx_c, "expanded vs contiguous g: dx")
    assert_bitwise_equal(dw, dw_c, "expanded vs contiguous g: dw")


def _padded(rows, hidden, dtype, pad_bytes=16, offset_elems=0):
    pad = pad_bytes // torch.empty(0, dtype=dtype).element_size()
    return torch.randn(rows, hidden + pad + offset_elems, device=DEV).to(dtype)[
        :, offset_elems : offset_elems + hidden
    ]


@pytest.mark.parametrize(
    "dtype, hidden",
    [(torch.bfloat16, 4096), (torch.float32, 5120), (torch.bfloat16, 65536)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_sliced_inputs_read_in_place(dtype, hidden, residual):
    rows = 129 if hidden >= WIDE else 2048
    g = _padded(rows, hidden, dtype)
    gr = _padded(rows, hidden, dtype, pad_bytes=48) if residual else None
    inp = Inputs((rows, hidden), dtype, residual, g=g, g_residual=gr)
    inp.h = _padded(rows, hidden, dtype, pad_bytes=32)
    inp.rstd = forward_reference(inp.h, inp.w, EPS)[1].float()
    assert not g.is_contiguous() and g.stride(0) * g.element_size() % 16 == 0
    extra = _bare_call_extra_bytes(inp, rows, hidden)
    assert extra < rows * hidden * g.element_size() // 2, f"a sliced input was copied ({extra} bytes)"
    dx, dw = inp.call_poisoned()
    inp.check(dx, dw)
    dx_c, dw_c = cake_rmsnorm_train_backward(
        g.contiguous(),
        inp.h.contiguous(),
        inp.w,
        inp.rstd,
        g_residual=None if gr is None else gr.contiguous(),
    )
    assert_bitwise_equal(dx, dx_c, "sliced vs contiguous: dx")
    assert_bitwise_equal(dw, dw_c, "sliced vs contiguous: dw")


@pytest.mark.parametrize("layout", ["misaligned-base", "odd-row-stride", "column-major", "strided-rstd"])
def test_backward_layouts_that_must_be_copied(layout):
    dtype, hidden, rows = torch.bfloat16, 4096, 1024
    inp = Inputs((rows, hidden), dtype, True)
    if layout == "misaligned-base":
        inp.g = _padded(rows, hidden, dtype, offset_elems=1)
        assert inp.g.data_ptr() % 16 != 0
    elif layout == "odd-row-stride":
        inp.g = torch.randn(rows, hidden + 3, device=DEV).to(dtype)[:, :hidden]
        inp.g_residual = torch.randn(rows, hidden + 1, device=DEV).to(dtype)[:, 1:]
    elif layout == "column-major":
        inp.g = torch.randn(hidden, rows, device=DEV).to(dtype).t()
        inp.h = inp.h.t().contiguous().t()
    else:
        buf = torch.empty(2 * rows, device=DEV)
        buf[::2] = inp.rstd
        inp.rstd = buf[::2]
    dx, dw = inp.call_poisoned()
    inp.check(dx, dw)
    dx_c, dw_c = cake_rmsnorm_train_backward(
        inp.g.contiguous(),
        inp.h.contiguous(),
        inp.w,
        inp.rstd.contiguous(),
        g_residual=inp.g_residual.contiguous(),
    )
    assert_bitwise_equal(dx, dx_c, f"{layout}: dx")
    assert_bitwise_equal(dw, dw_c, f"{layout}: dw")


def test_backward_non_contiguous_outputs_receive_the_result():
    dtype, hidden, rows = torch.bfloat16, 4096, 1024
    inp = Inputs((rows, hidden), dtype, True)
    dx_ref, dw_ref = inp.call()
    dx_out = poison_(torch.empty(hidden, rows, device=DEV, dtype=dtype).t())
    dw_out = poison_(torch.empty(2 * hidden, device=DEV)[::2])
    dx, dw = inp.call_poisoned(dx=dx_out, dw=dw_out)
    assert_bitwise_equal(dx_out, dx_ref, "dx through a transposed dx=")
    assert_bitwise_equal(dw_out, dw_ref, "dw through a strided dw=")
    flat = torch.empty(rows * hidden + 1, device=DEV, dtype=dtype)
    dx_out = poison_(flat[1:].view(rows, hidden))  # contiguous, 2 bytes off alignment
    dx, _ = inp.call_poisoned(dx=dx_out)
    assert_bitwise_equal(dx_out, dx_ref, "dx through a misaligned dx=")


def test_backward_direct_outputs_are_written_in_place():
    inp = Inputs((129, 4096), torch.bfloat16, True)
    dx_out, dw_out = poison((129, 4096), torch.bfloat16), poison((4096,), F32)
    dx, dw = inp.call(dx=dx_out, dw=dw_out)
    assert dx.data_ptr() == dx_out.data_ptr() and dw.data_ptr() == dw_out.data_ptr()


# ----------------------------------------------------------------------------- workspace / determinism


DETERMINISM = [
    (torch.bfloat16, 4096, 16231),
    (torch.float32, 4097, 4096),
    (torch.float16, 7, 16231),
    (torch.bfloat16, 65536, 129),
    (torch.float32, 262144, 129),
]


@pytest.mark.parametrize("dtype, hidden, rows", DETERMINISM, ids=lambda v: DTYPE_IDS.get(v, str(v)))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_deterministic_across_workspaces(dtype, hidden, rows, residual):
    inp = Inputs((rows, hidden), dtype, residual)
    nbytes = cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, DEV, residual=residual)
    first_ws = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=residual)
    assert first_ws.numel() == nbytes
    dx0, dw0 = inp.call_poisoned(workspace=first_ws)
    inp.check(dx0, dw0)

    def same(label, **kwargs):
        dx, dw = inp.call_poisoned(**kwargs)
        assert_bitwise_equal(dx, dx0, f"dx ({label})")
        assert_bitwise_equal(dw, dw0, f"dw ({label})")

    same(
        "fresh workspace",
        workspace=cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=residual),
    )
    same("reused workspace", workspace=first_ws)
    same("reused workspace again", workspace=first_ws)
    same(
        "workspace poisoned with 0xFF", workspace=poison_(torch.empty(nbytes, dtype=torch.uint8, device=DEV))
    )
    same("internal workspace")
    bigger = cake_rmsnorm_train_backward_workspace_bytes(4 * rows + 1000, hidden, DEV, residual=residual)
    assert bigger >= nbytes
    same(
        "poisoned workspace sized for more rows",
        workspace=poison_(torch.empty(bigger, dtype=torch.uint8, device=DEV)),
    )
    same(
        "workspace with a 16-byte aligned offset",
        workspace=poison_(torch.empty(bigger + 16, dtype=torch.uint8, device=DEV))[16:],
    )


def test_backward_one_workspace_serves_smaller_calls():
    """A workspace sized for the largest T serves every smaller T (poisoned in between), with
    results bitwise equal to calls with their own workspace."""
    dtype, hidden = torch.bfloat16, 4096
    # Sized for both modes (the helper's ``residual`` argument may give different sizes).
    nbytes = max(
        cake_rmsnorm_train_backward_workspace_bytes(16231, hidden, DEV, residual=r) for r in (False, True)
    )
    ws = torch.zeros(nbytes, dtype=torch.uint8, device=DEV)
    for rows in (16231, 4096, 129, 2, 1):
        for residual in (False, True):
            inp = Inputs((rows, hidden), dtype, residual)
            poison_(ws)
            dx, dw = inp.call_poisoned(workspace=ws)
            inp.check(dx, dw)
            dx_own, dw_own = inp.call()
            assert_bitwise_equal(dx, dx_own, f"dx, T={rows}")
            assert_bitwise_equal(dw, dw_own, f"dw, T={rows}")


@pytest.mark.parametrize("dtype, hidden", INVARIANCE_SHAPES, ids=lambda v: DTYPE_IDS.get(v, str(v)))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_batch_invariance_of_dx(dtype, hidden, residual):
    """Row r's dx has the same bits alone, in batches of 129 (several positions) and of 4096 / 16231
    (129 and 33 rows for H >= 65536)."""
    sizes = (16231, 4096, 129) if hidden < WIDE else (129, 33)
    big = Inputs((sizes[0], hidden), dtype, residual)
    r = sizes[1] + 7  # every window below (up to sizes[1] rows around r) fits in the big batch
    dx_big, _ = big.call()

    def dx_of(lo, n):
        sub = Inputs((1, hidden), dtype, residual)
        sub.g = big.g[lo : lo + n].clone()
        sub.h = big.h[lo : lo + n].clone()
        sub.rstd = big.rstd[lo : lo + n].clone()
        sub.w = big.w
        sub.g_residual = None if big.g_residual is None else big.g_residual[lo : lo + n].clone()
        sub.shape = tuple(sub.g.shape)
        return sub.call()[0]

    windows = [(r, 1, 0)]
    for n in sizes[1:]:
        windows += [(r, n, 0), (r - n // 2, n, n // 2), (r - n + 1, n, n - 1)]
    for lo, n, pos in windows:
        assert 0 <= lo and lo + n <= sizes[0]
        assert_bitwise_equal(
            dx_of(lo, n)[pos], dx_big[r], f"dx of row {r} in a batch of {n} at position {pos}"
        )


def test_backward_on_concurrent_streams_is_bitwise_serial():
    """Backwards queued on two streams at once (each with its own partial rows and its own dW launch
    behind it) give every result bitwise the one the same call gives alone."""
    problems = [Inputs((rows, 4096), torch.bfloat16, residual) for rows in (4096, 129) for residual in (0, 1)]
    alone = [p.call() for p in problems]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for _ in range(8):
        for i, p in enumerate(problems):
            with torch.cuda.stream(streams[i % 2]):
                results.append((i, p.call()))
    torch.cuda.synchronize()
    for i, (dx, dw) in results:
        assert_bitwise_equal(dx, alone[i][0], f"dx of problem {i}")
        assert_bitwise_equal(dw, alone[i][1], f"dw of problem {i}")


@pytest.mark.parametrize("workspace", [False, True], ids=["own-partials", "workspace"])
def test_backward_graph_replays_beside_eager_calls(workspace):
    """A captured backward replayed on one stream while eager backwards run on another: both stay
    bitwise right (the graph's partial rows are its own, or the caller's workspace)."""
    captured, eager = Inputs((2048, 4096), torch.bfloat16, False), Inputs((4096, 4096), torch.bfloat16, True)
    ws = cake_rmsnorm_train_backward_workspace(2048, 4096, DEV) if workspace else None
    expected = captured.call(workspace=ws)
    expected_eager = eager.call()
    warm_up_before_capture(lambda: captured.call(workspace=ws), iters=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = captured.call(workspace=ws)
    other = torch.cuda.Stream()
    other.wait_stream(torch.cuda.current_stream())
    eager_outs = []
    for _ in range(4):
        graph.replay()
        with torch.cuda.stream(other):
            eager_outs.append(eager.call())
    torch.cuda.synchronize()
    assert_bitwise_equal(outs[0], expected[0], "replayed dx")
    assert_bitwise_equal(outs[1], expected[1], "replayed dw")
    for dx, dw in eager_outs:
        assert_bitwise_equal(dx, expected_eager[0], "eager dx beside replays")
        assert_bitwise_equal(dw, expected_eager[1], "eager dw beside replays")


# --- g given as its summands (cake_cute.graph_passes folds compiled gradient sums into this) ------


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize(
    "dtype, hidden",
    [(torch.bfloat16, 4096), (torch.bfloat16, 1), (torch.float16, 4097), (F32, 7), (torch.bfloat16, 65536),
     (torch.bfloat16, 131072), (F32, 131072)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)  # fmt: skip
@pytest.mark.parametrize("rows", [0, 1, 129, 4096])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_backward_of_summands_is_the_backward_of_their_rounded_sum(parts, dtype, hidden, rows, residual):
    """dx and dw from the summands are, bit for bit, those of one g = round(FP32 sum, left to right)
    (the sum torch.compile's fused add stores); outputs are poisoned first."""
    from cake_cute.reference import summed_gradient

    x = torch.randn(rows, hidden, device=DEV).to(dtype)
    w = rand_weight(hidden, dtype)
    rstd = torch.rand(rows, device=DEV) + 0.5
    summands = [torch.randn(rows, hidden, device=DEV).to(dtype) for _ in range(parts)]
    g_res = torch.randn(rows, hidden, device=DEV).to(dtype) if residual else None
    dx, dw = poison(x.shape, dtype), poison((hidden,), F32)
    cake_rmsnorm_train_backward(summands, x, w, rstd, g_residual=g_res, dx=dx, dw=dw)
    expected = cake_rmsnorm_train_backward(summed_gradient(summands), x, w, rstd, g_residual=g_res)
    assert_bitwise_equal(dx, expected[0], "dx")
    assert_bitwise_equal(dw, expected[1], "dw")


@pytest.mark.parametrize("threads", [256, 1024])
@pytest.mark.parametrize("hidden, rows", [(64, 524288), (64, 1000), (128, 262144), (96, 4097), (7, 3001)])
def test_dw_reduce_with_rows_in_flight_is_bitwise_the_one_row_loop(hidden, rows, threads):
    """The dW reduction's lanes loading 8 partial rows before adding them (whole batches, then the
    rest one at a time) add in the order of the one-row loop: dw is the same bits, for partial row
    counts that leave every remainder, and within the FP64 reference's tolerance."""
    from contextlib import ExitStack

    from cake_cute.kernels.config import overridden

    def backward(**choices):
        with ExitStack() as stack:
            for arch in ("sm_90a", "sm_100a"):
                stack.enter_context(overridden("dw", arch, "fp32", hidden, **choices))
            return inputs.call_poisoned()

    inputs = Inputs((rows, hidden), torch.bfloat16, False)
    dx, dw = backward(threads=threads, rows_in_flight=1)
    dx_batched, dw_batched = backward(threads=threads, rows_in_flight=8)
    assert_bitwise_equal(dw_batched, dw, "dw")
    assert_bitwise_equal(dx_batched, dx, "dx")
    inputs.check(dx_batched, dw_batched)
