"""FP8 forward on the GPU: the kernel's data and scale bytes bitwise equal to the torch reference.

Every output the kernel path allocates is NaN / 0xFF-poisoned first (``launch_fp8._empty``), so an element it
fails to write shows up. The reference quantizes the FP32 normalized value computed from the kernel's
own h_new (residual mode) and rstd: a torch sum of squares does not reproduce the kernel's fixed
reduction order, so rstd itself is checked against FP64 (1e-5 relative, per row) and bitwise against
the plain forward's (the two share tiling and row sum), h_new bitwise against round(x + residual), and
everything after rstd bitwise. NaN bytes compare equal whatever their sign bit (the CPU's and the GPU's
default NaNs differ in sign).
"""

from __future__ import annotations

import pytest
import torch

from cake_cute import cake_rmsnorm_fp8, cake_rmsnorm_train_forward, fp8, fp8_numerics, launch_fp8
from cake_cute.reference import forward_reference
from cake_cute.runtime import launch_plan, native
from cake_cute.runtime.device import device_facts

from ._helpers import DTYPE_IDS, DTYPES, EPS, fixed_seed, poison, rand_weight  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

DEV = "cuda"
# The widest: rows over clusters (131064: 8 CTAs, a ragged last slice and a partial last block).
HIDDEN = (1, 7, 31, 33, 127, 129, 4096, 4097, 16384, 32768, 65537, 131064)
ROWS = (0, 1, 2, 129)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(launch_fp8, "_empty", lambda shape, dtype, device: poison(shape, dtype, device))


@pytest.fixture(scope="module", autouse=True)
def prewarm_fp8_kernels():
    """Compile this module's variants in parallel up front (a cold cache costs ~1 s per variant)."""
    import io
    import os

    from cake_cute.tools.warmup import local_archs, warm

    names = tuple(DTYPE_IDS.values())
    specs = fp8.fp8_variant_specs(local_archs(), names, HIDDEN)
    warm(specs, jobs=min(16, os.cpu_count() or 1), progress=io.StringIO())


