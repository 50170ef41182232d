"""FP8 forward without a GPU: the torch reference against an independent computation, E8M0 rounding
edge cases, the scale-layout converters, argument checks, autograd and torch.compile on CPU tensors,
and every quantizing kernel variant compiled for sm_90a and sm_100a with its SASS checked."""

from __future__ import annotations

import math

import pytest
import torch

from cake_cute import cake_rmsnorm_fp8, fp8, fp8_numerics
from cake_cute.kernels.quant_config import E4M3_MAX, QUANT_RECIPES
from cake_cute.tools.cubin import spill_free
from cake_cute.tools.kernel_report import collect_reports, programs_fit
from cake_cute.tools.warmup import warm
from cake_cute.vocab import dtype_bytes

F32 = torch.float32
NAN_BYTES = (0x7F, 0xFF)  # e4m3fn NaN with either sign


def _e(amax: float) -> int:
    return int(fp8_numerics.e8m0_round_up(torch.tensor([amax], dtype=F32))[0])


@pytest.mark.parametrize(
    "amax, expected",
    [
        (448.0, 127),  # amax / 448 = 1 exactly: no rounding up
        (448.0 * 2**-10, 117),  # exact powers of two stay
        (448.0 * 1.0001, 128),  # just above a power of two rounds up
        (448.0 * 0.75, 127),
        (1.0, 127 - 8),  # 1/448 = 2^-8.8 -> 2^-8
        (0.0, 0),  # amax 0: 2^-127, the smallest E8M0 value (data is all zeros)
        (2.0**-149, 0),  # subnormal quotients round up to 2^-127 ...
        (448.0 * 2**-127, 0),  # ... which is exactly representable,
        (448.0 * 2**-127 * 1.5, 1),  # ... or to 2^-126 above it
        (float("inf"), 254),  # saturated: 2^127
        (3.4028234663852886e38, 247),  # the largest float / 448 -> 2^120
        (float("nan"), 255),
    ],
)
def test_e8m0_rounds_up(amax, expected):
    assert _e(amax) == expected


def test_e8m0_agrees_with_log2_on_normal_values():
    amax = torch.logspace(-30, 30, 5001, base=2.0, dtype=torch.float64).float()
    quotient = (amax / E4M3_MAX).double()  # the same FP32 division, then exact log2 in FP64
    expected = torch.ceil(torch.log2(quotient)).int() + 127
    assert torch.equal(fp8_numerics.e8m0_round_up(amax), expected)


def _patterns_around_every_rounding_edge() -> torch.Tensor:
    """Non-negative FP32 bit patterns: every exponent field with the significands where the rounding
    of amax / 448 changes (around 1.75 = 0x600000) and at the ends of the binade, 64 random ones per
    exponent, every pattern of the two binades where amax / 448 leaves the subnormals (exponent
    fields 8 and 9), and NaN and infinity."""
    exponents = torch.arange(256, dtype=torch.int32).reshape(-1, 1) << 23
    edges = torch.tensor([0, 1, 2, 0x5FFFFF, 0x600000, 0x600001, 0x600002, 0x7FFFFE, 0x7FFFFF])
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(0, 1 << 23, (256, 64), generator=generator, dtype=torch.int32)
    transition = torch.arange(8 << 23, 10 << 23, dtype=torch.int32)
    return torch.cat([(exponents | edges.int()).flatten(), (exponents | random).flatten(), transition])


def test_e8m0_from_bits_equals_the_division():
    """The kernel's division-free formula (``e8m0_round_up_from_bits``) against the division (an
    exhaustive run over all 2^31 non-negative patterns agreed too; it takes minutes)."""
    bits = _patterns_around_every_rounding_edge()
    expected = fp8_numerics.e8m0_round_up(bits)
    got = fp8_numerics.e8m0_round_up_from_bits(bits)
    wrong = (got != expected).nonzero().flatten()[:5]
    assert wrong.numel() == 0, [(hex(int(bits[i])), int(got[i]), int(expected[i])) for i in wrong]


