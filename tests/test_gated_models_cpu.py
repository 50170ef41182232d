"""The gated norms of the Hugging Face hybrid and linear-attention families on CPU: ``swap_gated_rmsnorm``
on tiny random-init models (2 layers, hidden 64, vocab 128, 8 tokens; no download) against the untouched
model, and ``CakeGatedRMSNorm`` in place of each installed gated norm class, one by one.

What is checked, and the bounds:

* a swapped model's FP32 logits are bitwise the stock model's (the CPU kernels do the classes'
  FP32 operations in their order and round once, which is what each class does in FP32);
* its gradients are within rtol 1e-4 / atol 1e-6 of the stock model's: the backward is the kernels'
  closed form, not autograd's chain through the class's operations (a few FP32 ulps per norm, grown
  through the rest of the model's backward);
* per class, in FP32 and bf16: the swapped module's y bitwise the class's (each class's casts
  followed), dx / dz / dw within the same bound of the class's autograd (bf16: bitwise on these
  shapes, checked within the bf16 tolerance);
* per class, the dtype mixes the classes take (x, gate and weight of different dtypes, each class
  casting x and the gate to FP32), with and without CPU autocast: y bitwise the class's, in its dtype,
  gradients within the bound of their dtype; the bf16 / fp16 Mamba-2-style models, whose torch scan
  hands the gated norm an FP32 input and a gate in the model's dtype, swapped: logits bitwise, and a
  training step runs;
* the classes that gate with another activation than SiLU, and group sizes not dividing H, are refused
  by name (``GatedNormNotServed``);
* ``cast_policy="one_rounding"`` on a class that rounds twice (Qwen3-Next): within 2**-6 relative of
  the class (docs/gated.md: three bf16 roundings against one);
* numerics against FP64, determinism, and ``torch.compile(fullgraph=True)`` of a swapped module
  bitwise its eager run.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from cake_cute import cake_gated_rmsnorm, swap_rmsnorm
from cake_cute.gated.module import CakeGatedRMSNorm
from cake_cute.gated.reference import gated_forward_reference
from cake_cute.gated.swap import GatedNormNotServed, is_gated_norm, swap_gated_rmsnorm
from cake_cute.reference import rel_error, tolerance

from ._helpers import scaled_then_gated
from ._hf_helpers import mamba2_gated_norm

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, TOKENS = 128, 64, 2, 8
EPS = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class Family:
    """A family's config and causal-LM classes, what makes it tiny, its gated norm class and how the
    swap serves it (cast policy, norm before gate)."""

    config: str
    model: str
    norm: str
    policy: str
    norm_before_gate: bool
    extra: dict = field(default_factory=dict)


_LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_dim=16,
)
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8)
RTS, ONE, STR = "round_then_scale", "one_rounding", "scale_then_round"
MAMBA2_NORM = mamba2_gated_norm()
FAMILIES = {
    "qwen3_next": Family(
        "Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextRMSNormGated", RTS, True, {**_LINEAR, **_MOE}
    ),
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5RMSNormGated", RTS, True, _LINEAR),
    "qwen3_5_moe": Family(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeRMSNormGated",
        RTS,
        True,
        {**_LINEAR, **_MOE},
    ),
    "olmo_hybrid": Family(
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        "OlmoHybridRMSNormGated",
        RTS,
        True,
        dict(pad_token_id=0, layer_types=["linear_attention", "full_attention"]),
    ),
    "lara_mini": Family("LaraMiniConfig", "LaraMiniForCausalLM", "LaraMiniRMSNormGated", ONE, True),
    "mamba2": Family(
        "Mamba2Config",
        "Mamba2ForCausalLM",
        MAMBA2_NORM,
        RTS,
        False,
        dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, expand=2, chunk_size=8),
    ),
    "nemotron_h": Family(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        "NemotronHRMSNormGated",
        RTS,
        False,
        dict(
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=8,
            n_routed_experts=4,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    ),
    "bamba": Family(
        "BambaConfig",
        "BambaForCausalLM",
        "BambaRMSNormGated",
        RTS,
        False,
        dict(attn_layer_indices=[1], **_MAMBA),
    ),
    "granitemoehybrid": Family(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridRMSNormGated",
        RTS,
        False,
        dict(layer_types=["mamba", "attention"], **_MAMBA),
    ),
    "zamba2": Family(
        "Zamba2Config",
        "Zamba2ForCausalLM",
        "Zamba2RMSNormGated",
        RTS,
        False,
        dict(
            layers_block_type=["mamba", "hybrid"],
            mamba_headdim=16,
            n_mamba_heads=8,
            mamba_ngroups=2,
            mamba_d_state=16,
            chunk_size=8,
        ),
    ),
    "falcon_h1": Family(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        "FalconH1RMSNormGated",
        ONE,
        True,
        dict(
            mamba_rms_norm=True,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_ssm=128,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
        ),
    ),
}

# Gated norm classes of the installed transformers, one by one: (family, class, constructor arguments,
# cast policy, norm_before_gate), or the reason it is refused.
CLASSES = [
    ("qwen3_next", "Qwen3NextRMSNormGated", {}, RTS, True),
    ("qwen3_5", "Qwen3_5RMSNormGated", {}, RTS, True),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated", {}, RTS, True),
    ("olmo_hybrid", "OlmoHybridRMSNormGated", {}, RTS, True),
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", {}, RTS, True),
    ("lara_mini", "LaraMiniRMSNormGated", {}, ONE, True),
    ("mamba2", MAMBA2_NORM, dict(group_size=16), RTS, False),
    ("nemotron_h", "NemotronHRMSNormGated", dict(group_size=16), RTS, False),
    ("bamba", "BambaRMSNormGated", dict(group_size=16), RTS, False),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", dict(group_size=16), RTS, False),
    ("zamba2", "Zamba2RMSNormGated", dict(group_size=64), RTS, False),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=4, norm_before_gate=False), ONE, False),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=4, norm_before_gate=True), ONE, True),
]
REFUSED = [
    ("kimi_linear", "KimiLinearRMSNormGated", {}, "gate activation is 'sigmoid', not SiLU"),
    ("bailing_hybrid", "BailingHybridRMSNormGated", {}, "gate activation is 'sigmoid', not SiLU"),
    ("glm5_next", "Glm5NextTextRMSNormGated", {}, "gate activation is 'sigmoid', not SiLU"),
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", dict(activation="sigmoid"), "'sigmoid', not SiLU"),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=3), "n_groups 3 does not divide the hidden size 64"),
    ("mamba2", MAMBA2_NORM, dict(group_size=24), "group_size 24 does not divide the hidden size 64"),
]


def _class_id(entry) -> str:
    return f"{entry[1]}-{'-'.join(f'{k}{v}' for k, v in entry[2].items())}".rstrip("-")


def _hf_class(family: str, name: str):
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    if not hasattr(module, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(module, name)


def _holding(norm: nn.Module) -> nn.Module:
    holder = nn.Module()
    holder.norm = norm
    return holder


def _tiny_model(name: str) -> nn.Module:
    family = FAMILIES[name]
    module = importlib.import_module(f"transformers.models.{name}")
    config = getattr(module, family.config)(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        **family.extra,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(module, family.model)(config).float()
    _randomize_norm_weights(model)
    return model.train()


def _randomize_norm_weights(model: nn.Module) -> None:
    """Weights other than ones, so a weight applied at the wrong point would show."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if is_gated_norm(module):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor):
    """Logits and gradients of a step; asserts that the model called its gated norm modules (a
    model may hand a norm's weight to a fused scan instead, which would make the comparison vacuous)."""
    calls = []
    hooks = [
        m.register_forward_hook(lambda *_: calls.append(1))
        for m in model.modules()
        if isinstance(m, CakeGatedRMSNorm) or is_gated_norm(m)
    ]
    model.zero_grad()
    logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert calls, "the gated norms were not called"
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def swapped_pair(request):
    name = request.param
    stock = _tiny_model(name)
    swapped = copy.deepcopy(stock)
    gated = {type(m).__name__ for m in stock.modules() if is_gated_norm(m)}
    assert gated == {FAMILIES[name].norm}
    count = swap_gated_rmsnorm(swapped)
    return name, stock, swapped, count