def _scale_bits(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.float32:
        return torch.where(torch.isnan(scales), float("nan"), scales).view(torch.int32)  # one NaN pattern
    return scales.view(torch.uint8)


def _assert_matches_reference(out, x, w, residual, recipe, emit_y, weight_offset=0.0):
    h = x if residual is None else out.h_new
    if residual is not None:
        expected_h = (x.float() + residual.float()).to(x.dtype)
        assert torch.equal(out.h_new.view(-1).view(torch.uint8), expected_h.view(-1).view(torch.uint8))
    _, rstd64, _ = forward_reference(h, w, EPS, weight_offset=weight_offset)
    finite = torch.isfinite(rstd64)
    assert torch.allclose(out.rstd[finite].double(), rstd64[finite], rtol=1e-5, atol=0)
    plain_rstd = cake_rmsnorm_train_forward(x, w, EPS, residual=residual, weight_offset=weight_offset)[1]
    assert torch.equal(out.rstd.view(torch.int32), plain_rstd.view(torch.int32)), "rstd: the plain forward's"
    data, scales, y, _, _ = fp8_numerics.rmsnorm_fp8_reference(
        h, w, EPS, None, recipe, emit_y, weight_offset, rstd=out.rstd
    )
    assert torch.equal(fp8_numerics.canonical_nan_bytes(out.data), fp8_numerics.canonical_nan_bytes(data)), (
        "e4m3 data"
    )
    assert torch.equal(_scale_bits(out.scales), _scale_bits(scales)), "scales"
    if emit_y:
        assert torch.equal(out.y.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), "y"


def _activations(rows, hidden, dtype, residual):
    """Rows of very different magnitudes, so scales span many exponents."""
    magnitude = torch.logspace(-8, 8, max(rows, 1), base=2.0, device=DEV)[:rows].reshape(rows, 1)
    x = (torch.randn(rows, hidden, device=DEV) * magnitude).to(dtype)
    r = torch.randn(rows, hidden, device=DEV, dtype=dtype) if residual else None
    return x, r


@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
@pytest.mark.parametrize("emit_y", [False, True], ids=["q", "q+y"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_bitwise_equal_to_reference(dtype, hidden, residual, emit_y, recipe):
    w = rand_weight(hidden, dtype)
    for rows in ROWS if hidden < 65536 else (0, 1, 2, 33):
        x, r = _activations(rows, hidden, dtype, residual)
        out = cake_rmsnorm_fp8(x, w, EPS, residual=r, recipe=recipe, emit_y=emit_y)
        assert out.data.shape == x.shape and out.scales.shape == (
            rows,
            fp8_numerics.scale_blocks(hidden, recipe),
        )
        _assert_matches_reference(out, x, w, r, recipe, emit_y)


@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
@pytest.mark.parametrize("emit_y", [False, True], ids=["q", "q+y"])
@pytest.mark.parametrize("w_dtype", ["act", "fp32"])
@pytest.mark.parametrize(
    "dtype, hidden",
    [(d, h) for d in DTYPES[:2] for h in (1, 7, 1001, 4096, 4097, 7168, 16384)]
    + [(DTYPES[2], h) for h in (256, 1024, 2048, 2560, 4096, 8192)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_persistent_and_one_tile_kernels_agree_bitwise(dtype, hidden, w_dtype, emit_y, recipe, monkeypatch):
    """Up to ``launch_plan.fp8_persistent_rows`` rows (rows one CTA holds; FP32 ones in 16-byte vectors up
    to 8192 elements) persistent programs run the forward, each over several row tiles here; one CTA
    per tile runs it above. Every output of every row is the same bytes either way (batch invariance
    across the switch), and the reference's."""
    monkeypatch.setattr(native, "register_fp8", lambda *args: None)  # keep the C++ rule untouched
    rows = 2000 if hidden < 16384 else 700
    facts = device_facts(torch.device(DEV))
    programs = launch_plan.fp8_forward_programs(rows, hidden, DTYPE_IDS[dtype], False, facts)
    assert programs > 0, "the persistent kernel must be the one under test"
    x, _ = _activations(rows, hidden, dtype, False)
    w = rand_weight(hidden, dtype if w_dtype == "act" else torch.float32)
    persistent = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe, emit_y=emit_y)
    _assert_matches_reference(persistent, x, w, None, recipe, emit_y)
    monkeypatch.setattr(launch_plan, "PERSISTENT_FP8_MAX_BYTES", 0)
    assert launch_plan.fp8_forward_programs(rows, hidden, DTYPE_IDS[dtype], False, facts) == 0
    one_tile = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe, emit_y=emit_y)
    for name in ("data", "scales", "rstd") + (("y",) if emit_y else ()):
        got, want = (
            getattr(out, name).contiguous().view(-1).view(torch.uint8) for out in (one_tile, persistent)
        )
        assert torch.equal(got, want), name


@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_gemma_offset_and_fp32_weight(dtype, recipe):
    hidden = 4096
    x, _ = _activations(64, hidden, dtype, False)
    w = rand_weight(hidden, torch.float32) - 1.0
    out = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe, weight_offset=1.0)
    _assert_matches_reference(out, x, w, None, recipe, False, weight_offset=1.0)


@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
@pytest.mark.parametrize("hidden", [129, 4096, 65537])
def test_nan_and_inf_rows_stay_in_their_rows(recipe, hidden):
    x, _ = _activations(6, hidden, torch.bfloat16, False)
    x[1, hidden // 2] = float("nan")
    x[4, 0] = float("inf")
    w = rand_weight(hidden, torch.bfloat16)
    out = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe)
    _assert_matches_reference(out, x, w, None, recipe, False)
    clean = [0, 2, 3, 5]
    assert not torch.isnan(out.data[clean].float()).any()
    assert torch.isnan(out.data[1].float()).all()


@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
@pytest.mark.parametrize("hidden", [4096, 16384])
def test_scales_span_the_e8m0_range(recipe, hidden):
    """Weights from 2^-130 to 2^100 along H put the blocks' amax / 448 anywhere from FP32 subnormals
    to 2^93, so the kernel's division-free scale exponent meets every rounding regime of the
    reference's division."""
    x, _ = _activations(64, hidden, torch.bfloat16, False)
    w = torch.exp2(torch.linspace(-130.0, 100.0, hidden, device=DEV)).to(torch.bfloat16)
    out = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe)
    _assert_matches_reference(out, x, w, None, recipe, False)
    exponents = (out.scales.view(torch.int32) >> 23) if recipe == "1x128" else out.scales.view(torch.uint8)
    assert int(exponents.min()) <= 1 and int(exponents.max()) >= 215


@pytest.mark.parametrize("layout, recipe", [("cublas", "mxfp8"), ("deepgemm", "1x128")])
def test_gemm_layouts_round_trip_on_device(layout, recipe):
    x, _ = _activations(300, 4096, torch.bfloat16, False)
    w = rand_weight(4096, torch.bfloat16)
    compact = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe).scales
    gemm = cake_rmsnorm_fp8(x, w, EPS, recipe=recipe, scale_layout=layout).scales
    back = (
        fp8_numerics.from_cublas_mx_scales(gemm, 300, 128)
        if layout == "cublas"
        else fp8_numerics.from_deepgemm_scales(gemm)
    )
    assert torch.equal(_scale_bits(back), _scale_bits(compact))


