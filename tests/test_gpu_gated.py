"""Gated RMSNorm kernels on the GPU, launched through ``cake_cute.gated.ops``: forward (y, rstd) and
backward (dx, dz, dw) against the FP64 reference (``cake_cute.gated.reference``) by relative-norm
error, for both forms and both gate activations (SiLU, sigmoid), every dtype, head-dim and grouped
full-width rows, T = 0 to 4096; caller-owned
outputs poisoned with NaN before every run; strided rows; bitwise determinism across two runs and
batch invariance (a row's results do not depend on T).

The backward is given the FP64 reference's rstd rounded to FP32, so its checks do not depend on the
forward kernel. Tolerances: y, dx, dz ``reference.tolerance(dtype)`` (one rounding to the dtype plus
FP32 arithmetic); rstd 1e-5 and dw 1e-4 (FP32 outputs; dw sums up to 4096 FP32 terms per column).
"""

from __future__ import annotations

import pytest
import torch

from cake_cute.gated.ops import gated_rmsnorm_backward, gated_rmsnorm_forward, rstd_shape
from cake_cute.gated.reference import gated_backward_reference, gated_forward_reference
from cake_cute.reference import rel_error, tolerance

from ._helpers import (  # noqa: F401
    DTYPE_IDS,
    EPS,
    assert_bitwise_equal,
    fixed_seed,
    poison,
    rand_weight,
    scaled_then_gated,
)
from ._hf_helpers import mamba2_gated_norm

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (H, group_size, norm_before_gate): head-dim rows normalized then gated, grouped rows gated then
# normalized per group; segments wider than 4096 columns take the backward over a cluster of CTAs
# (8 for 8192, 6 for 6144, 5 for 4100 with predicated columns).
SHAPES = [
    (64, None, True),
    (128, None, True),
    (256, None, True),
    (2048, 512, False),
    (4096, 1024, False),
    (16384, 8192, False),
    (8192, None, True),
    (12288, 6144, False),
    (8200, 4100, False),
]
ROWS = (0, 1, 2, 129, 4096)
ACTIVATIONS = ("silu", "sigmoid")
RSTD_TOLERANCE = 1e-5
DW_TOLERANCE = 1e-4


def _shape_id(shape) -> str:
    hidden, group, nbg = shape
    return f"H{hidden}-" + ("nbg" if nbg else f"gbn{group}")


def _inputs(rows, hidden, dtype):
    """x, z (scaled so the gate covers silu's curved range), g."""
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    z = (torch.randn(rows, hidden, device="cuda") * 2).to(dtype)
    g = torch.randn(rows, hidden, device="cuda").to(dtype)
    return x, z, g


def _options(shape, weight_offset=0.0, activation="silu"):
    _, group_size, norm_before_gate = shape
    return dict(
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=weight_offset,
        activation=activation,
    )


def run_forward(x, z, w, options):
    """The forward into NaN-poisoned caller-owned outputs."""
    group_size = options["group_size"] or x.shape[-1]
    y = poison(x.shape, x.dtype)
    rstd = poison(rstd_shape(x, group_size), torch.float32)
    return gated_rmsnorm_forward(x, z, w, EPS, **options, out=y, rstd=rstd)


def run_backward(g, x, z, w, rstd, options):
    """The backward into NaN-poisoned caller-owned outputs."""
    dx, dz = poison(x.shape, x.dtype), poison(x.shape, x.dtype)
    dw = poison((x.shape[-1],), torch.float32)
    return gated_rmsnorm_backward(g, x, z, w, rstd, **options, dx=dx, dz=dz, dw=dw)