def test_every_gated_norm_is_swapped_with_the_family_casts(swapped_pair):
    name, stock, swapped, count = swapped_pair
    family = FAMILIES[name]
    news = [m for m in swapped.modules() if isinstance(m, CakeGatedRMSNorm)]
    assert count == len(news) == len([m for m in stock.modules() if is_gated_norm(m)]) >= 1
    assert not any(is_gated_norm(m) for m in swapped.modules())
    for m in news:
        assert (m.cast_policy, m.norm_before_gate) == (family.policy, family.norm_before_gate)


def test_fp32_logits_bitwise_and_gradients_within_bound(swapped_pair):
    _, stock, swapped, _ = swapped_pair
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(2))
    want_logits, want = _loss_and_grads(stock, ids)
    got_logits, got = _loss_and_grads(swapped, ids)
    assert torch.equal(got_logits, want_logits)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_swapped_model_is_deterministic(swapped_pair):
    _, _, swapped, _ = swapped_pair
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(3))
    (first_logits, first), (second_logits, second) = (_loss_and_grads(swapped, ids) for _ in range(2))
    assert torch.equal(first_logits, second_logits)
    for name in first:
        assert torch.equal(first[name], second[name]), name


# --- class by class -----------------------------------------------------------------------------


def _class_pair(family, name, kwargs, dtype):
    torch.manual_seed(0)
    stock = _hf_class(family, name)(HIDDEN, eps=EPS, **kwargs).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    holder = _holding(copy.deepcopy(stock))
    assert swap_gated_rmsnorm(holder) == 1
    return stock, holder.norm