def test_inverse_scale_is_exact():
    e = torch.arange(0, 255, dtype=torch.int32)
    expected = torch.tensor([math.ldexp(1.0, 127 - int(k)) for k in e], dtype=torch.float64)
    assert torch.equal(fp8_numerics.inverse_scale(e).double(), expected)
    assert torch.isnan(fp8_numerics.inverse_scale(torch.tensor([255], dtype=torch.int32))).all()


def _independent_quantize(y: torch.Tensor, block: int, fp32_scales: bool):
    """Straightforward per-block loop in FP64: scale = 2^ceil(log2(fp32(amax / 448))), data =
    e4m3(clamp(y / scale)); for finite, non-zero blocks of normal values."""
    rows, hidden = y.shape
    data = torch.empty_like(y, dtype=torch.float8_e4m3fn)
    scales = []
    for t in range(rows):
        row_scales = []
        for start in range(0, hidden, block):
            chunk = y[t, start : start + block]
            quotient = float(torch.tensor(chunk.abs().max().item(), dtype=F32) / 448.0)
            exponent = max(math.ceil(math.log2(quotient)), -126 if fp32_scales else -127)
            scale = math.ldexp(1.0, exponent)
            data[t, start : start + block] = (chunk.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            row_scales.append(scale if fp32_scales else exponent + 127)
        scales.append(row_scales)
    return data, torch.tensor(scales, dtype=F32 if fp32_scales else torch.int32)


@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
@pytest.mark.parametrize("hidden", [1, 31, 33, 128, 300])
def test_reference_matches_an_independent_quantizer(recipe, hidden):
    y = torch.randn(3, hidden, dtype=F32) * torch.logspace(-6, 6, 3, base=2.0).reshape(3, 1)
    y[1, :5] *= 1000  # one row with a few outliers: those blocks' scales go up
    data, scales = fp8_numerics.quantize_rows_reference(y, recipe)
    block, fp32_scales = QUANT_RECIPES[recipe]
    expected_data, expected_scales = _independent_quantize(y, block, fp32_scales)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    got = scales if fp32_scales else scales.view(torch.uint8).int()
    assert torch.equal(got, expected_scales)
    assert scales.shape == (3, -(-hidden // block))


def test_padding_blocks_are_shorter_and_zero_filled():
    """The last block of H = 40 holds 8 columns; its amax is theirs alone."""
    y = torch.zeros(1, 40)
    y[0, :32] = 1000.0
    y[0, 32:] = 1.0
    _, scales = fp8_numerics.quantize_rows_reference(y, "mxfp8")
    assert scales.view(torch.uint8).tolist() == [[_e(1000.0), _e(1.0)]]


def test_saturation_and_zero_blocks():
    y = torch.zeros(2, 32)
    y[0, 0] = 448.0 * 1.01  # scale 2: 452.5 / 2 = 226 fits; the values stay below 448
    y[1, :] = 0.0
    data, scales = fp8_numerics.quantize_rows_reference(y, "mxfp8")
    assert scales.view(torch.uint8)[:, 0].tolist() == [128, 0]
    assert data.float()[0, 0].item() == 224.0 and not data.float()[1].any()
    _, fp32_scales = fp8_numerics.quantize_rows_reference(y, "1x128")
    assert fp32_scales[1, 0].item() == 1.0  # an all-zero 1x128 block gets scale 1


def test_nan_and_inf_rows_stay_in_their_rows():
    x = torch.randn(4, 96)
    w = torch.rand(96) + 0.5
    x[1, 3] = float("nan")
    x[2, 50] = float("inf")
    data, scales, _, rstd, _ = fp8_numerics.rmsnorm_fp8_reference(x, w, 1e-6, recipe="mxfp8")
    q = data.view(torch.uint8)
    clean = [0, 3]
    assert not torch.isin(q[clean], torch.tensor(NAN_BYTES, dtype=torch.uint8)).any()
    assert torch.isnan(data[1].float()).all() and (scales.view(torch.uint8)[1] == 255).all()
    # An infinity sends rstd to 0: its block (columns 32-63) is NaN (inf * 0), the other blocks 0.
    assert rstd[2] == 0 and torch.isnan(data[2, 32:64].float()).all()
    assert not data[2, :32].float().any() and not data[2, 64:].float().any()
    assert scales.view(torch.uint8)[2].tolist() == [0, 255, 0]


def test_dequantized_error_is_within_e4m3_rounding():
    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    w = torch.randn(4096, dtype=torch.bfloat16)
    for recipe in fp8_numerics.RECIPES:
        data, scales, _, rstd, _ = fp8_numerics.rmsnorm_fp8_reference(x, w, 1e-6, recipe=recipe)
        y, _, _ = fp8_numerics.normalized_reference(x, w, 1e-6, rstd=rstd)
        err = (fp8_numerics.dequantize_rows(data, scales, recipe) - y).abs()
        bound = (
            fp8_numerics.dequantize_rows(torch.ones_like(data), scales, recipe) * 448 * 2**-4
        )  # half an ulp at 448
        assert (err <= bound).all()


# ---------------------------------------------------------------------------------------- layouts


def _cublas_offset(r: int, c: int, col_tiles: int) -> int:
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("rows, blocks", [(1, 1), (5, 3), (128, 4), (130, 9), (300, 128)])
def test_cublas_layout_places_every_scale_and_round_trips(rows, blocks):
    compact = torch.randint(0, 255, (rows, blocks), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    swizzled = fp8_numerics.to_cublas_mx_scales(compact)
    prows, pcols = -(-rows // 128) * 128, -(-blocks // 4) * 4
    assert swizzled.shape == (prows, pcols) and swizzled.dtype == torch.float8_e8m0fnu
    flat = swizzled.view(torch.uint8).reshape(-1)
    src = compact.view(torch.uint8)
    for r, c in [(0, 0), (rows - 1, blocks - 1), (rows // 2, blocks // 2), (min(rows - 1, 33), 0)]:
        assert flat[_cublas_offset(r, c, pcols // 4)] == src[r, c]
    assert int(flat.sum()) == int(src.sum(dtype=torch.int64))  # the padding is zero
    assert torch.equal(fp8_numerics.from_cublas_mx_scales(swizzled, rows, blocks).view(torch.uint8), src)


@pytest.mark.parametrize("rows", [1, 4, 5, 129])
def test_deepgemm_layout_is_mn_major_tma_aligned_and_round_trips(rows):
    compact = torch.randn(rows, 3)
    mn_major = fp8_numerics.to_deepgemm_scales(compact)
    assert mn_major.shape == (rows, 3) and mn_major.stride() == (1, -(-rows // 4) * 4)
    assert torch.equal(mn_major, compact)
    assert torch.equal(fp8_numerics.from_deepgemm_scales(mn_major), compact)
    assert fp8_numerics.from_deepgemm_scales(mn_major).is_contiguous()


def test_converters_reject_wrong_inputs():
    with pytest.raises(TypeError, match="scales"):
        fp8_numerics.to_cublas_mx_scales(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="swizzled must have shape"):
        fp8_numerics.from_cublas_mx_scales(
            torch.zeros(128, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu), 129, 1
        )
    with pytest.raises(TypeError, match="scales"):
        fp8_numerics.to_deepgemm_scales(torch.zeros(2, 2, dtype=torch.float16))


# ------------------------------------------------------------------------------ API and validation


def _inputs(rows=3, hidden=64, dtype=torch.bfloat16, residual=False):
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = (torch.rand(hidden, dtype=dtype) + 0.5).requires_grad_()
    r = torch.randn(rows, hidden, dtype=dtype, requires_grad=True) if residual else None
    return x, w, r


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(recipe=32), TypeError, "recipe"),
        (dict(recipe="nvfp4"), ValueError, "recipe"),
        (dict(scale_layout=None), TypeError, "scale_layout"),
        (dict(scale_layout="tiled"), ValueError, "scale_layout"),
        (dict(recipe="1x128", scale_layout="cublas"), ValueError, "scale_layout"),
        (dict(recipe="mxfp8", scale_layout="deepgemm"), ValueError, "scale_layout"),
        (dict(emit_y=1), TypeError, "emit_y"),
        (dict(weight_offset="1"), TypeError, "weight_offset"),
        (dict(eps=-1.0), ValueError, "eps"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    x, w, _ = _inputs()
    with pytest.raises(error, match=match):
        cake_rmsnorm_fp8(x, w, **kwargs)


def test_bad_tensors_name_themselves():
    x, w, _ = _inputs()
    with pytest.raises(TypeError, match="x must have dtype"):
        cake_rmsnorm_fp8(x.to(torch.float64), w)
    with pytest.raises(ValueError, match="w must have shape"):
        cake_rmsnorm_fp8(x, w[:-1])
    with pytest.raises(ValueError, match="residual must have shape"):
        cake_rmsnorm_fp8(x, w, residual=x[:, :-1])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(w=slice(None, -1)), "w must have shape"),
        (dict(recipe="mxfp4"), "recipe must be one of"),
        (dict(eps=float("nan")), "eps must be"),
    ],
)
def test_the_op_called_directly_names_a_bad_argument(change, match):
    """``torch.ops.cake_cute.rmsnorm_fp8_fwd`` is an entry of its own (compiled graphs and users call it)."""
    x, w, _ = _inputs()
    args = dict(x=x, w=w, eps=1e-6, residual=None, recipe="mxfp8", emit_y=False, weight_offset=0.0)
    if "w" in change:
        args["w"] = w[change.pop("w")]
    args.update(change)
    with pytest.raises(ValueError, match=match):
        torch.ops.cake_cute.rmsnorm_fp8_fwd(*args.values())


@pytest.mark.parametrize("recipe, layout", [("mxfp8", "compact"), ("mxfp8", "cublas"), ("1x128", "deepgemm")])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("emit_y", [False, True])
def test_outputs_and_gradients_on_cpu(recipe, layout, residual, emit_y):
    """The op's outputs are the reference's, and the gradient reaching x, residual and w through y is
    torch autograd's of the same FP32 formula."""
    x, w, r = _inputs(rows=5, hidden=200, residual=residual)
    out = cake_rmsnorm_fp8(x, w, 1e-6, residual=r, recipe=recipe, emit_y=emit_y, scale_layout=layout)
    data, scales, y, rstd, h = fp8_numerics.rmsnorm_fp8_reference(
        x.detach(), w.detach(), 1e-6, r, recipe, True
    )
    assert torch.equal(out.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(
        out.scales.contiguous().view(torch.uint8),
        fp8_numerics.to_scale_layout(scales, layout).contiguous().view(torch.uint8),
    )
    assert torch.equal(out.rstd, rstd)
    assert out.y.shape == x.shape and (torch.equal(out.y, y) if emit_y else out.y.stride() == (0, 0))
    assert (out.h_new is not None) == residual
    g = torch.randn(x.shape)
    loss = (out.y.float() * g).sum() + (out.h_new.float().sum() if residual else 0)
    grads = torch.autograd.grad(loss, [t for t in (x, w, r) if t is not None])

    xs, ws, rs = (None if t is None else t.detach().float().requires_grad_() for t in (x, w, r))
    hs = xs if rs is None else xs + rs
    ref = hs * torch.rsqrt(hs.square().mean(-1, keepdim=True) + 1e-6) * ws
    ref_loss = (ref * g).sum() + (hs.sum() if residual else 0)
    ref_grads = torch.autograd.grad(ref_loss, [t for t in (xs, ws, rs) if t is not None])
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).norm() <= 2e-2 * want.norm()


def test_only_h_new_used_passes_its_gradient_through():
    x, w, r = _inputs(residual=True)
    out = cake_rmsnorm_fp8(x, w, residual=r)
    gx, gr = torch.autograd.grad(out.h_new.float().sum(), [x, r])
    assert torch.equal(gx, torch.ones_like(x)) and torch.equal(gr, torch.ones_like(r))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("recipe", fp8_numerics.RECIPES)
def test_op_keeps_the_leading_dims_and_passes_opcheck(recipe, residual):
    """On (2, 3, H) rows every per-row output keeps x's leading dims (rstd (2, 3), scales (2, 3,
    blocks): what DTensor shards), and opcheck's schema, fake-tensor and autograd-registration checks
    pass (its AOT check sums the outputs, which torch's CPU kernels cannot do for FP8 dtypes; the GPU
    tests run it whole)."""
    x = torch.randn(2, 3, 160, requires_grad=True)
    w = torch.randn(160, requires_grad=True)
    r = torch.randn(2, 3, 160) if residual else None
    out = cake_rmsnorm_fp8(x, w, 1e-6, residual=r, recipe=recipe)
    assert out.rstd.shape == (2, 3) and out.scales.shape == (2, 3, fp8_numerics.scale_blocks(160, recipe))
    args = (x, w, 1e-6, r, recipe, True, 0.0)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_fp8_fwd.default, args, test_utils=checks)


def test_torch_compile_with_dynamic_shapes_matches_eager():
    """dynamic=True traces eps as a symbol: the entry leaves its value to the op's fake kernel."""

    def forward(x, w):
        return cake_rmsnorm_fp8(x, w, 1e-6, recipe="mxfp8").data

    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (4, 7):
        x, w, _ = _inputs(rows=rows, hidden=160, residual=False)
        assert torch.equal(compiled(x, w).view(torch.uint8), forward(x, w).view(torch.uint8))


@pytest.mark.parametrize(
    "recipe, layout, backend",
    [("mxfp8", "compact", "aot_eager"), ("1x128", "compact", "aot_eager"), ("1x128", "deepgemm", "inductor")],
)
def test_torch_compile_fullgraph_matches_eager(recipe, layout, backend):
    x, w, r = _inputs(rows=4, hidden=160, residual=True)

    def step(x, w, r):
        out = cake_rmsnorm_fp8(x, w, 1e-6, residual=r, recipe=recipe, scale_layout=layout)
        return (
            out.data.float().sum()
            + out.scales.float().sum()
            + (out.y.float() * 3).sum()
            + out.h_new.float().sum()
        )

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    # Inductor's on-disk caches key a graph by its ops, not by the op's Python autograd formula: an
    # entry from an older formula would be replayed, so this test compiles afresh.
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        loss = compiled(x, w, r)
        got = torch.autograd.grad(loss, [x, w, r])
    want_loss = step(x, w, r)
    want = torch.autograd.grad(want_loss, [x, w, r])
    assert torch.equal(loss, want_loss)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ kernels: compile + SASS


@pytest.mark.parametrize("act_dtype", ["bf16", "fp32"])
def test_every_quant_tiling_nests_with_the_blocks(act_dtype):
    """For every H (fp16 tiles like bf16) the quantizing forward's tiling is the plain forward's and
    nests with both block widths."""
    from cake_cute.kernels.quant_config import blocks_nest, quant_forward_config
    from cake_cute.kernels.tiling import MAX_HIDDEN, forward_tiling

    for hidden in range(1, MAX_HIDDEN + 1):
        tiling = quant_forward_config("sm_90a", act_dtype, hidden, "mxfp8").tiling
        facts = (hidden, tiling.describe())
        assert tiling == forward_tiling(hidden, act_dtype), facts
        assert blocks_nest(tiling, 32) and blocks_nest(tiling, 128), facts
        assert tiling.cluster_n == 1 or tiling.cols_per_cta % 128 == 0, facts


@pytest.mark.parametrize(
    ("amax_scatter", "groups", "lanes", "steps"),
    [(True, 4, 16, 2), (True, 4, 4, 2), (True, 8, 4, 2), (True, 2, 16, 1), (True, 1, 16, 0)]
    + [(True, 3, 16, 0), (True, 4, 64, 0), (False, 4, 16, 0)],
)
def test_scatter_steps(amax_scatter, groups, lanes, steps):
    """log2(min(groups, lanes)) reduce-scatter steps; none when off, for groups that are not a power
    of two, or for blocks wider than a warp (those combine warps through shared memory)."""
    from cake_cute.kernels.quant_config import scatter_steps

    assert scatter_steps(amax_scatter, groups, lanes) == steps


def test_amax_scatter_is_a_quant_choice():
    from cake_cute.kernels.config import overridden
    from cake_cute.kernels.quant_config import quant_forward_config

    assert quant_forward_config("sm_90a", "bf16", 4096, "1x128").amax_scatter
    with overridden("quant", "sm_90a", "bf16", 4096, amax_scatter=False):
        assert not quant_forward_config("sm_90a", "bf16", 4096, "1x128").amax_scatter
    assert quant_forward_config("sm_90a", "bf16", 4096, "1x128").amax_scatter


ARCHS = ("sm_90a", "sm_100a")
HIDDEN = (7, 4096, 4097, 65536)
ONE_TILE = {"persistents": (False,)}
# fp16 rows run bf16's code but for the conversions: one H (odd, 1-element vectors) checks them.
SPECS = fp8.fp8_variant_specs(ARCHS, ("bf16", "fp32"), HIDDEN, **ONE_TILE)
SPECS += fp8.fp8_variant_specs(ARCHS, ("fp16",), (4097,), **ONE_TILE)
SPECS += fp8.fp8_variant_specs(ARCHS, ("bf16",), (1, 33, 129, 7168, 65537), emit_ys=(False,), **ONE_TILE)
SPECS += fp8.fp8_variant_specs(("sm_103a",), ("bf16",), (4096, 65536), (True,), emit_ys=(False,))
# The persistent kernels (plain mode, rows one CTA holds): odd, ragged and the widest H, and with y
# the two whose registers come closest to what their programs per SM allow (four 128-thread programs
# of H = 1024, two 256-thread ones of H = 8192: 128 registers per thread); FP32 rows at both rules.
PERSISTENT = {"residuals": (False,), "persistents": (True,)}
SPECS += fp8.fp8_variant_specs(ARCHS, ("bf16",), (7, 4097, 7168, 16384), emit_ys=(False,), **PERSISTENT)
SPECS += fp8.fp8_variant_specs(ARCHS, ("bf16",), (1024, 8192), emit_ys=(True,), **PERSISTENT)
SPECS += fp8.fp8_variant_specs(ARCHS, ("fp16",), (4096,), emit_ys=(True,), **PERSISTENT)
SPECS += fp8.fp8_variant_specs(ARCHS, ("fp32",), (2048, 8192), emit_ys=(True,), **PERSISTENT)


@pytest.fixture(scope="module")
def fp8_reports(tmp_path_factory):
    """{spec: cubin report} of every variant, compiled by the warmup code path (two worker processes)
    into a fresh cache, then read back and disassembled (two workers)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path_factory.mktemp("fp8_cache")))
        result = warm(SPECS, jobs=2)
        assert not result.failed, "\n".join(f"{o.spec.name()}: {o.error}" for o in result.failed)
        return dict(zip(SPECS, collect_reports(SPECS, jobs=2)))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name())
def test_kernel_compiles_without_spills_and_converts_in_hardware(fp8_reports, spec):
    report = fp8_reports[spec]
    assert spill_free(report), report
    assert report["e4m3_converts"] > 0, "no e4m3 convert instruction"
    act_bytes = dtype_bytes(spec.act_dtype)
    if spec.hidden * act_bytes % 16 == 0:
        assert report["global_load_width_bits"] == 128


@pytest.mark.parametrize("spec", [s for s in SPECS if "persistent" in s.kind], ids=lambda s: s.name())
def test_persistent_programs_fit_on_an_sm_at_once(fp8_reports, spec):
    """The registers the compiler gave each persistent kernel let all its programs of an SM be resident
    together (shared memory, two row tiles per program, never bounds them first); the control: the
    registers that would leave room for one program fewer per SM do not pass."""
    from cake_cute.runtime.build import config_for

    registers = fp8_reports[spec]["registers"]
    assert fp8_reports[spec]["programs_fit"], registers
    config = config_for(spec)
    assert not programs_fit(spec, 65536 // (config.programs_per_sm * config.tiling.threads_per_cta) + 1)


# ---- which kernel runs: the persistent forward's rule and launch plan ------------------------------


def test_persistent_programs_per_sm_rule():
    """2-byte rows: four programs per SM for tiles of up to 5120 elements in 16-byte vectors, two up to
    8192 (and for odd H), one above. FP32 rows: four up to 2048 elements, two up to 8192, none above or
    for narrower vectors. None for rows split over a cluster; a persistent config where none applies is
    refused, naming why. The register hint appears where residency needs fewer than 128 registers per
    thread."""
    from cake_cute.kernels.config import overridden
    from cake_cute.kernels.quant_config import quant_forward_config

    def config(dtype, hidden):
        return quant_forward_config("sm_90a", dtype, hidden, "mxfp8", persistent=True)

    def per_sm(dtype, hidden):
        return config(dtype, hidden).programs_per_sm

    assert [per_sm("bf16", h) for h in (1024, 2048, 4096, 5120)] == [4] * 4
    assert [per_sm("fp16", h) for h in (1, 33, 4097, 6144, 7168, 8192)] == [2] * 6
    assert [per_sm("bf16", h) for h in (12288, 16384)] == [1] * 2
    assert [per_sm("fp32", h) for h in (256, 1024, 2048, 2560, 4096, 8192)] == [4, 4, 4, 2, 2, 2]
    hints = {h: config("bf16", h).min_ctas_per_sm for h in (4096, 4097, 5120, 8192, 16384)}
    assert hints == {4096: 0, 4097: 0, 5120: 4, 8192: 0, 16384: 0}  # 128 / 256 / 320 / 256 / 256 threads
    assert quant_forward_config("sm_90a", "bf16", 4096, "1x128").programs_per_sm == 0  # the one-tile config
    for dtype, hidden in (("bf16", 32768), ("fp32", 4097), ("fp32", 16384)):
        with pytest.raises(ValueError, match="no persistent forward to FP8"):
            per_sm(dtype, hidden)
    with overridden("quant", "sm_90a", "bf16", 4096, programs_per_sm=3):
        assert per_sm("bf16", 4096) == 3
    assert per_sm("bf16", 4096) == 4


def test_fp8_forward_programs_switch_at_the_element_limit():
    """Persistent programs (per SM x SMs) up to 2^27 bytes of x per call (2^26 2-byte, 2^25 FP32
    elements), one CTA per tile above; never in residual mode or for cluster rows."""
    from cake_cute.runtime import launch_plan
    from cake_cute.runtime.device import DeviceFacts

    h200 = DeviceFacts(0, "NVIDIA H200", (9, 0), "sm_90a", 132)
    assert launch_plan.fp8_persistent_rows(4096, "bf16") == 16384
    assert launch_plan.fp8_persistent_rows(4096, "fp32") == 8192
    assert launch_plan.fp8_forward_programs(1, 4096, "bf16", False, h200) == 4 * 132
    assert launch_plan.fp8_forward_programs(16384, 4096, "bf16", False, h200) == 4 * 132
    assert launch_plan.fp8_forward_programs(16385, 4096, "bf16", False, h200) == 0
    assert launch_plan.fp8_forward_programs(4096, 16384, "bf16", False, h200) == 132
    assert launch_plan.fp8_forward_programs(16, 4096, "bf16", True, h200) == 0
    assert launch_plan.fp8_forward_programs(16, 65536, "bf16", False, h200) == 0
    assert launch_plan.fp8_forward_programs(8192, 4096, "fp32", False, h200) == 2 * 132
    assert launch_plan.fp8_forward_programs(8193, 4096, "fp32", False, h200) == 0
    assert launch_plan.fp8_forward_programs(16, 4097, "fp32", False, h200) == 0


def test_persistent_kernel_refuses_residual_and_cluster_rows():
    pytest.importorskip("cutlass")
    import cutlass

    from cake_cute.kernels.quant_config import quant_forward_config
    from cake_cute.kernels.rmsnorm_fwd_quant_persistent import RMSNormForwardQuantPersistent

    dtypes = (cutlass.BFloat16, cutlass.BFloat16)
    config = quant_forward_config("sm_90a", "bf16", 4096, "mxfp8", persistent=True)
    with pytest.raises(ValueError, match="plain rows one CTA holds"):
        RMSNormForwardQuantPersistent(config, *dtypes, True, 0.0, False)
    cluster = quant_forward_config("sm_90a", "bf16", 65536, "mxfp8")
    with pytest.raises(ValueError, match="plain rows one CTA holds"):
        RMSNormForwardQuantPersistent(cluster, *dtypes, False, 0.0, False)
