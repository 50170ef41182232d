"""Forward on the GPU: y, rstd and h_new against the FP64 reference, layouts, T = 0, batch invariance.

Every call passes NaN-poisoned caller-owned outputs (out=, rstd=, residual_out=), so an element the
kernel fails to write shows up as a NaN. Errors: relative-norm error of y <= reference.tolerance(dtype),
and for bf16/fp16 additionally every element of y within one ulp of the exact value (the tolerance
alone is ~10x one rounding and would let a systematic error through); h_new bitwise equal to
round(float32(x) + float32(residual)); rstd within 1e-5 relative, per row.
"""

from __future__ import annotations

import math

import pytest
import torch

from cake_cute import cake_rmsnorm_train_forward
from cake_cute.reference import forward_reference, rel_error, tolerance

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    DTYPE_IDS,
    EPS,
    INVARIANCE_SHAPES,
    WIDE,
    assert_bitwise_equal,
    assert_within_one_ulp,
    fixed_seed,
    foreign_cuda_kernels,
    peak_extra_bytes,
    poison,
    poison_,
    prewarm_kernels,
    rand_weight,
    suite_grid,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

DEV = "cuda"
F32 = torch.float32
ROWS = (0, 1, 2, 129, 4096)
RSTD_TOL = 1e-5


GRID = suite_grid(ROWS)


def run_forward(x, w, eps=EPS, residual=None, weight_offset=0.0, **outputs):
    """The forward with NaN-poisoned caller-owned outputs (unless given); checks that the outputs
    the caller passed hold exactly what is returned."""
    rows = math.prod(x.shape[:-1])
    out = outputs.pop("out", None)
    rstd = outputs.pop("rstd", None)
    residual_out = outputs.pop("residual_out", None)
    assert not outputs
    out = poison(x.shape, x.dtype) if out is None else out
    rstd = poison((rows,), F32) if rstd is None else rstd
    kwargs = dict(residual=residual, out=out, rstd=rstd, weight_offset=weight_offset)
    if residual is not None:
        residual_out = poison(x.shape, x.dtype) if residual_out is None else residual_out
        kwargs["residual_out"] = residual_out
    result = cake_rmsnorm_train_forward(x, w, eps, **kwargs)
    assert isinstance(result, tuple) and len(result) == (2 if residual is None else 3)
    assert_bitwise_equal(out, result[0], "out= buffer")
    assert_bitwise_equal(rstd, result[1], "rstd= buffer")
    if residual is not None:
        assert_bitwise_equal(residual_out, result[2], "residual_out= buffer")
    return result


def check_forward(x, w, result, residual=None, weight_offset=0.0, eps=EPS):
    """Shapes, dtypes and errors of a forward result against the FP64 reference."""
    dtype = x.dtype
    rows = math.prod(x.shape[:-1])
    y, rstd = result[0], result[1]
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert rstd.shape == (rows,) and rstd.dtype == F32
    y_ref, rstd_ref, h_ref = forward_reference(x, w, eps, residual=residual, weight_offset=weight_offset)
    if residual is not None:
        h_new = result[2]
        assert h_new.shape == x.shape and h_new.dtype == dtype
        assert_bitwise_equal(h_new, (x.float() + residual.float()).to(dtype), "h_new")
    if rows == 0:
        return
    assert torch.isfinite(y).all(), "y has non-finite values"
    assert torch.isfinite(rstd).all(), "rstd has non-finite values"
    e_y = rel_error(y, y_ref)
    assert e_y <= tolerance(dtype), f"y rel error {e_y:.3g} > {tolerance(dtype):g}"
    if dtype != F32:
        assert_within_one_ulp(y, y_ref, dtype, what="y")
    r_err = ((rstd.double() - rstd_ref) / rstd_ref).abs().max().item()
    assert r_err <= RSTD_TOL, f"rstd max rel error {r_err:.3g} > {RSTD_TOL:g}"


def make_inputs(shape, dtype, residual, w_dtype=None, device=None):
    device = DEV if device is None else device
    x = torch.randn(shape, device=device).to(dtype)
    w = rand_weight(shape[-1], w_dtype or dtype, device)
    res = torch.randn(shape, device=device).to(dtype) if residual else None
    return x, w, res


# ------------------------------------------------------------------------------------------------ grid


@pytest.mark.parametrize("dtype, hidden, residual, rows", GRID)
def test_forward_matches_fp64(dtype, hidden, residual, rows):
    x, w, res = make_inputs((rows, hidden), dtype, residual)
    result = run_forward(x, w, residual=res)
    check_forward(x, w, result, residual=res)


# ------------------------------------------------------------------------------------ dtypes / offset