def _norm_inputs(dtype, shape=(2, 3, HIDDEN)):
    gen = torch.Generator().manual_seed(4)
    x, z, g = (torch.randn(shape, generator=gen) * s for s in (1, 2, 1))
    return x.to(dtype), z.to(dtype), g.to(dtype)


def _run_norm(module, x, z, g):
    xl, zl = (t.detach().clone().requires_grad_() for t in (x, z))
    module.zero_grad()
    y = module(xl, zl)
    y.backward(g.to(y.dtype))
    return y, xl.grad, zl.grad, module.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", CLASSES, ids=_class_id)
def test_class_swapped_forward_bitwise_gradients_within_bound(entry, dtype):
    family, name, kwargs, policy, norm_before_gate = entry
    stock, swapped = _class_pair(family, name, kwargs, dtype)
    assert (swapped.cast_policy, swapped.norm_before_gate) == (policy, norm_before_gate)
    assert swapped.weight is not stock.weight  # the deep copy's own Parameter, which the swap kept
    x, z, g = _norm_inputs(dtype)
    got, want = _run_norm(swapped, x, z, g), _run_norm(stock, x, z, g)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)
        else:
            assert a.dtype == b.dtype and rel_error(a.double(), b.double()) <= tolerance(dtype)


@pytest.mark.parametrize("entry", CLASSES, ids=_class_id)
def test_class_swapped_in_fp64_computes_what_the_class_computes(entry):
    """An FP64 model: the classes take their statistics from FP32 casts, and so does the swapped norm
    (FP32 math returned in FP64); the products the classes leave in FP64 are rounded once more to FP32,
    a difference within FP32's rounding."""
    family, name, kwargs, _policy, _norm_before_gate = entry
    stock, swapped = _class_pair(family, name, kwargs, torch.float64)
    x, z, g = _norm_inputs(torch.float64)
    got, want = _run_norm(swapped, x, z, g), _run_norm(stock, x, z, g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float64
        assert rel_error(a, b) <= 1e-6


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Dtype mixes the classes take, each casting x and the gate to FP32: (x, gate, weight). The first is
# what a Mamba-2 mixer's torch scan hands its norm in a bf16 model (an FP32 scan output, a bf16 gate).
MIXES = [
    (F32, BF16, BF16),
    (F32, F16, F16),
    (F32, BF16, F32),
    (BF16, F32, BF16),
    (F16, BF16, F32),
    (BF16, F16, BF16),
]


def _mix_id(mix) -> str:
    return "-".join(str(dtype).replace("torch.float", "fp").replace("bfp16", "bf16") for dtype in mix)


def _within_bound(actual, expected, name: str) -> None:
    assert actual.dtype == expected.dtype, name
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    else:
        assert rel_error(actual.double(), expected.double()) <= tolerance(actual.dtype), name


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "cpu-autocast"])
@pytest.mark.parametrize("mix", MIXES, ids=_mix_id)
@pytest.mark.parametrize("entry", CLASSES, ids=_class_id)
def test_class_dtype_mixes_are_computed_with_the_class_casts(entry, mix, autocast):
    """x, gate and weight of different dtypes, as each class takes them, without and under CPU bf16
    autocast: the swapped module's y is bitwise the class's, in its dtype, and the gradients are in the
    class's dtypes, within the bound."""
    family, name, kwargs, _, _ = entry
    x_dtype, z_dtype, w_dtype = mix
    stock, swapped = _class_pair(family, name, kwargs, w_dtype)
    x, z, g = _norm_inputs(torch.float32)
    x, z = x.to(x_dtype), z.to(z_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, want = _run_norm(swapped, x, z, g), _run_norm(stock, x, z, g)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    for label, a, b in zip(("dx", "dz", "dw"), got[1:], want[1:]):
        _within_bound(a, b, label)


def test_the_functional_entry_refuses_a_mix_by_name():
    """``cake_gated_rmsnorm`` takes one activation dtype; the module casts a mix (docs/gated.md)."""
    x, z = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN, dtype=BF16)
    with pytest.raises(TypeError, match=r"^z must have dtype float32; got bfloat16"):
        cake_gated_rmsnorm(x, z, torch.ones(HIDDEN))