def reference_rstd(x, z, w, options) -> torch.Tensor:
    """The FP64 reference's rstd, rounded to FP32, in the kernels' shape."""
    _, rstd = gated_forward_reference(x, z, w, EPS, **options)
    group_size = options["group_size"] or x.shape[-1]
    return rstd.float().reshape(rstd_shape(x, group_size))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_forward_matches_fp64(dtype, shape, rows, activation):
    x, z, _ = _inputs(rows, shape[0], dtype)
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    y, rstd = run_forward(x, z, w, options)
    y64, rstd64 = gated_forward_reference(x, z, w, EPS, **options)
    assert not y.isnan().any() and not rstd.isnan().any()
    assert rel_error(y, y64) <= tolerance(dtype)
    assert rel_error(rstd, rstd64) <= RSTD_TOLERANCE


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_backward_matches_fp64(dtype, shape, rows, activation):
    x, z, g = _inputs(rows, shape[0], dtype)
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    dx, dz, dw = run_backward(g, x, z, w, reference_rstd(x, z, w, options), options)
    dx64, dz64, dw64 = gated_backward_reference(g, x, z, w, EPS, **options)
    for name, got in (("dx", dx), ("dz", dz), ("dw", dw)):
        assert not got.isnan().any(), f"{name} has unwritten (NaN) elements"
    assert rel_error(dx, dx64) <= tolerance(dtype)
    assert rel_error(dz, dz64) <= tolerance(dtype)
    if rows == 0:
        assert not dw.any()
    else:
        assert rel_error(dw, dw64) <= DW_TOLERANCE


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=_shape_id)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=DTYPE_IDS.get)
def test_fp32_weight_and_offset(dtype, shape, activation):
    """w in FP32 next to 16-bit rows (autocast's master weights), with a ``1 + w`` offset."""
    x, z, g = _inputs(129, shape[0], dtype)
    w = rand_weight(shape[0], torch.float32) - 1.0
    options = _options(shape, weight_offset=1.0, activation=activation)
    y, rstd = run_forward(x, z, w, options)
    y64, _ = gated_forward_reference(x, z, w, EPS, **options)
    assert rel_error(y, y64) <= tolerance(dtype)
    dx, dz, dw = run_backward(g, x, z, w, rstd, options)
    dx64, dz64, dw64 = gated_backward_reference(g, x, z, w, EPS, **options)
    assert rel_error(dx, dx64) <= tolerance(dtype) and rel_error(dz, dz64) <= tolerance(dtype)
    assert rel_error(dw, dw64) <= DW_TOLERANCE


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_strided_rows_read_in_place(dtype, shape, activation):
    """Rows of a wider buffer (row stride != H, a multiple of 16 bytes): bitwise the contiguous
    results, y and rstd, dx, dz and dw."""
    hidden = shape[0]
    pad = 16 // torch.tensor([], dtype=dtype).element_size()
    x, z, g = (t[:, :hidden] for t in _inputs(129, hidden + pad, dtype))
    w = rand_weight(hidden, dtype)
    options = _options(shape, activation=activation)
    strided = run_forward(x, z, w, options)
    contiguous = run_forward(x.contiguous(), z.contiguous(), w, options)
    for name, a, b in zip(("y", "rstd"), strided, contiguous):
        assert_bitwise_equal(a, b, name)
    rstd = contiguous[1]
    strided = run_backward(g, x, z, w, rstd, options)
    contiguous = run_backward(g.contiguous(), x.contiguous(), z.contiguous(), w, rstd, options)
    for name, a, b in zip(("dx", "dz", "dw"), strided, contiguous):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_bitwise_deterministic(dtype, shape, activation):
    x, z, g = _inputs(4096, shape[0], dtype)
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    first, second = run_forward(x, z, w, options), run_forward(x, z, w, options)
    for name, a, b in zip(("y", "rstd"), first, second):
        assert_bitwise_equal(a, b, name)
    rstd = first[1]
    first, second = run_backward(g, x, z, w, rstd, options), run_backward(g, x, z, w, rstd, options)
    for name, a, b in zip(("dx", "dz", "dw"), first, second):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_batch_invariant(dtype, shape, activation):
    """The first rows' y, rstd, dx and dz are bitwise the same in a call of 4096 rows and in calls of
    1, 2 and 129 rows."""
    x, z, g = _inputs(4096, shape[0], dtype)
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    y, rstd = run_forward(x, z, w, options)
    dx, dz, _ = run_backward(g, x, z, w, rstd, options)
    for rows in (1, 2, 129):
        y_part, rstd_part = run_forward(x[:rows], z[:rows], w, options)
        dx_part, dz_part, _ = run_backward(g[:rows], x[:rows], z[:rows], w, rstd[:rows], options)
        assert_bitwise_equal(y_part, y[:rows], f"y of {rows} rows")
        assert_bitwise_equal(rstd_part, rstd[:rows], f"rstd of {rows} rows")
        assert_bitwise_equal(dx_part, dx[:rows], f"dx of {rows} rows")
        assert_bitwise_equal(dz_part, dz[:rows], f"dz of {rows} rows")