def test_gradients_match_the_plain_rmsnorm():
    """The FP8 forward's y handle backpropagates exactly what cake_rmsnorm's y does."""
    from cake_cute import cake_rmsnorm

    x, r = _activations(257, 4096, torch.bfloat16, True)
    w = rand_weight(4096, torch.bfloat16)
    g = torch.randn_like(x)
    leaves = [t.clone().requires_grad_() for t in (x, w, r)]
    out = cake_rmsnorm_fp8(*leaves[:2], EPS, residual=leaves[2])
    got = torch.autograd.grad((out.y * g).sum() + out.h_new.float().sum(), leaves)
    leaves = [t.clone().requires_grad_() for t in (x, w, r)]
    y, h_new = cake_rmsnorm(*leaves[:2], EPS, residual=leaves[2])
    want = torch.autograd.grad((y * g).sum() + h_new.float().sum(), leaves)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_matches_eager():
    x, r = _activations(64, 4096, torch.bfloat16, True)
    w = rand_weight(4096, torch.bfloat16)

    def step(x, w, r):
        out = cake_rmsnorm_fp8(x, w, EPS, residual=r, recipe="mxfp8", emit_y=True)
        return out.data, out.scales, out.y, out.h_new

    eager = step(x, w, r)
    compiled = torch.compile(step, fullgraph=True)(x, w, r)
    for a, b in zip(compiled, eager):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("hidden", [4096, 4097])
def test_agrees_with_torchao_mx_quantizer(hidden):
    """torchao's MX quantizer (RCEIL scales) on the same FP32 normalized values, when installed."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    if hidden % 32:
        pytest.skip("torchao's quantizer needs whole blocks")
    x, _ = _activations(128, hidden, torch.bfloat16, False)
    w = rand_weight(hidden, torch.bfloat16)
    out = cake_rmsnorm_fp8(x, w, EPS, recipe="mxfp8")
    y32, _, _ = fp8_numerics.normalized_reference(x, w, EPS, rstd=out.rstd)
    scale, data = mx.to_mx(y32, torch.float8_e4m3fn, 32, config.ScaleCalculationMode.RCEIL)
    # torchao takes ceil(log2(amax / 448)) in FP32, which can miss by one when amax / 448 is within
    # a few FP32 ulps above a power of two; such blocks are left out (cake rounds those exactly).
    quotient = y32.reshape(128, -1, 32).abs().amax(dim=-1) / 448.0
    mantissa = torch.frexp(quotient).mantissa
    clear = (mantissa - 0.5).abs() > 1e-5
    assert clear.float().mean() > 0.99
    got_scale = scale.view(torch.uint8).reshape(out.scales.shape)
    assert torch.equal(got_scale[clear], out.scales.view(torch.uint8)[clear])
    blocks = lambda t: t.view(torch.uint8).reshape(128, -1, 32)[clear]  # noqa: E731
    assert torch.equal(blocks(data), blocks(out.data))