MAMBA2_STYLE = ["mamba2", "nemotron_h", "bamba", "falcon_h1", "granitemoehybrid", "zamba2"]


def _gated_norm_dtypes(model: nn.Module) -> set:
    """(x, gate) dtypes each gated norm of ``model`` is called with, recorded by its next forwards."""
    seen = set()
    for module in model.modules():
        if is_gated_norm(module):
            module.register_forward_pre_hook(lambda _, args: seen.add(tuple(a.dtype for a in args)))
    return seen


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MAMBA2_STYLE)
def test_half_mamba2_style_model_trains_on_its_torch_scan_path(name, dtype):
    """A bf16 / fp16 model of a Mamba-2 family on its torch scan path (no mamba_ssm) hands each gated
    norm an FP32 input and a gate in the model's dtype. Swapped, the gated norms compute what the
    stock ones compute (logits bitwise, gradients within the dtype's bound), and with the plain norms
    swapped too the model trains a step."""
    stock = _tiny_model(name).to(dtype)
    seen = _gated_norm_dtypes(stock)
    gated = copy.deepcopy(stock)
    swap_gated_rmsnorm(gated)
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(7))
    want_logits, want = _loss_and_grads(stock, ids)
    assert seen == {(torch.float32, dtype)}  # the mix the test is about
    got_logits, got = _loss_and_grads(gated, ids)
    assert torch.equal(got_logits, want_logits)
    assert got.keys() == want.keys()
    for label in want:
        _within_bound(got[label], want[label], label)
    swap_rmsnorm(gated)
    optimizer = torch.optim.SGD(gated.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in gated.parameters()]
    _, grads = _loss_and_grads(gated, ids)
    optimizer.step()
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(not torch.equal(p, b) for p, b in zip(gated.parameters(), before))
    assert torch.isfinite(gated(ids).logits).all()


