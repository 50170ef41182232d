"""The memory-efficient mode (``memory_efficient=True``: the norm saves its output y instead of its
input) on CPU, through the custom ops' CPU kernels, which compute the mode's math as the kernel does
(``cpu.backward_from_output``): its error against FP64 beside the default mode's, what autograd saves,
torch.compile, activation checkpointing, DTensor, FSDP2, the module / swap / fuse arguments, and the
refusals.

``python -m tests.test_memory_efficient_cpu`` prints the numerics table of docs/memory.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from cake_cute import CakeRMSNorm, cake_rmsnorm, cake_rmsnorm_fp8, fuse_residual_rmsnorm, swap_rmsnorm
from cake_cute.cpu import xhat_from_output
from cake_cute.kernels.config import SCALE_FLOOR
from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance

from ._helpers import grad_rel_error, saved_by, sum_rel_error

EPS = 1e-6
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHTS = ("normal", "near_zero", "zero_centered")


def _weight(kind: str, hidden: int, dtype, gen) -> tuple[torch.Tensor, float]:
    """(w, weight_offset) of a kind: ``normal`` scales in [0.5, 1.5]; ``near_zero`` magnitudes spread
    log-uniformly over [1e-4, 1] with random signs (trained scales that shrank, none below the clamp);
    ``zero_centered`` Gemma-style ``1 + w`` with w ~ N(0, 0.1^2)."""
    if kind == "normal":
        return (torch.rand(hidden, generator=gen) + 0.5).to(dtype), 0.0
    if kind == "near_zero":
        magnitude = 10.0 ** (-4.0 * torch.rand(hidden, generator=gen))
        sign = torch.where(torch.rand(hidden, generator=gen) < 0.5, -1.0, 1.0)
        return (magnitude * sign).to(dtype), 0.0
    return (0.1 * torch.randn(hidden, generator=gen)).to(dtype), 1.0


def errors(
    rows, hidden, dtype, w_dtype, residual, kind, memory_efficient, seed=0, measure=None, device="cpu"
):
    """(error of dx, error of dw) of one forward + backward on ``device`` against the FP64 reference
    computed from the true h, with the outputs' gradients random: ``reference.rel_error``, or with
    ``measure`` set, measured against the size of the terms where they cancel
    (``_helpers.grad_rel_error``, ``sum_rel_error``: H = 1, T = 1 or 2). The GPU tests use it too."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_()
    r = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_() if residual else None
    w, offset = _weight(kind, hidden, w_dtype or dtype, gen)
    w = w.to(device).requires_grad_()
    g = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    g_h = torch.randn(rows, hidden, generator=gen).to(device, dtype) if residual else None
    out = cake_rmsnorm(x, w, EPS, r, weight_offset=offset, memory_efficient=memory_efficient)
    outs, grads = ((out[0], out[1]), (g, g_h)) if residual else ((out,), (g,))
    torch.autograd.backward(outs, grads)
    _, rstd, h = forward_reference(x.detach(), w.detach(), EPS, None if r is None else r.detach(), offset)
    dx64, dw64 = backward_reference(g, h, w.detach(), rstd, g_h, offset)
    if residual:
        assert torch.equal(r.grad, x.grad)  # one dx for both
    if measure is None:
        return rel_error(x.grad, dx64), rel_error(w.grad, dw64)
    xhat = h.double() * rstd.reshape(-1, 1)
    a = g.double() * (w.detach().double() + offset)
    terms = rstd.reshape(-1, 1) * (a.abs() + xhat.abs() * ((a * xhat).sum(-1, keepdim=True) / hidden).abs())
    dx_scale = terms + (g_h.double().abs() if residual else 0)
    dw_terms = (g.double() * xhat).abs().sum(0)
    return grad_rel_error(x.grad, dx64, dx_scale), sum_rel_error(w.grad, dw64, dw_terms, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_fp32", [False, True], ids=["w-act", "w-fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("rows, hidden", [(0, 7), (1, 1), (2, 7), (129, 4097), (129, 64)])
def test_error_against_fp64_beside_the_default_mode(dtype, w_fp32, residual, kind, rows, hidden):
    """The mode's dx and dw stay within the dtype's tolerance of the FP64 reference, and within three
    times the default mode's error or three units of roundoff of the activation dtype (plus eight
    FP32 units), whichever is larger: xhat = y / s carries y's rounding, which the default's
    xhat = h * rstd has not (so where the default's result is not rounded to the activation dtype --
    dw in an FP32 w, dx at H = 1 -- the mode's error is that rounding's, not a multiple of the
    default's)."""
    w_dtype = torch.float32 if w_fp32 else None
    assert_within_the_modes_bound(rows, hidden, dtype, w_dtype, residual, kind, "cpu")


def assert_within_the_modes_bound(rows, hidden, dtype, w_dtype, residual, kind, device) -> None:
    """The stated bound of the mode's dx and dw error (see the test above); the GPU tests use it too."""
    default, mode = (
        errors(rows, hidden, dtype, w_dtype, residual, kind, me, measure="terms", device=device)
        for me in (False, True)
    )
    # y's rounding (three units of the activation dtype's roundoff), plus the FP32 roundings of the
    # recomputed xhat (1 / s, then y * (1 / s)), which reach dx through a and through xhat * c: eight
    # FP32 units. Beside bf16 or fp16 these vanish; in FP32, where every rounding is one unit, they
    # are the bound (GPU, T = 1, H = 1: 3.6e-7, six units).
    roundoff = 3 * torch.finfo(dtype).eps / 2 + 8 * torch.finfo(torch.float32).eps / 2
    for name, d, m in zip(("dx", "dw"), default, mode):
        assert m <= tolerance(dtype), (name, m)
        assert m <= max(3 * d, roundoff), (name, m, d)


def test_t_zero_gives_empty_dx_and_zero_dw():
    x = torch.empty(0, 8, requires_grad=True)
    w = torch.rand(8, requires_grad=True)
    y = cake_rmsnorm(x, w, EPS, memory_efficient=True)
    y.backward(torch.empty(0, 8))
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8))


