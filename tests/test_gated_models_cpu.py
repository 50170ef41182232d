"""The gated norms of the Hugging Face hybrid and linear-attention families on CPU: ``swap_gated_rmsnorm``
on tiny random-init models (2 layers, hidden 64, vocab 128, 8 tokens; no download) against the untouched
model, and ``CakeGatedRMSNorm`` in place of each installed gated norm class, one by one.

What is checked, and the bounds:

* a swapped model's FP32 logits are bitwise the stock model's (the CPU kernels do the classes'
  FP32 operations in their order and round once, which is what each class does in FP32);
* its gradients are within rtol 1e-4 / atol 1e-6 of the stock model's: the backward is the kernels'
  closed form, not autograd's chain through the class's operations (a few FP32 ulps per norm, grown
  through the rest of the model's backward);
* per class, in FP32 and bf16: the swapped module's y bitwise the class's (each class's casts and
  gate activation followed: SiLU, or sigmoid for Kimi Linear, GLM-5 Next, Bailing hybrid and a
  sigmoid-gated Qwen4-exp), dx / dz / dw within the same bound of the class's autograd (bf16: bitwise
  on these shapes, checked within the bf16 tolerance); the classes that name their activation
  (``ACT2FN[self.activation]``) also with the other one;
* per class, the dtype mixes the classes take (x, gate and weight of different dtypes, each class
  casting x and the gate to FP32), with and without CPU autocast: y bitwise the class's, in its dtype,
  gradients within the bound of their dtype; the bf16 / fp16 Mamba-2-style models, whose torch scan
  hands the gated norm an FP32 input and a gate in the model's dtype, swapped: logits bitwise, and a
  training step runs;
* the classes that gate with another activation than SiLU or sigmoid, or otherwise than by one factor
  of the activated gate, or between the norm and the weight, and group sizes not dividing H, are
  refused by name (``GatedNormNotServed``);
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
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from cake_cute import cake_gated_rmsnorm, swap_rmsnorm
from cake_cute.gated.module import CakeGatedRMSNorm, GatedForm, _norm_then_gate
from cake_cute.gated.reference import gated_forward_reference
from cake_cute.gated.swap import GatedNormNotServed, is_gated_norm, swap_gated_rmsnorm
from cake_cute.reference import rel_error, tolerance
from cake_cute.vocab import SIGMOID, SILU

from ._helpers import scaled_then_gated
from ._hf_helpers import mamba2_gated_norm

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, TOKENS = 128, 64, 2, 8
EPS = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class Family:
    """A family's config and causal-LM classes, what makes it tiny (``extra`` over the common sizes;
    ``vision``: a multimodal config whose text config they are, and its tiny vision config), its gated
    norm class and how the swap serves it (cast policy, norm before gate, gate activation)."""

    config: str
    model: str
    norm: str
    policy: str
    norm_before_gate: bool
    extra: dict = field(default_factory=dict)
    activation: str = SILU
    vision: dict | None = None


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
# Kimi Delta Attention layers (and their MLA attention layers), as Kimi Linear and its copies have them.
_KDA = dict(
    layer_types=["linear_attention", "full_attention"],
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    pad_token_id=0,
)
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
    "kimi_linear": Family(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        "KimiLinearRMSNormGated",
        ONE,
        True,
        dict(**_KDA, linear_head_dim=16, linear_num_heads=4, num_local_experts=4),
        SIGMOID,
    ),
    "bailing_hybrid": Family(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        "BailingHybridRMSNormGated",
        ONE,
        True,
        dict(**_KDA, head_dim=16, num_local_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1),
        SIGMOID,
    ),
    # GLM-5 Next's text model under its multimodal class (no image in the batch): KDA layers and
    # indexed MLA attention without rotary dims, one query and key head count.
    "glm5_next": Family(
        "Glm5NextConfig",
        "Glm5NextForConditionalGeneration",
        "Glm5NextTextRMSNormGated",
        ONE,
        True,
        dict(
            _KDA,
            layer_types=["linear_attention", "indexed_attention"],
            num_key_value_heads=4,
            q_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=0,
            linear_head_dim=16,
            linear_num_heads=4,
            n_routed_experts=4,
            index_topk=4,
            index_kpool=4,
            index_head_dim=16,
            index_n_heads=2,
            hc_mult=2,
        ),
        SIGMOID,
        vision=dict(
            depth=1,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=HIDDEN,
            projection_intermediate_size=64,
        ),
    ),
}

# Gated norm classes of the installed transformers, one by one: (family, class, constructor arguments,
# cast policy, norm_before_gate, gate activation), or the reason it is refused.
CLASSES = [
    ("qwen3_next", "Qwen3NextRMSNormGated", {}, RTS, True, SILU),
    ("qwen3_5", "Qwen3_5RMSNormGated", {}, RTS, True, SILU),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated", {}, RTS, True, SILU),
    ("olmo_hybrid", "OlmoHybridRMSNormGated", {}, RTS, True, SILU),
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", {}, RTS, True, SILU),
    ("lara_mini", "LaraMiniRMSNormGated", {}, ONE, True, SILU),
    ("mamba2", MAMBA2_NORM, dict(group_size=16), RTS, False, SILU),
    ("nemotron_h", "NemotronHRMSNormGated", dict(group_size=16), RTS, False, SILU),
    ("bamba", "BambaRMSNormGated", dict(group_size=16), RTS, False, SILU),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", dict(group_size=16), RTS, False, SILU),
    ("zamba2", "Zamba2RMSNormGated", dict(group_size=64), RTS, False, SILU),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=4, norm_before_gate=False), ONE, False, SILU),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=4, norm_before_gate=True), ONE, True, SILU),
    ("kimi_linear", "KimiLinearRMSNormGated", {}, ONE, True, SIGMOID),
    ("glm5_next", "Glm5NextTextRMSNormGated", {}, ONE, True, SIGMOID),
    ("bailing_hybrid", "BailingHybridRMSNormGated", {}, ONE, True, SIGMOID),
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", dict(activation="sigmoid"), RTS, True, SIGMOID),
]
# The classes whose forward gates with ``ACT2FN[self.activation]`` (its activation an attribute a model
# may set either way), as built without arguments.
ACT2FN_FAMILIES = {
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "olmo_hybrid",
    "qwen4_exp",
    "lara_mini",
    "kimi_linear",
    "glm5_next",
    "bailing_hybrid",
}
NAMED_ACTIVATION = [entry for entry in CLASSES if entry[0] in ACT2FN_FAMILIES and not entry[2]]


# Gated norms of no installed class, which a swap must refuse (at module level: the swap reads the
# source of their forward).
class _GatedNormBase(nn.Module):
    """A norm's weight and eps, and its FP32 statistics (``_norm``: the swap reads it with the forward)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, hidden_states):
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class TanhRMSNormGated(_GatedNormBase):
    """Another activation, called directly."""

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = self.weight.to(torch.float32) * self._norm(hidden_states)
        return (hidden_states * torch.tanh(gate.to(torch.float32))).to(input_dtype)