@pytest.mark.parametrize("entry", REFUSED, ids=_class_id)
def test_unserved_classes_are_refused_by_name(entry):
    family, name, kwargs, reason = entry
    stock = _hf_class(family, name)(HIDDEN, eps=EPS, **kwargs)
    holder = _holding(stock)
    with pytest.raises(GatedNormNotServed, match=f"Module.norm \\({name}\\) is not swapped: .*{reason}"):
        swap_gated_rmsnorm(holder)
    assert holder.norm is stock


def test_one_rounding_on_a_twice_rounding_class_within_the_stated_bound():
    stock, _ = _class_pair("qwen3_next", "Qwen3NextRMSNormGated", {}, torch.bfloat16)
    holder = _holding(copy.deepcopy(stock))
    swap_gated_rmsnorm(holder, cast_policy=ONE)
    x, z, _ = _norm_inputs(torch.bfloat16, (64, 8, HIDDEN))
    got, want = holder.norm(x, z).double(), stock(x, z).double()
    assert (got - want).abs().le(want.abs() * 2.0**-6).all()
    assert not torch.equal(got, want)  # the two policies differ on these rows: the test measures something


def _bytes_kept_beyond(module, x, z) -> int:
    """Bytes autograd keeps for ``module(x, z)``'s backward, beyond x and z themselves."""
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        module(x, z)
    inputs = (x.data_ptr(), z.data_ptr())
    return sum(t.numel() * t.element_size() for t in kept if t.data_ptr() not in inputs)


def test_what_a_swapped_norm_keeps_for_the_backward():
    """``one_rounding`` keeps x, z, w and rstd only; the class's own casts (``round_then_scale``: the
    plain kernel, then torch's gate and products, recomputed in the backward) keep x and z alone; the
    stock class keeps more than either (docs/gated.md)."""
    stock, _ = _class_pair("qwen3_next", "Qwen3NextRMSNormGated", {}, torch.bfloat16)
    x, z, _ = _norm_inputs(torch.bfloat16, (64, 8, HIDDEN))
    x, z = x.requires_grad_(), z.requires_grad_()
    kept = {}
    for policy in (ONE, RTS):
        holder = _holding(copy.deepcopy(stock))
        swap_gated_rmsnorm(holder, cast_policy=policy)
        kept[policy] = _bytes_kept_beyond(holder.norm, x, z)
    rows = x.numel() // HIDDEN
    assert kept[ONE] == HIDDEN * stock.weight.element_size() + 4 * rows  # w and FP32 rstd
    assert kept[RTS] == 0
    assert _bytes_kept_beyond(stock, x, z) > 12 * x.numel()


