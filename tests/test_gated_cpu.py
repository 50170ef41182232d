"""Gated RMSNorm without a GPU: the reference against the Hugging Face classes' math and against
autograd, the segment tilings, the host entry points' argument errors and launch plan, and every
gated kernel variant compiled for sm_90a and sm_100a with no spills and 128-bit global accesses."""

import pytest
import torch

from cake_cute.gated import ops as gated_ops
from cake_cute.gated.reference import gated_backward_reference, gated_forward_reference
from cake_cute.kernels.gated_config import gated_backward_config, gated_forward_config
from cake_cute.runtime.build import config_for
from cake_cute.runtime.device import DeviceFacts
from cake_cute.runtime.specs import GatedSpec, ReduceSpec
from cake_cute.tools.cubin import spill_free
from cake_cute.tools.kernel_report import collect_reports
from cake_cute.tools.warmup import warm
from cake_cute.vocab import dtype_bytes

EPS = 1e-6


def _inputs(rows, hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, hidden, generator=gen, dtype=torch.float64) for _ in range(3)]


def _hf_weight(hidden, seed=1):
    return torch.randn(hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("hidden", [64, 128])
def test_norm_then_gate_is_qwen3_next(hidden):
    """The Hugging Face class computes in FP32; on FP32 inputs its casts are no-ops and its output is
    the reference's in FP32 (the same operations, up to the order of the mean's additions)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    x, z, _ = (t.float() for t in _inputs(5, hidden))
    module = Qwen3NextRMSNormGated(hidden, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(_hf_weight(hidden))
        expected = module(x, z)
    y, rstd = gated_forward_reference(x, z, module.weight.detach(), EPS, compute_dtype=torch.float32)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    assert rstd.shape == (5, 1)


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("kimi_linear", "KimiLinearRMSNormGated"),
        ("glm5_next", "Glm5NextTextRMSNormGated"),
        ("bailing_hybrid", "BailingHybridRMSNormGated"),
    ],
)
def test_sigmoid_norm_then_gate_is_kimi_linear(family, name):
    """The sigmoid-gated classes compute in FP32 and round once: on FP32 inputs their output is the
    reference's with ``activation="sigmoid"`` in FP32 (up to the order of the mean's additions)."""
    module_of = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    x, z, _ = (t.float() for t in _inputs(5, 128))
    module = getattr(module_of, name)(128, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(_hf_weight(128))
        expected = module(x, z)
    y, _ = gated_forward_reference(
        x, z, module.weight.detach(), EPS, activation="sigmoid", compute_dtype=torch.float32
    )
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_reference_of_no_rows(norm_before_gate):
    """T = 0: empty outputs of the right shapes, and a dW of zeros (nothing was summed)."""
    x, z, w = (t[:, :256] for t in _inputs(0, 256))
    w = torch.randn(256, dtype=torch.float64)
    kwargs = dict(group_size=128, norm_before_gate=norm_before_gate)
    y, rstd = gated_forward_reference(x, z, w, EPS, **kwargs)
    assert y.shape == (0, 256) and rstd.shape == (0, 2)
    dx, dz, dw = gated_backward_reference(torch.zeros_like(x), x, z, w, EPS, **kwargs)
    assert dx.shape == dz.shape == (0, 256)
    assert dw.shape == (256,) and not dw.any()


@pytest.mark.parametrize("hidden, group_size", [(2048, 512), (4096, 1024), (256, 256)])
def test_gate_then_norm_is_nemotron_h(hidden, group_size):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    x, z, _ = (t.float() for t in _inputs(3, hidden))
    module = NemotronHRMSNormGated(hidden, group_size, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(_hf_weight(hidden))
        expected = module(x, gate=z)
    y, rstd = gated_forward_reference(
        x,
        z,
        module.weight.detach(),
        EPS,
        group_size=group_size,
        norm_before_gate=False,
        compute_dtype=torch.float32,
    )
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    assert rstd.shape == (3, hidden // group_size)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize(
    "hidden, group_size, weight_offset", [(128, None, 0.0), (96, 32, 1.0), (64, 16, 0.5)]
)
def test_backward_reference_is_autograd(norm_before_gate, hidden, group_size, weight_offset, activation):
    x, z, g = _inputs(7, hidden, seed=2)
    w = _hf_weight(hidden)
    leaves = [t.clone().requires_grad_() for t in (x, z, w)]
    kwargs = dict(
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=weight_offset,
        activation=activation,
    )
    y, _ = gated_forward_reference(*leaves, EPS, **kwargs)
    expected = torch.autograd.grad(y, leaves, g)
    got = gated_backward_reference(g, x, z, w, EPS, **kwargs)
    for name, a, b in zip(("dx", "dz", "dw"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_fp32_reference_rounds_like_the_kernels():
    """In FP32 the reference performs the kernels' operations: within FP32 accuracy of FP64, so the
    rounding to bf16 agrees with the FP64 value's rounding almost everywhere."""
    x, z, _ = _inputs(64, 128, seed=3)
    w = _hf_weight(128)
    y64, _ = gated_forward_reference(x, z, w, EPS)
    y32, _ = gated_forward_reference(x.float(), z.float(), w.float(), EPS, compute_dtype=torch.float32)
    assert (y32.to(torch.bfloat16) != y64.to(torch.bfloat16)).float().mean() < 0.01
    torch.testing.assert_close(y32.double(), y64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "act, hidden, group_size, forward, backward",
    [
        # describe(): vec, lanes per segment, vectors per lane, segments per CTA
        (
            "bf16",
            128,
            128,
            "vec=8 tpr=8 vpt=2 cluster=1 rows/cta=16",
            "vec=8 tpr=16 vpt=1 cluster=1 rows/cta=16",
        ),
        (
            "fp32",
            64,
            64,
            "vec=4 tpr=4 vpt=4 cluster=1 rows/cta=32",
            "vec=4 tpr=8 vpt=2 cluster=1 rows/cta=32",
        ),
        (
            "bf16",
            2048,
            512,
            "vec=8 tpr=32 vpt=2 cluster=1 rows/cta=4",
            "vec=8 tpr=64 vpt=1 cluster=1 rows/cta=4",
        ),
        (
            "fp16",
            16384,
            8192,
            "vec=8 tpr=512 vpt=2 cluster=1 rows/cta=1",
            "vec=8 tpr=128 vpt=1 cluster=8 rows/cta=1",
        ),
        (
            "fp32",
            12288,
            6144,
            "vec=4 tpr=512 vpt=3 cluster=1 rows/cta=1",
            "vec=4 tpr=128 vpt=2 cluster=6 rows/cta=1",
        ),
        (
            "bf16",
            8200,
            4100,
            "vec=4 tpr=512 vpt=3 cluster=1 rows/cta=1",
            "vec=4 tpr=128 vpt=2 cluster=5 rows/cta=1",
        ),
    ],
)
def test_segment_tilings(act, hidden, group_size, forward, backward):
    assert gated_forward_config(act, hidden, group_size).tiling.describe() == forward
    config = gated_backward_config("sm_90a", act, hidden, group_size)
    assert config.tiling.describe() == backward
    # Only segments wider than 512 lanes of 8 elements are split over a cluster; segments of 1024
    # columns and more (at most two to a CTA) prefetch later rows into the L2, except rows of one
    # segment narrower than 2048.
    assert (config.tiling.cluster_n > 1) == (group_size > 4096)
    assert config.prefetch == (group_size >= 1024 and not group_size == hidden < 2048)