class SelfGatedRMSNormGated(_GatedNormBase):
    """The gate times its own sigmoid (SiLU written out), which a sigmoid factor alone is not."""

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = self.weight.to(torch.float32) * self._norm(hidden_states)
        hidden_states = hidden_states * torch.sigmoid(gate.to(torch.float32)) * gate.to(torch.float32)
        return hidden_states.to(input_dtype)


class MidGateRMSNormGated(_GatedNormBase):
    """The gate between the norm and the weight, with a rounding between them."""

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = self._norm(hidden_states)
        hidden_states = hidden_states * torch.sigmoid(gate.to(torch.float32))
        return self.weight * hidden_states.to(input_dtype)


class LearnedGateRMSNormGated(_GatedNormBase):
    """A gate scaled by a learned parameter before its activation."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps)
        self.gate_scale = nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = self.weight.to(torch.float32) * self._norm(hidden_states)
        hidden_states = hidden_states * torch.sigmoid(gate.to(torch.float32) * self.gate_scale)
        return hidden_states.to(input_dtype)


REFUSED = [
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", dict(activation="gelu"), "'gelu', neither SiLU nor sigmoid"),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=3), "n_groups 3 does not divide the hidden size 64"),
    ("mamba2", MAMBA2_NORM, dict(group_size=24), "group_size 24 does not divide the hidden size 64"),
]
SYNTHETIC_REFUSED = [
    (TanhRMSNormGated, r"its forward does not gate as hidden_states \* silu\(gate\) or sigmoid\(gate\)"),
    (SelfGatedRMSNormGated, r"its forward does not gate as hidden_states \* silu\(gate\) or sigmoid\(gate\)"),
    (MidGateRMSNormGated, "its gate comes between the norm and the weight"),
    (LearnedGateRMSNormGated, "it learns parameters besides its weight"),
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
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    sizes |= family.extra
    config_class = getattr(module, family.config)
    if family.vision is None:
        config = config_class(**sizes)
    else:
        config = config_class(text_config=sizes, vision_config=family.vision)
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
        assert m.activation == family.activation


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


def _assert_swapped_is_the_class(stock, swapped, dtype):
    """y bitwise the class's, its dtype too; gradients within the bound (FP32) or the dtype's tolerance."""
    x, z, g = _norm_inputs(dtype)
    got, want = _run_norm(swapped, x, z, g), _run_norm(stock, x, z, g)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)
        else:
            assert a.dtype == b.dtype and rel_error(a.double(), b.double()) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", CLASSES, ids=_class_id)
def test_class_swapped_forward_bitwise_gradients_within_bound(entry, dtype):
    family, name, kwargs, policy, norm_before_gate, activation = entry
    stock, swapped = _class_pair(family, name, kwargs, dtype)
    assert (swapped.cast_policy, swapped.norm_before_gate) == (policy, norm_before_gate)
    assert swapped.activation == activation
    assert swapped.weight is not stock.weight  # the deep copy's own Parameter, which the swap kept
    _assert_swapped_is_the_class(stock, swapped, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", NAMED_ACTIVATION, ids=_class_id)
def test_class_with_the_other_activation(entry, dtype):
    """A class that gates with ``ACT2FN[self.activation]``, its activation set to the other one (SiLU
    for the sigmoid classes, sigmoid for the SiLU ones): the swap reads the module's activation, and
    the swapped module is the class as before."""
    family, name, kwargs, policy, norm_before_gate, activation = entry
    other = SIGMOID if activation == SILU else SILU
    torch.manual_seed(0)
    stock = _hf_class(family, name)(HIDDEN, eps=EPS, **kwargs).to(dtype)
    stock.activation = other
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    holder = _holding(copy.deepcopy(stock))
    assert swap_gated_rmsnorm(holder) == 1
    swapped = holder.norm
    assert (swapped.activation, swapped.cast_policy, swapped.norm_before_gate) == (
        other,
        policy,
        norm_before_gate,
    )
    _assert_swapped_is_the_class(stock, swapped, dtype)


@pytest.mark.parametrize("entry", CLASSES, ids=_class_id)
def test_class_swapped_in_fp64_computes_what_the_class_computes(entry):
    """An FP64 model: the classes take their statistics from FP32 casts, and so does the swapped norm
    (FP32 math returned in FP64); the products the classes leave in FP64 are rounded once more to FP32,
    a difference within FP32's rounding."""
    family, name, kwargs, *_ = entry
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
    family, name, kwargs, *_ = entry
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