@pytest.mark.parametrize(
    "dtype, hidden, residual",
    [
        (torch.bfloat16, 4096, False),
        (torch.bfloat16, 4096, True),
        (torch.bfloat16, 65536, False),
        (torch.float16, 4097, False),
        (torch.float16, 4097, True),
        (torch.float16, 7, False),
    ],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_forward_fp32_weight_with_half_activations(dtype, hidden, residual):
    x, w, res = make_inputs((129, hidden), dtype, residual, w_dtype=F32)
    assert w.dtype == F32
    # A weight that is not representable in dtype: the kernel must read it as FP32.
    w = w + 1e-3 * torch.randn_like(w)
    result = run_forward(x, w, residual=res)
    assert result[0].dtype == dtype
    check_forward(x, w, result, residual=res)
    # Rounding w to the activation dtype first gives a (slightly) different y: w really is read in FP32.
    y_rounded_w = run_forward(x, w.to(dtype), residual=res)[0]
    assert not torch.equal(result[0], y_rounded_w)


@pytest.mark.parametrize(
    "dtype, hidden, residual",
    [
        (torch.bfloat16, 4096, False),
        (torch.bfloat16, 4096, True),
        (torch.float16, 4096, False),
        (torch.float32, 1000, False),
        (torch.float32, 1000, True),
        (torch.bfloat16, 65536, False),
    ],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_forward_weight_offset_one(dtype, hidden, residual):
    """Gemma's (1 + w): w near 0, so a missing offset would be a gross error."""
    x, _, res = make_inputs((129, hidden), dtype, residual)
    w = (0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    result = run_forward(x, w, residual=res, weight_offset=1.0)
    check_forward(x, w, result, residual=res, weight_offset=1.0)
    y_ref_no_offset, _, _ = forward_reference(x, w, EPS, residual=res)
    assert rel_error(result[0], y_ref_no_offset) > 0.5


# ----------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("shape", [(2, 3, 4096), (2, 1, 3, 4096), (2, 3, 7), (3, 1, 5120)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_nd_inputs(shape, residual):
    dtype = torch.bfloat16
    x, w, res = make_inputs(shape, dtype, residual)
    result = run_forward(x, w, residual=res)
    assert result[0].shape == shape and result[1].shape == (math.prod(shape[:-1]),)
    check_forward(x, w, result, residual=res)
    # Same bits as the 2-D call on the flattened rows.
    flat = run_forward(
        x.reshape(-1, shape[-1]), w, residual=None if res is None else res.reshape(-1, shape[-1])
    )
    for a, b in zip(result, flat):
        assert_bitwise_equal(a.reshape(b.shape), b, "N-D vs 2-D")


@pytest.mark.parametrize("shape", [(0, 4096), (2, 0, 4096), (0, 7), (0, 262144)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_empty_rows_return_empty_outputs(shape, residual):
    dtype = torch.bfloat16
    x, w, res = make_inputs(shape, dtype, residual)
    result = cake_rmsnorm_train_forward(x, w, EPS, residual=res)
    assert len(result) == (3 if residual else 2)
    assert result[0].shape == shape and result[0].dtype == dtype and result[0].device == x.device
    assert result[1].shape == (0,) and result[1].dtype == F32 and result[1].device == x.device
    if residual:
        assert result[2].shape == shape and result[2].dtype == dtype
    torch.cuda.synchronize()


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_empty_rows_launch_nothing(residual):
    dtype, hidden = torch.bfloat16, 4096
    x0, w, r0 = make_inputs((0, hidden), dtype, residual)
    x1, _, r1 = make_inputs((1, hidden), dtype, residual)
    # Positive control first (also compiles/loads the kernel outside the profiled call).
    launched = foreign_cuda_kernels(lambda: cake_rmsnorm_train_forward(x1, w, EPS, residual=r1))
    if not launched:
        pytest.skip("the profiler does not see the forward kernel here; cannot count launches")
    launched = foreign_cuda_kernels(lambda: cake_rmsnorm_train_forward(x0, w, EPS, residual=r0))
    assert launched == [], f"T = 0 launched {launched}"


def test_forward_h1_column_view():
    """H = 1 as a column of a transposed tensor: the size-1 last dim has stride T, not 1."""
    rows = 129
    x = torch.randn(1, rows, device=DEV).t()
    assert x.shape == (rows, 1) and x.stride() == (1, rows)
    w = rand_weight(1, F32)
    result = run_forward(x, w)
    check_forward(x, w, result)
    assert_bitwise_equal(result[0], run_forward(x.contiguous(), w)[0], "column view vs contiguous")


# ---------------------------------------------------------------------------------------------- layouts


def _padded(rows, hidden, dtype, pad_bytes=16, offset_elems=0):
    """A (rows, hidden) view of a wider buffer: row stride = hidden + pad (a 16-byte multiple when
    hidden is), base offset ``offset_elems``."""
    pad = pad_bytes // torch.empty(0, dtype=dtype).element_size()
    big = torch.randn(rows, hidden + pad + offset_elems, device=DEV).to(dtype)
    return big[:, offset_elems : offset_elems + hidden]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("hidden", [4096, 5120, 65536])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_strided_rows_read_in_place(dtype, hidden, residual):
    rows = 129
    x = _padded(rows, hidden, dtype)
    assert not x.is_contiguous() and x.stride(0) * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0
    w = rand_weight(hidden, dtype)
    res = _padded(rows, hidden, dtype, pad_bytes=32) if residual else None
    outs = dict(out=poison(x.shape, dtype), rstd=poison((rows,), F32))
    if residual:
        outs["residual_out"] = poison(x.shape, dtype)
    # Only the bare call is measured (the checks below allocate comparison temporaries).
    extra = peak_extra_bytes(lambda: cake_rmsnorm_train_forward(x, w, EPS, residual=res, **outs))
    tensor_bytes = rows * hidden * x.element_size()
    assert extra < tensor_bytes // 2, f"the strided input was copied ({extra} extra bytes allocated)"
    result = run_forward(x, w, residual=res, **outs)
    check_forward(x, w, result, residual=res)
    contiguous = run_forward(x.contiguous(), w, residual=None if res is None else res.contiguous())
    for a, b in zip(result, contiguous):
        assert_bitwise_equal(a, b, "strided vs contiguous input")


@pytest.mark.parametrize(
    "layout",
    ["misaligned-base", "odd-row-stride", "non-collapsible-3d", "column-major"],
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_layouts_that_must_be_copied(layout, residual):
    dtype, hidden, rows = torch.bfloat16, 4096, 129
    if layout == "misaligned-base":
        x = _padded(rows, hidden, dtype, offset_elems=1)  # base 2 bytes off a 16-byte boundary
        assert x.data_ptr() % 16 != 0
    elif layout == "odd-row-stride":
        x = torch.randn(rows, hidden + 1, device=DEV).to(dtype)[:, :hidden]  # row stride not a 16 B multiple
    elif layout == "non-collapsible-3d":
        x = (
            torch.randn(3, 43, hidden, device=DEV).to(dtype).transpose(0, 1)
        )  # (43, 3, H): no single row stride
    else:
        x = torch.randn(hidden, rows, device=DEV).to(dtype).t()  # last dim not contiguous
    w = rand_weight(hidden, dtype)
    res = torch.randn(x.shape, device=DEV).to(dtype) if residual else None
    result = run_forward(x, w, residual=res)
    check_forward(x, w, result, residual=res)
    contiguous = run_forward(x.contiguous(), w, residual=res)
    for a, b in zip(result, contiguous):
        assert_bitwise_equal(a, b, f"{layout} vs contiguous input")


@pytest.mark.parametrize(
    "dtype, hidden",
    [(torch.bfloat16, 4096), (torch.float32, 4097), (torch.float16, 65536)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_expanded_inputs(dtype, hidden, residual):
    rows = 129 if hidden >= WIDE else 1024
    x = torch.randn(1, hidden, device=DEV).to(dtype).expand(rows, hidden)
    assert x.stride(0) == 0
    w = rand_weight(hidden, dtype)
    res = torch.randn(1, hidden, device=DEV).to(dtype).expand(rows, hidden) if residual else None
    outs = dict(out=poison(x.shape, dtype), rstd=poison((rows,), F32))
    if residual:
        outs["residual_out"] = poison(x.shape, dtype)
    extra = peak_extra_bytes(lambda: cake_rmsnorm_train_forward(x, w, EPS, residual=res, **outs))
    assert extra < rows * hidden * x.element_size() // 2, f"expanded input was materialized ({extra} bytes)"
    result = run_forward(x, w, residual=res, **outs)
    check_forward(x, w, result, residual=res)
    single = run_forward(x[:1].contiguous(), w, residual=None if res is None else res[:1].contiguous())
    for a, b in zip(result, single):
        assert_bitwise_equal(a, b.expand_as(a), "expanded rows vs one row")


def test_forward_strided_weight_is_read_correctly():
    dtype, hidden, rows = torch.bfloat16, 4096, 129
    x, _, _ = make_inputs((rows, hidden), dtype, False)
    w_big = rand_weight(2 * hidden + 1, dtype)
    for w in (w_big[::2][:hidden], w_big[1 : hidden + 1]):  # strided; contiguous but 2 bytes off alignment
        result = run_forward(x, w)
        check_forward(x, w, result)
        assert_bitwise_equal(
            result[0], run_forward(x, w.contiguous().clone())[0], "strided w vs contiguous w"
        )


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_non_contiguous_and_misaligned_outputs_receive_the_result(residual):
    dtype, hidden, rows = torch.bfloat16, 4096, 129
    x, w, res = make_inputs((rows, hidden), dtype, residual)
    expected = run_forward(x, w, residual=res)

    transposed = dict(
        out=poison_(torch.empty(hidden, rows, device=DEV, dtype=dtype).t()),
        rstd=poison_(torch.empty(2 * rows, device=DEV)[::2]),
    )
    flat = torch.empty(rows * hidden + 1, device=DEV, dtype=dtype)
    misaligned = dict(
        out=poison_(flat[1:].view(rows, hidden)), rstd=poison_(torch.empty(rows + 1, device=DEV)[1:])
    )
    if residual:
        transposed["residual_out"] = poison_(torch.empty(hidden, rows, device=DEV, dtype=dtype).t())
        flat2 = torch.empty(rows * hidden + 1, device=DEV, dtype=dtype)
        misaligned["residual_out"] = poison_(flat2[1:].view(rows, hidden))
    for outs in (transposed, misaligned):
        assert not outs["out"].is_contiguous() or outs["out"].data_ptr() % 16 != 0
        result = run_forward(x, w, residual=res, **outs)  # checks the buffers hold the returned values
        for a, b in zip(result, expected):
            assert_bitwise_equal(a, b, "result through a non-direct output")
        for name, buf in outs.items():
            assert not torch.isnan(buf).any(), f"{name}= buffer was not fully written"


def test_forward_direct_outputs_are_written_in_place():
    """Contiguous aligned outputs are the returned tensors (no hidden copy)."""
    dtype, hidden, rows = torch.bfloat16, 4096, 129
    x, w, res = make_inputs((rows, hidden), dtype, True)
    out, rstd, h = poison(x.shape, dtype), poison((rows,), F32), poison(x.shape, dtype)
    y, r, h_new = cake_rmsnorm_train_forward(x, w, EPS, residual=res, out=out, rstd=rstd, residual_out=h)
    assert (
        y.data_ptr() == out.data_ptr()
        and r.data_ptr() == rstd.data_ptr()
        and h_new.data_ptr() == h.data_ptr()
    )


# ---------------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("dtype, hidden", INVARIANCE_SHAPES, ids=lambda v: DTYPE_IDS.get(v, str(v)))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
def test_forward_batch_invariance(dtype, hidden, residual):
    """Row ``r``'s y, rstd and h_new have the same bits alone, in a batch of 129 (at two positions)
    and in a batch of 4096 (129 and 33 rows for H >= 65536)."""
    big_rows, mid_rows = (4096, 129) if hidden < WIDE else (129, 33)
    x, w, res = make_inputs((big_rows, hidden), dtype, residual)
    r = big_rows - mid_rows - 5  # far from the start of the big batch; every window below fits
    full = run_forward(x, w, residual=res)

    def rows_of(lo, n):
        xs = x[lo : lo + n].clone()
        rs = None if res is None else res[lo : lo + n].clone()
        return run_forward(xs, w, residual=rs)

    variants = {
        "alone": (rows_of(r, 1), 0),
        "first of a mid batch": (rows_of(r, mid_rows), 0),
        "inside a mid batch": (rows_of(r - 17, mid_rows), 17),
        "last of a mid batch": (rows_of(r - mid_rows + 1, mid_rows), mid_rows - 1),
    }
    for label, (result, pos) in variants.items():
        for name, a, b in zip(("y", "rstd", "h_new"), result, full):
            assert_bitwise_equal(a[pos], b[r], f"{name} of row {r} ({label})")


def test_forward_no_recompile_when_rows_change():
    from cake_cute.runtime import cache as compile_cache

    dtype, hidden = torch.bfloat16, 4096
    w = rand_weight(hidden, dtype)
    run_forward(torch.randn(3, hidden, device=DEV).to(dtype), w)  # compiled or loaded here
    before = compile_cache.compile_count
    for rows in (1, 2, 129, 4096, 0, 77):
        run_forward(torch.randn(rows, hidden, device=DEV).to(dtype), w)
    assert compile_cache.compile_count == before


def test_forward_is_deterministic():
    dtype, hidden, rows = torch.bfloat16, 8192, 4096
    x, w, res = make_inputs((rows, hidden), dtype, True)
    first = run_forward(x, w, residual=res)
    for _ in range(3):
        again = run_forward(x, w, residual=res)
        for a, b in zip(again, first):
            assert_bitwise_equal(a, b, "repeated forward")