@pytest.mark.parametrize("hidden, group_size", [(4096, 3000), (32768, 16384), (128, 0)])
def test_segment_out_of_range(hidden, group_size):
    with pytest.raises(ValueError, match="group_size"):
        gated_forward_config("bf16", hidden, group_size)


def _cpu_args(hidden=128, rows=4, dtype=torch.bfloat16):
    x, z = (torch.randn(rows, hidden, dtype=dtype) for _ in range(2))
    return x, z, torch.ones(hidden, dtype=dtype)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(z=torch.zeros(4, 64, dtype=torch.bfloat16)), ValueError, "^z must have shape"),
        (dict(z=torch.zeros(4, 128, dtype=torch.float16)), TypeError, "^z must have dtype"),
        (dict(w=torch.ones(128, dtype=torch.float16)), TypeError, "^w must have dtype"),
        (dict(w=torch.ones(64, dtype=torch.bfloat16)), ValueError, "^w must have shape"),
        (dict(x=torch.zeros((), dtype=torch.bfloat16)), ValueError, "^x must have at least 1 dim"),
        (dict(group_size=48), ValueError, "^group_size must divide"),
        (dict(group_size=True), TypeError, "^group_size must be an int"),
        (dict(group_size=16384), ValueError, "^group_size must be an int in"),
        (dict(norm_before_gate=1), TypeError, "norm_before_gate"),
        (dict(eps=float("nan")), ValueError, "^eps must be"),
        (dict(weight_offset="1"), TypeError, "^weight_offset must be a float"),
        (
            dict(activation="gelu"),
            ValueError,
            r"^activation must be one of \('silu', 'sigmoid'\), got 'gelu'",
        ),
        (dict(activation=None), ValueError, "^activation must be one of"),
        (dict(activation="sigmoid"), ValueError, "x must be a CUDA tensor"),
        (dict(), ValueError, "x must be a CUDA tensor"),  # every argument right: the device is last
    ],
)
def test_forward_argument_errors(change, error, match):
    x, z, w = _cpu_args()
    args = dict(x=x, z=z, w=w, eps=EPS, group_size=None, norm_before_gate=True, weight_offset=0.0)
    args.update(change)
    with pytest.raises(error, match=match):
        gated_ops.gated_rmsnorm_forward(**args)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(g=torch.zeros(4, 128, dtype=torch.float32)), TypeError, "^g must have dtype"),
        (dict(rstd=torch.zeros(4, 2)), ValueError, r"^rstd must have shape \(4,\)"),
        (dict(rstd=torch.zeros(4, dtype=torch.float64)), TypeError, "^rstd must have dtype"),
        (dict(group_size=64, rstd=torch.zeros(4)), ValueError, r"^rstd must have shape \(4, 2\)"),
        (dict(activation="tanh"), ValueError, "^activation must be one of"),
        (dict(), ValueError, "x must be a CUDA tensor"),
    ],
)
def test_backward_argument_errors(change, error, match):
    x, z, w = _cpu_args()
    args = dict(g=torch.zeros_like(x), x=x, z=z, w=w, rstd=torch.zeros(4), group_size=None)
    args.update(change)
    with pytest.raises(error, match=match):
        gated_ops.gated_rmsnorm_backward(**args)