def test_leading_dims_collapse_into_rows():
    """[T, heads, head_dim] input (the linear-attention output norm): rows of head_dim, rstd [T, heads]."""
    x, z, g = (t.view(64, 16, 128) for t in _inputs(64 * 16, 128, torch.bfloat16))
    w = rand_weight(128, torch.bfloat16)
    options = _options(SHAPES[1])
    y, rstd = run_forward(x, z, w, options)
    assert y.shape == x.shape and rstd.shape == (64, 16)
    flat = run_forward(x.reshape(-1, 128), z.reshape(-1, 128), w, options)
    assert_bitwise_equal(y.reshape(-1, 128), flat[0], "y")
    dx, dz, dw = run_backward(g, x, z, w, rstd, options)
    flat = run_backward(g.reshape(-1, 128), x.reshape(-1, 128), z.reshape(-1, 128), w, flat[1], options)
    assert_bitwise_equal(dx.reshape(-1, 128), flat[0], "dx")
    assert_bitwise_equal(dw, flat[2], "dw")


# --- autograd, torch.compile, CUDA graphs, swapped modules (cake_gated_rmsnorm, CakeGatedRMSNorm) ---

AUTOGRAD_SHAPES = [SHAPES[1], SHAPES[3], (256, 64, True)]


def _autograd_run(fn, x, z, w, g, options):
    """y and the gradients of fresh leaves (x, z, w)."""
    xl, zl, wl = (t.detach().clone().requires_grad_() for t in (x, z, w))
    y = fn(xl, zl, wl, EPS, **options)
    y.backward(g)
    return y, xl.grad, zl.grad, wl.grad


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", AUTOGRAD_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_autograd_matches_fp64(dtype, shape, activation):
    """cake_gated_rmsnorm through the custom ops: y, dx, dz against FP64; dw in w's dtype against the
    FP64 sum (FP32 accumulation, one rounding to w's dtype: the dtype's tolerance, at least DW's)."""
    from cake_cute.gated.autograd import cake_gated_rmsnorm

    x, z, g = (t.view(8, -1, shape[0]) for t in _inputs(8 * 33, shape[0], dtype))
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    y, dx, dz, dw = _autograd_run(cake_gated_rmsnorm, x, z, w, g, options)
    rows = [t.reshape(-1, shape[0]) for t in (x, z, g)]
    y64, _ = gated_forward_reference(rows[0], rows[1], w, EPS, **options)
    dx64, dz64, dw64 = gated_backward_reference(rows[2], rows[0], rows[1], w, EPS, **options)
    assert dw.dtype == dtype and y.shape == x.shape
    for got, want in ((y, y64), (dx, dx64), (dz, dz64)):
        assert rel_error(got.reshape(want.shape), want) <= tolerance(dtype)
    assert rel_error(dw, dw64) <= max(tolerance(dtype), DW_TOLERANCE)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", AUTOGRAD_SHAPES, ids=_shape_id)
def test_compiled_fullgraph_is_bitwise_eager(shape, activation):
    from cake_cute.gated.autograd import cake_gated_rmsnorm

    x, z, g = _inputs(257, shape[0], torch.bfloat16)
    w = rand_weight(shape[0], torch.bfloat16)
    options = _options(shape, activation=activation)
    torch._dynamo.reset()
    compiled = torch.compile(cake_gated_rmsnorm, fullgraph=True)
    eager = _autograd_run(cake_gated_rmsnorm, x, z, w, g, options)
    for name, a, b in zip(("y", "dx", "dz", "dw"), _autograd_run(compiled, x, z, w, g, options), eager):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", AUTOGRAD_SHAPES, ids=_shape_id)
