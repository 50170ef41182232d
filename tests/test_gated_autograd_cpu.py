"""The gated norm's custom ops and autograd on CPU (no GPU): ``cake_gated_rmsnorm`` against the FP64
reference (``gated_reference``) in both forms and both gate activations (SiLU, sigmoid), what autograd
saves, the fake kernels' outputs, ``torch.compile(fullgraph=True)`` bitwise equal to eager, argument
errors, and the DTensor sharding rules on a one-rank gloo group (heads sharded as under tensor
parallelism).

Tolerances: FP32 y, dx, dz, dw within 1e-5 relative norm of FP64 (FP32 arithmetic over rows of 64);
bf16 within ``reference.tolerance`` of the FP64 value rounded once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from cake_cute.gated.autograd import cake_gated_rmsnorm
from cake_cute.gated.module import CakeGatedRMSNorm
from cake_cute.gated.ops import rstd_shape
from cake_cute.gated.reference import gated_backward_reference, gated_forward_reference
from cake_cute.reference import rel_error, tolerance

EPS = 1e-6
HIDDEN = 64
# (group_size, norm_before_gate): Qwen3-Next rows, Mamba-2 groups, and norm-then-gate in groups.
FORMS = [(None, True), (16, False), (16, True), (None, False)]
ACTIVATIONS = ["silu", "sigmoid"]


def _form_id(form) -> str:
    group, nbg = form
    return ("nbg" if nbg else "gbn") + ("" if group is None else f"-g{group}")


def _inputs(shape=(3, 4, HIDDEN), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, z, g = (torch.randn(shape, generator=gen) * s for s in (1, 2, 1))
    w = torch.rand(shape[-1], generator=gen) + 0.5
    return x.to(dtype), z.to(dtype), w.to(dtype), g.to(dtype)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _run(fn, x, z, w, g, **options):
    """y and the gradients (dx, dz, dw) of fresh leaves."""
    xl, zl, wl = _leaves(x, z, w)
    y = fn(xl, zl, wl, EPS, **options)
    y.backward(g)
    return y, xl.grad, zl.grad, wl.grad


def _references(x, z, w, g, group_size, norm_before_gate, weight_offset=0.0, activation="silu"):
    options = dict(
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        weight_offset=weight_offset,
        activation=activation,
    )
    rows = [t.reshape(-1, t.shape[-1]) for t in (x, z, g)]
    y, _ = gated_forward_reference(rows[0], rows[1], w, EPS, **options)
    return (y, *gated_backward_reference(rows[2], rows[0], rows[1], w, EPS, **options))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_against_the_fp64_reference(form, dtype, activation):
    group_size, nbg = form
    x, z, w, g = _inputs(dtype=dtype)
    options = dict(group_size=group_size, norm_before_gate=nbg, weight_offset=0.25, activation=activation)
    got = _run(cake_gated_rmsnorm, x, z, w, g, **options)
    want = _references(x, z, w, g, group_size, nbg, weight_offset=0.25, activation=activation)
    bound = 1e-5 if dtype == torch.float32 else tolerance(dtype)
    for name, a, b in zip(("y", "dx", "dz", "dw"), got, want):
        assert a.dtype == dtype, name
        assert rel_error(a.reshape(b.shape).double(), b) < bound, name


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_rstd_shape_and_one_group_per_value(form):
    group_size, nbg = form
    x, z, w, _ = _inputs()
    _, rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(x, z, w, EPS, group_size, nbg, 0.0)
    assert rstd.shape == rstd_shape(x, group_size or HIDDEN) and rstd.dtype == torch.float32
    rows = (t.reshape(-1, HIDDEN) for t in (x, z))
    _, want = gated_forward_reference(*rows, w, EPS, group_size=group_size, norm_before_gate=nbg)
    assert rel_error(rstd.reshape(want.shape).double(), want) < 1e-6


def test_saves_exactly_x_z_w_and_rstd():
    x, z, w, _ = _inputs()
    xl, zl, wl = _leaves(x, z, w)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = cake_gated_rmsnorm(xl, zl, wl, EPS)
    _, rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(x, z, w, EPS)
    assert len(saved) == 4
    for got, want in zip(saved, (x, z, w, rstd)):
        assert torch.equal(got, want)
    assert y.grad_fn is not None


def test_an_unused_output_needs_no_backward():
    x, z, w, _ = _inputs()
    xl, zl, wl = _leaves(x, z, w)
    y = cake_gated_rmsnorm(xl, zl, wl, EPS)
    (y.sum() * 0).backward()
    assert torch.equal(xl.grad, torch.zeros_like(x))


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_fake_outputs_are_the_real_ones(form):
    group_size, nbg = form
    x, z, w, g = _inputs(shape=(2, 5, HIDDEN), dtype=torch.bfloat16)
    xt = x.transpose(0, 1)  # strided input: outputs are contiguous either way
    zt = z.transpose(0, 1)
    real = torch.ops.cake_cute.gated_rmsnorm_fwd(xt, zt, w, EPS, group_size, nbg, 0.0)
    meta = torch.ops.cake_cute.gated_rmsnorm_fwd(
        *(t.to("meta") for t in (xt, zt, w)), EPS, group_size, nbg, 0.0
    )
    real_b = torch.ops.cake_cute.gated_rmsnorm_bwd(
        g.transpose(0, 1), xt, zt, w, real[1], group_size, nbg, 0.0
    )
    meta_b = torch.ops.cake_cute.gated_rmsnorm_bwd(
        *(t.to("meta") for t in (g.transpose(0, 1), xt, zt, w, real[1])), group_size, nbg, 0.0
    )
    for r, m in zip((*real, *real_b), (*meta, *meta_b)):
        assert (r.shape, r.stride(), r.dtype) == (m.shape, m.stride(), m.dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_compiled_fullgraph_is_bitwise_eager(form, activation):
    group_size, nbg = form
    x, z, w, g = _inputs()
    options = dict(group_size=group_size, norm_before_gate=nbg, activation=activation)
    torch._dynamo.reset()
    compiled = torch.compile(cake_gated_rmsnorm, fullgraph=True)
    for got, want in zip(
        _run(compiled, x, z, w, g, **options), _run(cake_gated_rmsnorm, x, z, w, g, **options)
    ):
        assert torch.equal(got, want)


def test_compiled_with_dynamic_shapes_is_one_graph():
    """dynamic=True traces the floats as symbols too: the entry's checks leave them to the op's fake
    kernel, so one fullgraph trace serves every row count, bitwise eager."""
    torch._dynamo.reset()
    compiled = torch.compile(cake_gated_rmsnorm, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (5, 9):
        x, z, w, g = _inputs(shape=(rows, 3, HIDDEN))
        for got, want in zip(_run(compiled, x, z, w, g), _run(cake_gated_rmsnorm, x, z, w, g)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_deterministic(activation):
    x, z, w, g = _inputs(shape=(64, 8, HIDDEN), dtype=torch.bfloat16)
    options = dict(group_size=16, activation=activation)
    first, second = (_run(cake_gated_rmsnorm, x, z, w, g, **options) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(z=torch.zeros(3, 4, 32)), ValueError, "z must have shape"),
        (dict(z=torch.zeros(3, 4, HIDDEN, dtype=torch.float16)), TypeError, "z must have dtype"),
        (dict(w=torch.ones(32)), ValueError, r"w must have shape \(64,\)"),
        (dict(group_size=24), ValueError, "group_size must divide"),
        (dict(group_size=16.0), TypeError, "group_size must be an int"),
        (dict(norm_before_gate=1), TypeError, "norm_before_gate must be a bool"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(x=torch.zeros(())), ValueError, "x must have at least 1 dim"),
        (
            dict(activation="swish"),
            ValueError,
            r"activation must be one of \('silu', 'sigmoid'\), got 'swish'",
        ),
        (dict(activation=0), ValueError, "activation must be one of"),
    ],
)
def test_argument_errors_name_the_argument(change, error, match):
    x, z, w, _ = _inputs()
    arguments = dict(x=x, z=z, w=w, eps=EPS) | {
        k: t for k, t in change.items() if k in ("x", "z", "w", "eps")
    }
    options = {k: t for k, t in change.items() if k in ("group_size", "norm_before_gate", "activation")}
    if "x" in change:
        arguments["z"] = torch.zeros_like(change["x"])
    with pytest.raises(error, match=match):
        cake_gated_rmsnorm(**arguments, **options)


def test_the_ops_name_a_bad_activation():
    """Called directly (as compiled graphs call them), the ops refuse an unknown activation by name."""
    x, z, w, g = _inputs()
    with pytest.raises(ValueError, match="activation must be one of"):
        torch.ops.cake_cute.gated_rmsnorm_fwd(x, z, w, EPS, None, True, 0.0, "tanh")
    _, rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(x, z, w, EPS, None, True, 0.0, "sigmoid")
    with pytest.raises(ValueError, match="activation must be one of"):
        torch.ops.cake_cute.gated_rmsnorm_bwd(g, x, z, w, rstd, None, True, 0.0, "tanh")


# --- DTensor, one rank ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
@pytest.mark.parametrize("form", FORMS[:2], ids=_form_id)
def test_dtensor_heads_sharded_placements_and_no_collectives(mesh, placement, form, activation):
    """[T, heads, head_dim] rows sharded on the heads (tensor parallel) or the tokens: x, z, y, dx, dz
    keep the placement, w's gradient is Partial, no collective runs, and every value is the local
    call's."""
    group_size, nbg = form
    x, z, w, g = _inputs()
    options = dict(group_size=group_size, norm_before_gate=nbg, activation=activation)
    xd, zd = (distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, z))
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    gd = distribute_tensor(g, mesh, [placement])
    with CommDebugMode() as comm:
        y = cake_gated_rmsnorm(xd, zd, wd, EPS, **options)
        y.backward(gd)
        _, rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(xd, zd, wd, EPS, group_size, nbg, 0.0, activation)
    assert comm.get_total_counts() == 0
    for t in (y, rstd, xd.grad, zd.grad):
        assert t.placements == (placement,)
    assert wd.grad.placements == ((Replicate(),) if placement == Replicate() else (Partial(),))
    want = _run(cake_gated_rmsnorm, x, z, w, g, **options)
    for got, expected in zip((y, xd.grad, zd.grad, wd.grad), want):
        assert torch.equal(got.full_tensor(), expected)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