def test_rstd_shape_follows_the_groups():
    x = torch.zeros(2, 3, 2048)
    assert gated_ops.rstd_shape(x, 2048) == (2, 3)
    assert gated_ops.rstd_shape(x, 512) == (2, 3, 4)


@pytest.mark.parametrize(("hidden", "group"), [(128, 128), (1024, 1024), (8192, 1024)])
def test_held_register_budget_by_arch(hidden, group):
    """256-thread CTAs of 2-byte rows are held to 80 registers (three CTAs per SM), except rows of one
    segment off sm_90a, which keep 128 (two); FP32 rows keep 128 everywhere."""
    one_segment = group == hidden
    assert gated_backward_config("sm_90a", "bf16", hidden, group).min_ctas_per_sm == 3
    assert gated_backward_config("sm_100a", "bf16", hidden, group).min_ctas_per_sm == (
        2 if one_segment else 3
    )
    for arch in ("sm_90a", "sm_100a"):
        assert gated_backward_config(arch, "fp32", hidden, group).min_ctas_per_sm == 2


@pytest.mark.parametrize(
    "rows, groups, resident, expected", [(1, 1, 264, 1), (4096, 1, 264, 256), (10**6, 4, 264, 66)]
)
def test_backward_programs(monkeypatch, rows, groups, resident, expected):
    """Never more programs than row tiles; the groups' CTAs share the resident slots."""
    monkeypatch.setattr(gated_ops, "resident_clusters", lambda *args: resident)
    facts = DeviceFacts(0, "test", (9, 0), "sm_90a", 132)
    config = gated_backward_config("sm_90a", "bf16", 128 * groups, 128)  # 16 rows per CTA
    assert gated_ops.backward_programs(rows, config, groups, facts) == expected


# ------------------------------------------------------------------------------------ compiled variants