def test_every_installed_gated_class_is_in_the_matrix():
    """Each class named "...NormGated" in the installed transformers' modeling files is checked above,
    served (``CLASSES``) or refused by name (``REFUSED``): a family added to transformers shows here."""
    models = Path(transformers.__file__).parent / "models"
    installed = {
        (path.parent.name, name)
        for path in models.glob("*/modeling_*.py")
        for name in re.findall(r"^class (\w+NormGated)\(", path.read_text(), re.M)
    }
    checked = {(family, name) for family, name, *_ in CLASSES + REFUSED}
    assert installed and installed <= checked, installed - checked


@pytest.mark.parametrize("entry", REFUSED, ids=_class_id)
def test_unserved_classes_are_refused_by_name(entry):
    family, name, kwargs, reason = entry
    stock = _hf_class(family, name)(HIDDEN, eps=EPS, **kwargs)
    holder = _holding(stock)
    with pytest.raises(GatedNormNotServed, match=f"Module.norm \\({name}\\) is not swapped: .*{reason}"):
        swap_gated_rmsnorm(holder)
    assert holder.norm is stock


@pytest.mark.parametrize(("cls", "reason"), SYNTHETIC_REFUSED, ids=[c.__name__ for c, _ in SYNTHETIC_REFUSED])
def test_unrecognized_gates_are_refused_by_name(cls, reason):
    """Another activation, the gate times its own sigmoid, a gate between the norm and the weight, a
    learned gate: each refused with its reason, and nothing replaced (the whole model's swap neither)."""
    holder = _holding(cls(HIDDEN, eps=EPS))
    holder.served = _hf_class("kimi_linear", "KimiLinearRMSNormGated")(HIDDEN, eps=EPS)
    stock = holder.norm
    with pytest.raises(
        GatedNormNotServed, match=f"Module.norm \\({cls.__name__}\\) is not swapped: {reason}"
    ):
        swap_gated_rmsnorm(holder)
    assert holder.norm is stock and not isinstance(holder.served, CakeGatedRMSNorm)


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
    form = GatedForm(EPS, norm.group_size, True, 0.0, policy)
    want = _norm_then_gate(x, z, norm.weight, form)
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