@pytest.mark.parametrize("policy", [RTS, STR])
@pytest.mark.parametrize("group_size", [None, 16], ids=["whole", "grouped"])
def test_recomputing_the_gate_in_the_backward_keeps_the_bits(group_size, policy):
    """The norm-then-gate forward under the policies that gate after a rounding keeps x and z only and
    its backward recomputes the rest: y and every gradient bitwise those of the same operations
    recorded whole."""
    norm = CakeGatedRMSNorm(HIDDEN, eps=EPS, group_size=group_size, cast_policy=policy, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x, z, dy = _norm_inputs(torch.bfloat16, (64, 8, HIDDEN))
    x, z = x.requires_grad_(), z.requires_grad_()
    got = norm(x, z)
    want = norm._norm_then_gate(x, z)
    assert torch.equal(got, want)
    for a, b in zip(
        torch.autograd.grad(got, (x, z, norm.weight), dy), torch.autograd.grad(want, (x, z, norm.weight), dy)
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dtype", "w_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16", "bf16-w_fp32"],
)
def test_scale_then_round_is_the_scaled_then_gated_form(dtype, w_dtype):
    """``"scale_then_round"`` norm then gate: y bitwise the form's on CPU (the plain kernel with the
    weight rounds once where it rounds first), gradients within the bound of its autograd chain."""
    norm = CakeGatedRMSNorm(HIDDEN, eps=EPS, cast_policy=STR, dtype=w_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z, g = _norm_inputs(dtype, (64, 8, HIDDEN))
    got = _run_norm(norm, x, z, g)
    xl, zl, wl = (t.detach().clone().requires_grad_() for t in (x, z, norm.weight))
    want_y = scaled_then_gated(xl, zl, wl, EPS)
    want_y.backward(g)
    assert torch.equal(got[0], want_y)
    rtol, atol = (GRAD_RTOL, GRAD_ATOL) if dtype == torch.float32 else (tolerance(dtype), tolerance(dtype))
    for name, a, b in zip(("dx", "dz", "dw"), got[1:], (xl.grad, zl.grad, wl.grad)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)


_ACTIVATION_CHECKPOINTING = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
HAS_CHECKPOINT_OFFLOAD = _ACTIVATION_CHECKPOINTING is not None and (
    "offload" in inspect.signature(_ACTIVATION_CHECKPOINTING).parameters
)


def _enable_checkpointing(model, use_reentrant: bool, offload: bool = False) -> None:
    """Hugging Face's activation checkpointing of the decoder layers, either kind; with ``offload``
    (transformers 5.25+) the tensors it saves are held in host memory (``save_on_cpu``)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.25
        offloading = {"offload": True} if offload else {}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **offloading)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_under_autocast_checkpointing_and_compile(compiled):
    """How a Hugging Face user trains: FP32 weights under bf16 autocast, activation checkpointing, and
    each decoder layer compiled: the swapped Qwen3-Next's logits and gradients within the model
    bound of the stock model's run the same way."""
    stock = _tiny_model("qwen3_next")
    swapped = copy.deepcopy(stock)
    swap_gated_rmsnorm(swapped)
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(6))
    runs = []
    for model in (stock, swapped):
        _enable_checkpointing(model, use_reentrant=False)
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(_loss_and_grads(model, ids))
    (want_logits, want), (got_logits, got) = runs
    torch.testing.assert_close(got_logits, want_logits, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


@pytest.mark.parametrize(
    ("use_reentrant", "offload"),
    [
        (False, False),
        (True, False),
        pytest.param(
            False,
            True,
            marks=pytest.mark.skipif(not HAS_CHECKPOINT_OFFLOAD, reason="offload: transformers 5.25+"),
        ),
    ],
    ids=["non_reentrant", "reentrant", "offload"],
)
def test_bf16_model_under_gradient_checkpointing_keeps_the_bits(use_reentrant, offload, monkeypatch):
    """A swapped bf16 Qwen3-Next (its norms under the class's casts, recomputed in their own backward)
    trained with Hugging Face's gradient checkpointing, either kind, and with its saved tensors
    offloaded to host memory: the same logits and gradients, bitwise, as without it. (Offloading pins
    host memory, which needs an accelerator: without one the test keeps the copies unpinned.)"""
    if offload and not torch.accelerator.is_available():
        modeling_utils = importlib.import_module("transformers.modeling_utils")
        unpinned = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=False)
        monkeypatch.setattr(modeling_utils, "save_on_cpu", lambda pin_memory, **kwargs: unpinned(**kwargs))
    model = _tiny_model("qwen3_next").to(torch.bfloat16)
    swap_gated_rmsnorm(model)
    calls = []
    for module in model.modules():
        if isinstance(module, CakeGatedRMSNorm):
            module.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(5))
    want_logits, want = _loss_and_grads(model, ids)
    plain_calls = len(calls)
    _enable_checkpointing(model, use_reentrant, offload)
    got_logits, got = _loss_and_grads(model, ids)
    assert len(calls) == 3 * plain_calls  # the checkpointed layers ran their norms again
    assert torch.equal(got_logits, want_logits)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", [ONE, RTS, STR])