ARCHS = ("sm_90a", "sm_100a")
DTYPES = ("bf16", "fp16", "fp32")
# (H, group_size, norm_before_gate): head-dim rows, grouped full-width rows, the widest segment; rows
# of one segment in the gate-then-norm form and norm then gate at 512 (on sm_100a these held lanes
# spilled under 80 registers: gated_config.HELD_REGISTER_BUDGET).
SHAPES = [
    (64, 64, True),
    (128, 128, True),
    (256, 256, True),
    (512, 512, True),
    (128, 128, False),
    (1024, 1024, False),
    (2048, 512, False),
    (4096, 1024, False),
    (16384, 8192, False),
    (8200, 4100, False),  # a cluster of five CTAs, 8-byte vectors, the last CTA's columns predicated
]
SPECS = [
    GatedSpec(kind, arch, act, w, hidden, group_size=group, norm_before_gate=nbg)
    for kind in ("gated_fwd", "gated_bwd")
    for arch in ARCHS
    for act in DTYPES
    for hidden, group, nbg in SHAPES
    for w in dict.fromkeys((act, "fp32"))
    if w == act or (hidden, group) in ((128, 128), (4096, 1024))
] + [
    GatedSpec(kind, "sm_90a", "fp16", "fp16", 100, group_size=100, norm_before_gate=True, weight_offset=1.0)
    for kind in ("gated_fwd", "gated_bwd")
]
# The sigmoid gate (Kimi Linear's): head-dim rows, the rows of one segment that spilled on sm_100a under
# 80 registers with SiLU, grouped rows and the widest segment (a cluster in the backward).
SPECS += [
    GatedSpec(kind, arch, act, act, hidden, group_size=group, norm_before_gate=nbg, activation="sigmoid")
    for kind in ("gated_fwd", "gated_bwd")
    for arch in ARCHS
    for act in ("bf16", "fp32")
    for hidden, group, nbg in [(128, 128, True), (512, 512, True), (1024, 1024, False), (16384, 8192, False)]
]
# The statistics kernel (rstd alone, FlashInfer's functional backward): whole rows normalized then
# gated, and groups gated then normalized (it reads z only there).
STATISTICS_SPECS = [
    GatedSpec("gated_rstd", arch, act, act, hidden, group_size=group, norm_before_gate=nbg)
    for arch in ARCHS
    for act in DTYPES
    for hidden, group, nbg in [(128, 128, True), (100, 100, True), (8192, 8192, True), (2048, 512, False)]
] + [
    GatedSpec(
        "gated_rstd", arch, "bf16", "bf16", 2048, group_size=512, norm_before_gate=False, activation="sigmoid"
    )
    for arch in ARCHS
]


def test_a_silu_variant_keeps_its_name():
    """The gate activation is named only when it is not SiLU: SiLU variants keep the names (and disk
    cache files) they had before the activation was a field."""
    variant = ("gated_bwd", "sm_90a", "bf16", "fp32", 2048)
    form = dict(group_size=512, norm_before_gate=False, weight_offset=1.0)
    silu = GatedSpec(*variant, **form)
    assert silu == GatedSpec(*variant, **form, activation="silu")
    assert silu.name() == "cake_gated_bwd_sm_90a_bf16_wfp32_h2048_gbn512_off1"
    sigmoid = GatedSpec(*variant, **form, activation="sigmoid")
    assert sigmoid.name() == "cake_gated_bwd_sm_90a_bf16_wfp32_h2048_gbn512_off1_sigmoid"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path_factory.mktemp("gated_kernels")))
        specs = SPECS + STATISTICS_SPECS
        result = warm(specs, jobs=2)
        assert not result.failed, {o.spec.name(): o.error for o in result.failed}
        return dict(zip(specs, collect_reports(specs, jobs=2)))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name())
def test_compiled_variant(reports, spec):
    """No spill, no atomic; 128-bit loads and stores wherever a segment is whole 16-byte vectors, and
    there a wide-segment backward prefetches later rows of g, x and z into the L2 (one bulk prefetch
    each, at two places)."""
    report = reports[spec]
    assert spill_free(report) and report["local_loads"] == report["local_stores"] == 0, report
    assert report["global_atomics"] == 0
    vectorized = spec.group_size * dtype_bytes(spec.act_dtype) % 16 == 0  # whole 16-byte vectors
    if vectorized:
        assert report["global_load_width_bits"] == report["global_store_width_bits"] == 128, report
    if spec.kind == "gated_bwd":
        config = config_for(spec)
        # g, x and z of the second tile before the loop and of the tile two ahead in it.
        expected = 6 if vectorized and config.prefetch else 0
        assert report["l2_bulk_prefetches"] == expected


@pytest.mark.parametrize("spec", STATISTICS_SPECS, ids=lambda s: s.name())
def test_statistics_kernel_reads_x_and_writes_rstd_alone(reports, spec):
    """No spill, no atomic; per thread, one load of each of its vectors of x (and of z when the gate
    comes first) and one 32-bit store (its row's rstd): no weight, no y."""
    report = reports[spec]
    assert spill_free(report) and report["local_loads"] == report["local_stores"] == 0, report
    assert report["global_atomics"] == 0
    operands = 1 if spec.norm_before_gate else 2
    assert report["ldg_count"] == operands * config_for(spec).tiling.vecs_per_thread, report
    assert report["stg_counts"] == {32: 1}, report