def test_dtensor_flashinfer_function(mesh, placement):
    """FlashInfer's autograd entry (``CakeRMSNormSiLUGateFunction``) on rows sharded as under tensor
    parallelism: the placements kept, w's gradient Partial, no collective, cake_gated_rmsnorm's values."""
    from cake_cute import cake_rmsnorm_silu_gate

    x, z, w, g = _inputs()
    xd, zd = (distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, z))
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    gd = distribute_tensor(g, mesh, [placement])
    with CommDebugMode() as comm:
        y = cake_rmsnorm_silu_gate(xd, zd, wd, EPS)
        y.backward(gd)
    assert comm.get_total_counts() == 0
    assert y.placements == xd.grad.placements == zd.grad.placements == (placement,)
    assert wd.grad.placements == (Partial(),)
    for got, expected in zip((y, xd.grad, zd.grad, wd.grad), _run(cake_gated_rmsnorm, x, z, w, g)):
        assert torch.equal(got.full_tensor(), expected)


def _module_run(norm, x, z, g):
    """y and the gradients (dx, dz, dw) of ``norm`` on fresh leaves."""
    xl, zl = _leaves(x, z)
    y = norm(xl, zl)
    y.backward(g)
    return y, xl.grad, zl.grad, norm.weight.grad


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
@pytest.mark.parametrize("policy", ["round_then_scale", "one_rounding"])
@pytest.mark.parametrize("form", FORMS[:3], ids=_form_id)
def test_dtensor_module_under_either_cast_policy(mesh, placement, policy, form):
    """A bf16 ``CakeGatedRMSNorm`` with a replicated weight on rows sharded as under tensor parallelism
    (the class's casts: the plain kernel and torch's products, recomputed in the backward in eager
    mode): the placements kept, w's gradient Partial, no collective, every value the local module's."""
    group_size, nbg = form
    x, z, w, g = _inputs(dtype=torch.bfloat16)

    def module(weight):
        norm = CakeGatedRMSNorm(HIDDEN, EPS, group_size=group_size, norm_before_gate=nbg, cast_policy=policy)
        norm.weight = torch.nn.Parameter(weight)
        return norm

    want = _module_run(module(w.clone()), x, z, g)
    xd, zd, gd = (distribute_tensor(t, mesh, [placement]) for t in (x, z, g))
    norm = module(distribute_tensor(w.clone(), mesh, [Replicate()]))
    with CommDebugMode() as comm:
        got = _module_run(norm, xd, zd, gd)
    assert comm.get_total_counts() == 0
    assert all(t.placements == (placement,) for t in got[:3]) and got[3].placements == (Partial(),)
    for a, b in zip(got, want):
        assert torch.equal(a.full_tensor(), b)


def test_dtensor_sharded_hidden_dim_is_refused(mesh):
    x, z, w, _ = _inputs()
    xd, zd = (distribute_tensor(t, mesh, [Shard(2)]) for t in (x, z))
    with pytest.raises(Exception, match=r"gated RMSNorm normalizes over the last \(hidden\) dimension"):
        cake_gated_rmsnorm(xd, zd, distribute_tensor(w, mesh, [Replicate()]), EPS)