@pytest.mark.parametrize(("group_size", "norm_before_gate"), [(None, True), (16, False), (16, True)])
def test_module_against_fp64(dtype, policy, group_size, norm_before_gate):
    """y against the FP64 reference: one rounding (FP32: 1e-6; bf16: the dtype's tolerance) or, a
    rounding before the scale or the gate, two roundings (twice the tolerance)."""
    norm = CakeGatedRMSNorm(
        HIDDEN,
        eps=EPS,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        cast_policy=policy,
        dtype=dtype,
    )
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z, _ = _norm_inputs(dtype, (16, HIDDEN))
    y = norm(x, z)
    want, _ = gated_forward_reference(
        x, z, norm.weight, EPS, group_size=group_size, norm_before_gate=norm_before_gate
    )
    bound = 1e-6 if dtype == torch.float32 else tolerance(dtype) * (1 if policy == ONE else 2)
    assert rel_error(y.double(), want) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", [CLASSES[0], CLASSES[6], CLASSES[11]], ids=_class_id)
def test_compiled_swapped_module(entry, dtype):
    """fullgraph, no break. The kernels' op is opaque to inductor: one rounding (and every FP32 call)
    is bitwise eager. Where the class's casts add torch operations around it (bf16 "round_then_scale"),
    inductor fuses them and keeps their intermediates in FP32, as it does for the stock class: y within
    2**-7 relative of eager, gradients within the bf16 tolerance."""
    family, name, kwargs, policy, _ = entry
    _, swapped = _class_pair(family, name, kwargs, dtype)
    x, z, g = _norm_inputs(dtype)
    eager = _run_norm(swapped, x, z, g)
    torch._dynamo.reset()
    compiled = _run_norm(torch.compile(swapped, fullgraph=True), x, z, g)
    if policy == ONE or dtype == torch.float32:
        for a, b in zip(compiled, eager):
            assert torch.equal(a, b)
        return
    assert (compiled[0].double() - eager[0].double()).abs().le(eager[0].double().abs() * 2.0**-7).all()
    for a, b in zip(compiled[1:], eager[1:]):
        assert rel_error(a.double(), b.double()) <= tolerance(dtype)


def test_ungated_call_is_the_grouped_norm():
    """gate=None (the Mamba-2 classes accept it): the grouped RMSNorm with the class's casts, within
    one bf16 rounding of the class (the plain kernel's statistics are torch's rms_norm's)."""
    stock, swapped = _class_pair("mamba2", MAMBA2_NORM, dict(group_size=16), torch.bfloat16)
    x, _, _ = _norm_inputs(torch.bfloat16)
    got, want = swapped(x).double(), stock(x).double()
    assert (got - want).abs().le(want.abs() * 2.0**-7).all()


def test_argument_errors():
    with pytest.raises(ValueError, match="group_size must divide"):
        CakeGatedRMSNorm(HIDDEN, group_size=24)
    with pytest.raises(ValueError, match="cast_policy must be one of"):
        CakeGatedRMSNorm(HIDDEN, cast_policy="twice")
    with pytest.raises(ValueError, match="cast_policy must be None or one of"):
        swap_gated_rmsnorm(nn.Linear(2, 2), cast_policy="twice")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        swap_gated_rmsnorm(object())
    with pytest.raises(TypeError, match="^gate must be a torch.Tensor, got str"):
        CakeGatedRMSNorm(HIDDEN)(torch.randn(2, HIDDEN), "gate")
    with pytest.raises(TypeError, match="^z must have shape"):
        CakeGatedRMSNorm(HIDDEN)(torch.randn(2, HIDDEN), torch.randn(3, HIDDEN, dtype=torch.bfloat16))