@pytest.mark.parametrize("activation", [SILU, SIGMOID])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", [ONE, RTS, STR])
@pytest.mark.parametrize(("group_size", "norm_before_gate"), [(None, True), (16, False), (16, True)])
def test_module_against_fp64(dtype, policy, group_size, norm_before_gate, activation):
    """y against the FP64 reference: one rounding (FP32: 1e-6; bf16: the dtype's tolerance) or, a
    rounding before the scale or the gate, two roundings (twice the tolerance)."""
    norm = CakeGatedRMSNorm(
        HIDDEN,
        eps=EPS,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        cast_policy=policy,
        activation=activation,
        dtype=dtype,
    )
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z, _ = _norm_inputs(dtype, (16, HIDDEN))
    y = norm(x, z)
    options = dict(group_size=group_size, norm_before_gate=norm_before_gate, activation=activation)
    want, _ = gated_forward_reference(x, z, norm.weight, EPS, **options)
    bound = 1e-6 if dtype == torch.float32 else tolerance(dtype) * (1 if policy == ONE else 2)
    assert rel_error(y.double(), want) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "entry", [CLASSES[0], CLASSES[6], CLASSES[11], CLASSES[13], CLASSES[16]], ids=_class_id
)
def test_compiled_swapped_module(entry, dtype):
    """fullgraph, no break. The kernels' op is opaque to inductor: one rounding (and every FP32 call)
    is bitwise eager. Where the class's casts add torch operations around it (bf16 "round_then_scale"),
    inductor fuses them and keeps their intermediates in FP32, as it does for the stock class: y within
    2**-7 relative of eager, gradients within the bf16 tolerance."""
    family, name, kwargs, policy, _, _ = entry
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
    with pytest.raises(ValueError, match=r"activation must be one of \('silu', 'sigmoid'\), got 'swish'"):
        CakeGatedRMSNorm(HIDDEN, activation="swish")
    with pytest.raises(ValueError, match="cast_policy must be None or one of"):
        swap_gated_rmsnorm(nn.Linear(2, 2), cast_policy="twice")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        swap_gated_rmsnorm(object())
    with pytest.raises(TypeError, match="^gate must be a torch.Tensor, got str"):
        CakeGatedRMSNorm(HIDDEN)(torch.randn(2, HIDDEN), "gate")
    with pytest.raises(TypeError, match="^z must have shape"):
        CakeGatedRMSNorm(HIDDEN)(torch.randn(2, HIDDEN), torch.randn(3, HIDDEN, dtype=torch.bfloat16))