def test_cuda_graph_capture_and_replay(shape, activation):
    """A forward + backward step captured in a CUDA graph (no host synchronization in either), replayed
    on new inputs copied into the static ones: bitwise the eager step on those inputs."""
    from cake_cute.gated.autograd import cake_gated_rmsnorm

    from ._helpers import warm_up_before_capture

    dtype = torch.bfloat16
    x, z, g = _inputs(129, shape[0], dtype)
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    xs, zs, ws = (t.clone().requires_grad_() for t in (x, z, w))

    def step():
        for t in (xs, zs, ws):
            t.grad = None
        y = cake_gated_rmsnorm(xs, zs, ws, EPS, **options)
        y.backward(g)
        return y

    warm_up_before_capture(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    x2, z2, _ = _inputs(129, shape[0], dtype)
    with torch.no_grad():
        xs.copy_(x2)
        zs.copy_(z2)
    graph.replay()
    torch.cuda.synchronize()
    eager = _autograd_run(cake_gated_rmsnorm, x2, z2, w, g, options)
    for name, a, b in zip(("y", "dx", "dz", "dw"), (y_static, xs.grad, zs.grad, ws.grad), eager):
        assert_bitwise_equal(a, b, name)


def _hf_norm(family: str, cls: str, **kwargs):
    transformers = pytest.importorskip("transformers")
    module = getattr(getattr(transformers.models, family), f"modeling_{family}")
    if not hasattr(module, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    try:
        return getattr(module, cls)(**kwargs)
    except TypeError as error:  # an older signature (transformers 5.17's Mamba-2 class has no groups)
        pytest.skip(f"transformers {transformers.__version__}'s {cls}: {error}")


MAMBA2_NORM = mamba2_gated_norm()

# (family, class, constructor arguments, roundings after the statistics): a norm-then-gate class
# rounding three times (the normalized value, its product by w, the gated output), grouped
# gate-then-norm ones rounding before their weight and after it (Zamba2's has groups in every
# transformers 5.x, Mamba-2's from 5.25), FalconH1 (one rounding).
SWAPPED = [
    ("qwen3_next", "Qwen3NextRMSNormGated", dict(hidden_size=128), 3),
    ("mamba2", MAMBA2_NORM, dict(hidden_size=2048, group_size=512), 2),
    ("zamba2", "Zamba2RMSNormGated", dict(hidden_size=2048, group_size=512), 2),
    ("falcon_h1", "FalconH1RMSNormGated", dict(hidden_size=2048, n_groups=4, norm_before_gate=False), 1),
]
# Gated with sigmoid: Kimi Linear's output norm (one rounding) and a sigmoid-gated Qwen4-exp (Qwen3-Next's
# three roundings).
SIGMOID_SWAPPED = [
    ("kimi_linear", "KimiLinearRMSNormGated", dict(hidden_size=128), 1),
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", dict(hidden_size=128, activation="sigmoid"), 3),
]


def _within_roundings(got: torch.Tensor, want: torch.Tensor, roundings: int) -> bool:
    """|got - want| <= 2**(roundings - 8) * max(|got|, |want|): bf16 outputs whose statistics were summed
    in different orders. The first rounding after the statistics may land one ulp apart (2**-7 of the
    value at most); each later rounding of a product of it can double that relative gap."""
    got, want = got.float(), want.float()
    scale = torch.maximum(got.abs(), want.abs())
    return bool((got - want).abs().le(scale * 2.0 ** (roundings - 8) + 1e-6).all())


def _swapped_pair(family: str, cls: str, kwargs: dict):
    """(the bf16 CUDA class with a random weight, the CakeGatedRMSNorm the swap put in its place)."""
    from torch import nn

    from cake_cute.gated.swap import swap_gated_rmsnorm

    holder = nn.Module()
    holder.norm = _hf_norm(family, cls, eps=EPS, **kwargs).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        holder.norm.weight.uniform_(0.5, 1.5)
    stock = holder.norm
    assert swap_gated_rmsnorm(holder) == 1 and holder.norm.weight is stock.weight
    return stock, holder.norm


def _run_gated_module(module, x, z, g):
    """(y, dx, dz, dw) of one forward and backward of ``module(x, z)``."""
    xl, zl = (t.detach().clone().requires_grad_() for t in (x, z))
    module.zero_grad()
    y = module(xl, zl)
    y.backward(g.to(y.dtype))
    return y, xl.grad, zl.grad, module.weight.grad.clone()


@pytest.mark.parametrize(
    ("family", "cls", "kwargs", "roundings"),
    SWAPPED + SIGMOID_SWAPPED,
    ids=[f"{s[1]}-{s[2].get('activation', 'own')}" for s in SWAPPED + SIGMOID_SWAPPED],
)
def test_swapped_module_against_the_hf_class(family, cls, kwargs, roundings):
    """The swapped module against the class it replaced on bf16 rows: y within ``_within_roundings`` of
    the class's output (its statistics are summed in another order), gradients within the dtype's
    tolerance of the class's FP32 autograd; compiled (fullgraph) within the same bounds of eager."""
    stock, swapped = _swapped_pair(family, cls, kwargs)
    hidden = kwargs["hidden_size"]
    x, z, g = (t.view(4, -1, hidden) for t in _inputs(4 * 64, hidden, torch.bfloat16))

    def run(module):
        return _run_gated_module(module, x, z, g)

    got, want = run(swapped), run(stock)
    assert got[0].dtype == want[0].dtype
    assert _within_roundings(got[0], want[0], roundings)
    for a, b in zip(got[1:], want[1:]):
        assert rel_error(a, b.double()) <= tolerance(torch.bfloat16)
    # Compiled: the kernels' ops stay opaque, and inductor fuses the torch operations a class's casts
    # add around them (Qwen3-Next's weight and gate products), keeping their intermediate in FP32 as
    # it does for the stock class: within the same bound as eager against the class.
    torch._dynamo.reset()
    compiled = run(torch.compile(swapped, fullgraph=True))
    assert _within_roundings(compiled[0], got[0], roundings)
    for a, b in zip(compiled[1:], got[1:]):
        assert rel_error(a, b.double()) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize(
    ("family", "cls", "kwargs"), [s[:3] for s in SWAPPED[1:]], ids=[s[1] for s in SWAPPED[1:]]
)
def test_swapped_module_with_the_mixers_dtype_mix(family, cls, kwargs):
    """What a bf16 Mamba-2-style mixer's torch scan path hands its gated norm: an FP32 input, a bf16
    gate, the bf16 weight. The swapped module runs the FP32 kernels (docs/gated.md): y in the class's
    dtype (FP32) within 1e-5 of its value per element (FP32 statistics summed in another order), the
    gradients in the class's dtypes, within their tolerance of the class's autograd."""
    stock, swapped = _swapped_pair(family, cls, kwargs)
    hidden = kwargs["hidden_size"]
    x, z, g = (t.view(4, -1, hidden) for t in _inputs(4 * 64, hidden, torch.float32))
    z = z.to(torch.bfloat16)
    got, want = _run_gated_module(swapped, x, z, g), _run_gated_module(stock, x, z, g)
    assert got[0].dtype == want[0].dtype == torch.float32
    assert bool((got[0] - want[0]).abs().le(want[0].abs() * 1e-5 + 1e-6).all())
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype
        assert rel_error(a, b.double()) <= tolerance(a.dtype)


@pytest.mark.parametrize("hidden", [64, 128, 256])
def test_scale_then_round_module_against_its_form(hidden):
    """``"scale_then_round"`` (torchtitan's Qwen3.5 gated norm) on bf16 head-dim rows: y within
    ``_within_roundings`` of the form's torch operations (two roundings after statistics summed in
    another order), gradients within the dtype's tolerance of their FP32 autograd; compiled
    (fullgraph) within the same bounds of eager."""
    from cake_cute.gated.module import CakeGatedRMSNorm

    norm = CakeGatedRMSNorm(hidden, EPS, cast_policy="scale_then_round", device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z, g = (t.view(4, -1, hidden) for t in _inputs(4 * 64, hidden, torch.bfloat16))

    def run(fn, weight):
        xl, zl = (t.detach().clone().requires_grad_() for t in (x, z))
        weight.grad = None
        y = fn(xl, zl)
        y.backward(g)
        return y, xl.grad, zl.grad, weight.grad.clone()

    got = run(norm, norm.weight)
    w = norm.weight.detach().clone().requires_grad_()
    want = run(lambda a, b: scaled_then_gated(a, b, w, EPS), w)
    assert _within_roundings(got[0], want[0], 2)
    for a, b in zip(got[1:], want[1:]):
        assert rel_error(a, b.double()) <= tolerance(torch.bfloat16)
    torch._dynamo.reset()
    compiled = run(torch.compile(norm, fullgraph=True), norm.weight)
    assert _within_roundings(compiled[0], got[0], 2)
    for a, b in zip(compiled[1:], got[1:]):
        assert rel_error(a, b.double()) <= tolerance(torch.bfloat16)


# --- FlashInfer's names (cake_rmsnorm_silu_gate, CakeRMSNormSiLUGateFunction, ..._train_forward) ---


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_flashinfer_names_are_the_gated_norm(dtype):
    """FlashInfer's autograd entries on [T, heads, 128] rows give bitwise what cake_gated_rmsnorm gives
    (y, dx, dz, dw), and its functional forward writes the same y into a NaN-poisoned ``out``."""
    from cake_cute import (
        CakeRMSNormSiLUGateFunction,
        cake_gated_rmsnorm,
        cake_rmsnorm_silu_gate,
        cake_rmsnorm_silu_gate_train_forward,
    )

    x, z, g = (t.view(129, 4, 128) for t in _inputs(129 * 4, 128, dtype))
    w = rand_weight(128, dtype)
    expected = _autograd_run(cake_gated_rmsnorm, x, z, w, g, {})
    for entry in (cake_rmsnorm_silu_gate, CakeRMSNormSiLUGateFunction.apply):
        for name, got, want in zip(("y", "dx", "dz", "dw"), _autograd_run(entry, x, z, w, g, {}), expected):
            assert_bitwise_equal(got, want, name)
    out = poison(x.shape, dtype)
    y = cake_rmsnorm_silu_gate_train_forward(x, z, w, EPS, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_bitwise_equal(y, expected[0], "y")


# --- FlashInfer's functional backward: rstd recomputed by the statistics kernel --------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("rows", (1, 129, 4096))
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_statistics_kernel_is_the_forwards_rstd(dtype, shape, rows, activation):
    """The statistics kernel writes, into a NaN-poisoned rstd, bitwise the forward's rstd (both
    forms and activations: it reads z only when the gate comes first)."""
    from cake_cute.calls import gated_call
    from cake_cute.gated.ops import forward_spec, launch_statistics

    x, z, _ = _inputs(rows, shape[0], dtype)
    w = rand_weight(shape[0], dtype)
    options = _options(shape, activation=activation)
    _, expected = run_forward(x, z, w, options)
    call = gated_call(x, z, w, EPS, options["group_size"], options["norm_before_gate"], 0.0, activation)
    rstd = poison(expected.shape, torch.float32)
    launch_statistics(call, forward_spec(call), rstd)
    assert_bitwise_equal(rstd, expected, "rstd")


def _flashinfer_expected(x, z, w, g):
    """(dx, dz, dw in w's dtype, dw in FP32) of the autograd path (the forward's saved rstd)."""
    from cake_cute import cake_rmsnorm_silu_gate

    _, dx, dz, dw = _autograd_run(cake_rmsnorm_silu_gate, x, z, w, g, {})
    _, rstd = gated_rmsnorm_forward(x, z, w, EPS)
    _, _, dw32 = gated_rmsnorm_backward(g, x, z, w, rstd)
    return dx, dz, dw, dw32


@pytest.mark.parametrize("hidden", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_flashinfer_functional_backward_is_the_autograd_backward(dtype, hidden):
    """``cake_rmsnorm_silu_gate_train_backward`` into NaN-poisoned grad_x, grad_z and grad_weight,
    with one sized workspace reused by calls of different T: bitwise the autograd backward's dx, dz
    and dw; accumulating gives the FP32 sum rounded once; without the weight gradient, the same dx
    and dz; strided rows are read in place to the same bits."""
    from cake_cute import (
        cake_rmsnorm_silu_gate_train_backward,
        cake_rmsnorm_silu_gate_train_backward_workspace,
    )

    workspace = cake_rmsnorm_silu_gate_train_backward_workspace(4 * 129, "cuda", hidden=hidden)
    for tokens in (129, 7):
        x, z, g = (t.view(tokens, 4, hidden) for t in _inputs(tokens * 4, hidden, dtype))
        w = rand_weight(hidden, dtype)
        dx_want, dz_want, dw_want, dw32 = _flashinfer_expected(x, z, w, g)
        grad_x, grad_z, grad_w = poison(x.shape, dtype), poison(x.shape, dtype), poison((hidden,), dtype)
        dx, dz, dw = cake_rmsnorm_silu_gate_train_backward(
            g, x, z, w, EPS, grad_x=grad_x, grad_z=grad_z, grad_weight=grad_w, workspace=workspace
        )
        assert dx is grad_x and dz is grad_z and dw is grad_w
        for name, got, want in (("dx", dx, dx_want), ("dz", dz, dz_want), ("dw", dw, dw_want)):
            assert_bitwise_equal(got, want, name)
        start = rand_weight(hidden, torch.float32)
        accumulated = start.clone()
        cake_rmsnorm_silu_gate_train_backward(
            g, x, z, w, EPS, grad_weight=accumulated, accumulate_grad_weight=True
        )
        assert_bitwise_equal(accumulated, start + dw32, "accumulated dw")
        dx2, dz2, none = cake_rmsnorm_silu_gate_train_backward(g, x, z, w, EPS, compute_grad_weight=False)
        assert none is None
        assert_bitwise_equal(dx2, dx_want, "dx")
        assert_bitwise_equal(dz2, dz_want, "dz")
    wide = torch.randn(tokens, 4, hidden + 8, device="cuda").to(dtype)
    wide[..., :hidden] = x
    strided = wide[..., :hidden]
    dx3, dz3, dw3 = cake_rmsnorm_silu_gate_train_backward(g, strided, z, w, EPS)
    for name, got, want in (("dx", dx3, dx_want), ("dz", dz3, dz_want), ("dw", dw3, dw_want)):
        assert_bitwise_equal(got, want, name)


def test_flashinfer_functional_backward_in_a_cuda_graph():
    """With its outputs and workspace given, the functional backward captures in a CUDA graph; a replay
    on new inputs copied into the static ones gives the eager bits."""
    from cake_cute import (
        cake_rmsnorm_silu_gate_train_backward,
        cake_rmsnorm_silu_gate_train_backward_workspace,
    )

    from ._helpers import warm_up_before_capture

    dtype = torch.bfloat16
    x, z, g = (t.view(129, 4, 128) for t in _inputs(129 * 4, 128, dtype))
    w = rand_weight(128, dtype)
    workspace = cake_rmsnorm_silu_gate_train_backward_workspace(129 * 4, "cuda")
    outputs = dict(grad_x=torch.empty_like(x), grad_z=torch.empty_like(x), grad_weight=torch.empty_like(w))

    def step():
        return cake_rmsnorm_silu_gate_train_backward(g, x, z, w, EPS, **outputs, workspace=workspace)

    warm_up_before_capture(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x2, z2, g2 = (t.view(129, 4, 128) for t in _inputs(129 * 4, 128, dtype))
    for static, new in ((x, x2), (z, z2), (g, g2)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    expected = cake_rmsnorm_silu_gate_train_backward(g2, x2, z2, w, EPS)
    for name, got, want in zip(("dx", "dz", "dw"), outputs.values(), expected):
        assert_bitwise_equal(got, want, name)