def test_a_scale_below_the_clamp_gives_that_column_its_documented_wrong_gradient():
    """Columns whose |w + offset| is below SCALE_FLOOR get xhat = y / SCALE_FLOOR (0 for w = 0): their
    dW and dx are wrong by construction (docs/memory.md); every other column keeps the mode's error."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = (torch.rand(32, generator=gen) + 0.5).requires_grad_()
    clamped = [0, 5, 9]
    with torch.no_grad():
        w[clamped] = torch.tensor([0.0, SCALE_FLOOR / 4, -SCALE_FLOOR / 16])
    g = torch.randn(64, 32, generator=gen)
    y = cake_rmsnorm(x, w, EPS, memory_efficient=True)
    y.backward(g)
    xhat = xhat_from_output(y.detach(), w.detach(), 0.0)
    assert torch.equal(xhat[:, 0], torch.zeros(64))  # s = 0: y = 0, so xhat = 0, never 0 / 0
    torch.testing.assert_close(w.grad[clamped], (g * xhat).sum(0)[clamped], rtol=1e-6, atol=0)
    _, rstd, h = forward_reference(x.detach(), w.detach(), EPS)
    _, dw64 = backward_reference(g, h, w.detach(), rstd)
    kept = [j for j in range(32) if j not in clamped]
    assert rel_error(w.grad[kept], dw64[kept]) < tolerance(torch.float32)
    assert rel_error(w.grad[0], dw64[0]) == 1.0  # the true dW of a zero scale is lost


def test_cpu_backward_is_the_kernel_formula():
    """The CPU op computes xhat = y * (1 / clamp(s)), c = mean(a * xhat), dx = rstd * (a - xhat * c)."""
    gen = torch.Generator().manual_seed(4)
    y, g = (torch.randn(5, 16, generator=gen).bfloat16() for _ in range(2))
    w, rstd = torch.rand(16, generator=gen).bfloat16(), torch.rand(5, generator=gen) + 0.5
    dx, dw = torch.ops.cake_cute.rmsnorm_bwd_from_output(g, y, w, rstd, None, 1.0)
    xhat = y.float() * (w.float() + 1.0).reciprocal()
    a = g.float() * (w.float() + 1.0)
    c = (a * xhat).sum(-1, keepdim=True) / 16
    assert torch.equal(dx, (rstd[:, None] * (a - xhat * c)).bfloat16())
    assert torch.equal(dw, (g.float() * xhat).sum(0).bfloat16())


# --- what autograd saves -----------------------------------------------------------------------------


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _norm_inputs(residual: bool):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, generator=gen).requires_grad_()
    r = torch.randn(2, 3, 16, generator=gen).requires_grad_() if residual else None
    return x, r, (torch.rand(16, generator=gen) + 0.5).requires_grad_()


ENTRIES = {
    "cake_rmsnorm": lambda x, w, r, me: cake_rmsnorm(x, w, EPS, r, memory_efficient=me),
    "op": lambda x, w, r, me: _op_outputs(x, w, r, me),
    "module": lambda x, w, r, me: _module(w, me)(x, residual=r),
}


def _op_outputs(x, w, r, memory_efficient):
    ops = torch.ops.cake_cute
    forward = ops.rmsnorm_fwd_saving_output if memory_efficient else ops.rmsnorm_fwd
    y, _rstd, h_new = forward(x, w, EPS, r)
    return y if r is None else (y, h_new)


def _module(w, memory_efficient):
    norm = CakeRMSNorm(w.shape[0], eps=EPS, memory_efficient=memory_efficient)
    norm.weight = nn.Parameter(w.detach().clone())
    return norm


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_saves_exactly_y_w_rstd_with_y_the_returned_tensor(entry, residual):
    x, r, w = _norm_inputs(residual)
    out, saved = saved_by(lambda: ENTRIES[entry](x, w, r, True))
    y = out[0] if residual else out
    assert len(saved) == 3
    assert _shares_storage(saved[0], y) and saved[0].shape == y.shape
    assert saved[1].shape == (16,) and saved[2].dtype == torch.float32 and saved[2].shape == (2, 3)
    inputs = (x, *([r, out[1]] if residual else []))
    assert not any(_shares_storage(s, t) for s in saved for t in inputs)  # neither x nor h_new


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_the_default_mode_still_saves_its_input(residual):
    x, r, w = _norm_inputs(residual)
    out, saved = saved_by(lambda: cake_rmsnorm(x, w, EPS, r))
    assert len(saved) == 3 and _shares_storage(saved[0], out[1] if residual else x)


def test_a_following_linear_shares_the_saved_y():
    """y is the tensor the next Linear saves as its input: one storage for both."""
    x, _, w = _norm_inputs(False)
    linear = nn.Linear(16, 4)
    ys = []
    _, saved = saved_by(lambda: linear(ys.append(cake_rmsnorm(x, w, EPS, memory_efficient=True)) or ys[0]))
    assert sum(_shares_storage(t, ys[0]) for t in saved) == 2  # the norm's y and the Linear's input


# --- torch.compile, checkpointing ------------------------------------------------------------------


def _grads(fn, x, w, r, residual):
    for t in (x, w, r):
        if t is not None:
            t.grad = None
    out = fn(x, w, r)
    outs = out if residual else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) * 0.5 + o.detach() for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in (x, w, r) if t is not None]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_torch_compile_fullgraph_matches_eager_bitwise(residual):
    x, r, w = _norm_inputs(residual)

    def entry(x, w, r):
        return cake_rmsnorm(x, w, EPS, r, memory_efficient=True)

    expected = _grads(entry, x, w, r, residual)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(entry)(x, w, r)
    assert explanation.graph_break_count == 0
    assert "rmsnorm_fwd_saving_output" in explanation.graphs[0].code
    compiled = torch.compile(entry, fullgraph=True, backend="aot_eager")
    for actual, e in zip(_grads(compiled, x, w, r, residual), expected):
        assert torch.equal(actual, e)


def test_activation_checkpointing_matches_the_plain_backward():
    x, r, w = _norm_inputs(True)
    linear = nn.Linear(16, 16)

    def block(x, w, r):
        y, h = cake_rmsnorm(x, w, EPS, r, memory_efficient=True)
        return linear(y), h

    expected = _grads(block, x, w, r, True)
    for reentrant in (False, True):

        def checkpointed(*args, reentrant=reentrant):
            return checkpoint(block, *args, use_reentrant=reentrant)

        for a, e in zip(_grads(checkpointed, x, w, r, True), expected):
            assert torch.equal(a, e)


# --- DTensor, FSDP2 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("placement", ["Shard(0)", "Shard(1)", "Replicate()"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_dtensor_takes_the_default_modes_sharding_rules(mesh, placement, residual):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    place = eval(placement, {"Shard": Shard, "Replicate": Replicate})  # noqa: S307 -- a fixed id list
    x, r, w = _norm_inputs(residual)
    expected = _grads(lambda x, w, r: cake_rmsnorm(x, w, EPS, r, memory_efficient=True), x, w, r, residual)
    xd, rd = (
        None if t is None else distribute_tensor(t.detach(), mesh, [place]).requires_grad_() for t in (x, r)
    )
    wd = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
    with CommDebugMode() as comm:
        out = cake_rmsnorm(xd, wd, EPS, rd, memory_efficient=True)
        outs = out if residual else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) * 0.5 + o.detach() for o in outs])
    assert comm.get_total_counts() == 0
    assert all(o.placements == (place,) for o in (*outs, xd.grad))
    assert wd.grad.placements == ((Replicate(),) if isinstance(place, Replicate) else (Partial(),))
    actual = [o.full_tensor() for o in outs] + [t.grad.full_tensor() for t in (xd, wd, rd) if t is not None]
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_fsdp2_fully_sharded_model_matches_the_plain_one(mesh):
    from torch.distributed.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), CakeRMSNorm(16, memory_efficient=True), nn.Linear(16, 4))

    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(6))
    plain, sharded = model(), model()
    fully_shard(sharded, mesh=mesh)
    for m in (plain, sharded):
        m(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=0, atol=0, msg=name)


# --- module, swap, fuse, refusals ------------------------------------------------------------------


def test_module_argument_and_extra_repr():
    norm = CakeRMSNorm(16, memory_efficient=True)
    assert norm.memory_efficient is True and "memory_efficient=True" in repr(norm)
    assert "memory_efficient" not in repr(CakeRMSNorm(16))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16, eps=1e-5))


def test_swap_rmsnorm_passes_the_mode_to_every_module():
    model = _Block()
    assert swap_rmsnorm(model, memory_efficient=True) == 2
    assert all(m.memory_efficient for m in model.modules() if isinstance(m, CakeRMSNorm))
    other = _Block()
    swap_rmsnorm(other)
    assert not any(m.memory_efficient for m in other.modules() if isinstance(m, CakeRMSNorm))


def test_fuse_residual_rmsnorm_passes_the_mode_and_keeps_the_loss():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    losses, grads = [], []
    for memory_efficient in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fuse_residual_rmsnorm(model, memory_efficient=memory_efficient)
        norms = [m for m in model.modules() if isinstance(m, CakeRMSNorm)]
        assert norms and all(m.memory_efficient is memory_efficient for m in norms)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.model.norm.weight.grad)
    assert torch.equal(losses[0], losses[1])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "call",
    [
        lambda v: cake_rmsnorm(torch.randn(2, 8), torch.ones(8), EPS, memory_efficient=v),
        lambda v: CakeRMSNorm(8, memory_efficient=v),
        lambda v: swap_rmsnorm(_Block(), memory_efficient=v),
        lambda v: fuse_residual_rmsnorm(_Block(), memory_efficient=v),
        lambda v: cake_rmsnorm_fp8(torch.randn(2, 32), torch.ones(32), memory_efficient=v),
    ],
    ids=["cake_rmsnorm", "CakeRMSNorm", "swap_rmsnorm", "fuse_residual_rmsnorm", "cake_rmsnorm_fp8"],
)
@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_non_bool_is_refused_by_name(call, value):
    with pytest.raises(TypeError, match="memory_efficient must be a bool"):
        call(value)


def test_fp8_output_refuses_the_mode_by_name():
    with pytest.raises(ValueError, match="memory_efficient=True is not available for cake_rmsnorm_fp8"):
        cake_rmsnorm_fp8(torch.randn(2, 32), torch.ones(32), memory_efficient=True)


# --- the numerics table of docs/memory.md ----------------------------------------------------------


def numerics_table(rows: int = 129, hidden: int = 4097) -> str:
    """Markdown rows: dtype, w dtype, weights, then dx and dw errors (default, memory-efficient), plain
    mode, T = ``rows``, H = ``hidden``, on CPU."""
    lines = []
    for dtype in DTYPES:
        for w_dtype in (None, torch.float32):
            for kind in WEIGHTS:
                measured = [errors(rows, hidden, dtype, w_dtype, False, kind, me) for me in (False, True)]
                (dx0, dw0), (dx1, dw1) = measured
                cells = (str(dtype)[6:], "x's" if w_dtype is None else "fp32", kind)
                numbers = (f"{e:.2e}" for e in (dx0, dx1, dw0, dw1))
                lines.append("| " + " | ".join((*cells, *numbers)) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(numerics_table())