def test_forward_launch_arguments(launches):
    """A strided [T, heads, H] input reaches the kernel as (T * heads, H) rows read in place, with
    rstd as (rows, groups) and the variant's fields naming a spec of the gated_fwd kind."""
    base = torch.randn(8, 4, 2048 + 8, dtype=torch.bfloat16)
    x = base[..., :2048]
    z = torch.randn(8, 4, 2048, dtype=torch.bfloat16)
    y, rstd = gated_ops.gated_rmsnorm_forward(x, z, torch.ones(2048), group_size=512, norm_before_gate=False)
    ((spec, args),) = launches
    assert spec == GatedSpec(
        "gated_fwd", "sm_90a", "bf16", "fp32", 2048, group_size=512, norm_before_gate=False
    )
    assert spec.name() == "cake_gated_fwd_sm_90a_bf16_wfp32_h2048_gbn512_off0"
    kx, kz, kw, ky, krstd, eps = args
    assert kx.shape == (32, 2048) and kx.stride() == (2056, 1) and kx.data_ptr() == x.data_ptr()
    assert kz.shape == ky.shape == (32, 2048) and ky.data_ptr() == y.data_ptr()
    assert krstd.shape == (32, 4) and krstd.is_contiguous() and krstd.data_ptr() == rstd.data_ptr()
    assert rstd.shape == (8, 4, 4) and eps == EPS


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_the_activation_names_the_launched_variants(launches, norm_before_gate):
    """``activation="sigmoid"`` reaches every gated launch as the last field of its variant, which names
    a sigmoid kernel; the dW reduction is the activation's no part."""
    x, z = torch.randn(3, 4, 256), torch.randn(3, 4, 256)
    options = dict(group_size=64, norm_before_gate=norm_before_gate, activation="sigmoid")
    _, rstd = gated_ops.gated_rmsnorm_forward(x, z, torch.ones(256), **options)
    gated_ops.gated_rmsnorm_backward(torch.ones_like(x), x, z, torch.ones(256), rstd, **options)
    (fwd, _), (bwd, _), (dw, _) = launches
    form = "nbg64" if norm_before_gate else "gbn64"
    assert fwd.name() == f"cake_gated_fwd_sm_90a_fp32_wfp32_h256_{form}_off0_sigmoid"
    assert bwd.name() == f"cake_gated_bwd_sm_90a_fp32_wfp32_h256_{form}_off0_sigmoid"
    assert dw == ReduceSpec("sm_90a", "fp32", 256)


def test_backward_launch_arguments(launches):
    """The backward launches its kernel with the program count of the launch plan and padded FP32
    partial rows, then the reduction of those rows into dw."""
    hidden = 4098  # FP32 partial rows padded to whole 16-byte vectors: 4100 columns
    x, z, g = (torch.randn(300, hidden) for _ in range(3))
    rstd = torch.ones(300)
    dx, dz, dw = gated_ops.gated_rmsnorm_backward(g, x, z, torch.ones(hidden), rstd)
    (bwd_fields, bwd_args), (dw_fields, dw_args) = launches
    assert bwd_fields == GatedSpec(
        "gated_bwd", "sm_90a", "fp32", "fp32", hidden, group_size=hidden, norm_before_gate=True
    )
    assert dw_fields == ReduceSpec("sm_90a", "fp32", hidden)
    config = gated_backward_config("sm_90a", "fp32", hidden, hidden)
    programs = min(300, 264)  # one row per CTA at this width: one tile per row
    assert config.tiling.rows_per_cta == 1
    *_, partials, launched_programs = bwd_args
    assert launched_programs == programs
    assert partials.shape == (programs, hidden) and partials.stride() == (4100, 1)
    assert dw_args[0] is partials and dw_args[1] is dw
    assert bwd_args[4].shape == (300, 1) and bwd_args[5].data_ptr() == dx.data_ptr()


def test_no_rows_launch_nothing(launches):
    x = torch.zeros(0, 128, dtype=torch.float16)
    y, rstd = gated_ops.gated_rmsnorm_forward(x, x, torch.ones(128, dtype=torch.float16))
    dx, dz, dw = gated_ops.gated_rmsnorm_backward(x, x, x, torch.ones(128, dtype=torch.float16), rstd)
    assert not launches
    assert y.shape == dx.shape == (0, 128) and rstd.shape == (0,)
    assert dw.dtype == torch.float32 and not dw.any()


def test_rows_are_no_part_of_the_variant(launches):
    """T is a runtime value: calls of 1, 7 and 300 rows launch the one variant (no compile when T
    changes)."""
    w = torch.ones(256, dtype=torch.bfloat16)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        y, rstd = gated_ops.gated_rmsnorm_forward(x, x, w)
        gated_ops.gated_rmsnorm_backward(x, x, x, w, rstd)
    assert len({fields for fields, _ in launches}) == 3  # the forward, the backward, dw's reduction
