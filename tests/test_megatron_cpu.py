"""Megatron-Core integration on the CPU: the cake norm builder against ``TransformerConfig``'s norm fields,
the layer and block specs inside Megatron's ``TransformerLayer`` / ``GPTModel`` (TP = 1, a gloo group of
world size 1), checkpoints between the stock and the cake norms, the gradient all-reduce marking, and
numerics against the stock local spec. The CPU kernels compute torch's CPU rms_norm op for op, so a
norm's outputs and gradients, and a model's forward, are bitwise the stock ones; the gradient of the
residual stream is not: torch's CPU RMSNorm backward is several autograd nodes, whose contributions the
engine adds into the residual's gradient one by one, while a cake norm hands back one dx (a different
order of FP32 additions, a few ulp).

What of Megatron does not run on a CPU, and the stand-ins this harness uses (``benchmarks/megatron_cpu.py``):
the local attention's score buffer (``GlobalMemoryBuffer`` allocates on ``torch.cuda.current_device()``),
the CUDA RNG tracker forked around dropout, and the default causal mask (built on CUDA; passed explicitly
here). The fused-residual form inside ``TransformerLayer`` needs Megatron-Core 0.17+ (the version that
accepts ``(output, residual)`` from a norm); older versions check it on the norm alone.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from cake_cute import CakeRMSNorm  # noqa: E402
from cake_cute.integrations.megatron import (  # noqa: E402
    CakeSpecProvider,
    MegatronCakeQKRMSNorm,
    MegatronCakeResidualRMSNorm,
    MegatronCakeRMSNorm,
    get_gpt_decoder_block_spec,
    get_gpt_layer_spec,
    with_cake_norms,
)

from ._helpers import assert_bitwise_equal, fixed_seed, saved_by  # noqa: E402, F401
from ._megatron_cpu import BENCHMARKS, CPU  # noqa: E402

HIDDEN, HEADS, VOCAB, SEQ, BATCH = 64, 4, 96, 12, 2
# TransformerLayer accepts (output, residual) from a norm from Megatron-Core 0.17 on, the version that
# added this field.
HAS_FUSED_RESIDUAL_LAYER = "fused_residual_rmsnorm" in TransformerConfig.__dataclass_fields__


def make_config(config_class=TransformerConfig, **fields) -> TransformerConfig:
    """A small RMSNorm GPT config that runs on the CPU: CPU initialization, fusions off, no dropout
    (a ``TransformerConfig``, or ``config_class``, e.g. ``MLATransformerConfig``)."""
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
    )
    base.update(fields)
    return config_class(**base)


def with_fields(config, **fields):
    """A copy of ``config`` with fields set after construction (``TransformerConfig`` refuses some of
    them at TP = 1, e.g. sequence_parallel, though a norm only reads them)."""
    config = copy.copy(config)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def assert_gradients_close(actual: dict, expected: dict) -> None:
    """Every gradient within 1e-5 of the stock model's, relative to its largest element: the residual
    stream's gradient sums the same terms in another order (a few FP32 ulp, which a weight gradient's
    sums can cancel down to small elements)."""
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(
            actual[name], grad, rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def get_submodules(spec):
    """A sublayer spec's submodules: a ModuleSpec's, or those of a functools.partial (0.18+ MLPs)."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def with_submodules(spec, submodules):
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)


def rms_norm(x, weight, eps):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


# --- the norm builder and the config fields -------------------------------------------------------------


def test_builder_protocol_reads_eps_dtype_and_device():
    config = make_config(layernorm_epsilon=1e-4, params_dtype=torch.bfloat16)
    norm = MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN, eps=3e-5)
    assert isinstance(norm, CakeRMSNorm)
    assert norm.eps == 3e-5 and norm.weight.dtype == torch.bfloat16 and norm.weight.device.type == "cpu"
    assert torch.equal(norm.weight, torch.ones(HIDDEN, dtype=torch.bfloat16))
    assert MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN).eps == 1e-4
    with pytest.raises(TypeError):
        MegatronCakeRMSNorm(config, HIDDEN)  # keyword-only, as Megatron's LayerNormBuilder


def test_norm_matches_torch_rms_norm_bitwise():
    config = make_config(layernorm_epsilon=1e-5)
    norm = MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN)
    stock = torch.nn.RMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        stock.weight.copy_(norm.weight)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    x_stock = x.detach().clone().requires_grad_()
    g = torch.randn(SEQ, BATCH, HIDDEN)
    y, y_stock = norm(x), stock(x_stock)
    (y * g).sum().backward()
    (y_stock * g).sum().backward()
    assert_bitwise_equal(y, y_stock, "y")
    assert_bitwise_equal(x.grad, x_stock.grad, "dx")
    assert_bitwise_equal(norm.weight.grad, stock.weight.grad, "dw")


def test_zero_centered_gamma_scales_by_one_plus_weight():
    config = make_config(layernorm_zero_centered_gamma=True)
    norm = MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN)
    assert torch.equal(norm.weight, torch.zeros(HIDDEN)) and norm.weight_offset == 1.0
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    weight = norm.weight.detach().clone().requires_grad_()
    expected = rms_norm(x, 1.0 + weight, config.layernorm_epsilon)
    y = norm(x)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (expected * g).sum().backward()
    torch.testing.assert_close(norm.weight.grad, weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(normalization="LayerNorm"), "config.normalization"),
    ],
)
def test_unsupported_norm_fields_are_named_errors(fields, named):
    config = make_config(**{k: v for k, v in fields.items() if k != "normalization"})
    config = with_fields(config, **fields)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN)


def test_layernorm_model_is_refused_at_construction(megatron_cpu):
    config = make_config(normalization="LayerNorm")
    with pytest.raises(ValueError, match=r"config\.normalization must be 'RMSNorm'"):
        GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        )


def test_qk_norm_refuses_qk_l2_norm():
    config = with_fields(make_config(), qk_l2_norm=True)
    with pytest.raises(ValueError, match=r"config\.qk_l2_norm"):
        MegatronCakeQKRMSNorm(config=config, hidden_size=HIDDEN // HEADS)


def test_qk_norm_refuses_a_config_without_qk_layernorm():
    with pytest.raises(ValueError, match=r"config\.qk_layernorm is off"):
        MegatronCakeQKRMSNorm(config=make_config(qk_layernorm=False), hidden_size=HIDDEN // HEADS)


def test_spec_without_qk_norms_refuses_qk_layernorm(megatron_cpu):
    """Megatron would build the layer without q/k norms (0.19: an IdentityOp in their place): the input
    norm of a spec without them refuses the config instead."""
    with pytest.raises(ValueError, match=r"config\.qk_layernorm is set"):
        _gpt(make_config(qk_layernorm=True), get_gpt_layer_spec(qk_layernorm=False))


def test_persist_layer_norm_is_accepted_and_changes_nothing():
    x = torch.randn(SEQ, BATCH, HIDDEN)
    plain = MegatronCakeRMSNorm(config=make_config(), hidden_size=HIDDEN)
    persist = MegatronCakeRMSNorm(config=make_config(persist_layer_norm=True), hidden_size=HIDDEN)
    assert_bitwise_equal(persist(x), plain(x), "y")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
def test_cuda_initialization_without_cuda_is_a_named_error():
    config = with_fields(make_config(), use_cpu_initialization=False)
    with pytest.raises(ValueError, match=r"config\.use_cpu_initialization"):
        MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN)


def test_perform_initialization_off_still_starts_from_the_constant():
    """The norm's start (ones; zeros with zero-centered gamma) draws no random numbers, so there is
    nothing for perform_initialization=False to skip, as for TE's and torch's norms."""
    config = make_config(perform_initialization=False)
    assert torch.equal(MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN).weight, torch.ones(HIDDEN))
    state = torch.get_rng_state()
    MegatronCakeRMSNorm(config=make_config(), hidden_size=HIDDEN)
    assert torch.equal(torch.get_rng_state(), state)


def test_meta_device_initialization():
    config = with_fields(make_config(), use_cpu_initialization=False, init_model_with_meta_device=True)
    assert MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN).weight.is_meta


def test_sequence_parallel_marks_the_weight():
    config = with_fields(make_config(), sequence_parallel=True)
    assert MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN).weight.sequence_parallel is True
    assert not getattr(
        MegatronCakeRMSNorm(config=make_config(), hidden_size=HIDDEN).weight, "sequence_parallel", 0
    )


def test_state_dict_is_torch_rms_norms():
    norm = MegatronCakeRMSNorm(config=make_config(), hidden_size=HIDDEN)
    assert norm.state_dict().keys() == torch.nn.RMSNorm(HIDDEN).state_dict().keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_residual_form_returns_the_input_and_adds_its_gradient(dtype):
    config = with_fields(make_config(params_dtype=dtype), fused_residual_rmsnorm=True)
    fused = MegatronCakeResidualRMSNorm(config=config, hidden_size=HIDDEN)
    plain = MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN)  # has_residual=False: no fused form
    with torch.no_grad():
        fused.weight.normal_()
        plain.weight.copy_(fused.weight)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g, g_res = torch.randn_like(x), torch.randn_like(x)
    y, residual = fused(x)
    y_ref = plain(x_ref)
    assert_bitwise_equal(y, y_ref, "y")
    assert_bitwise_equal(residual, x, "residual")
    ((y * g).sum() + (residual * g_res).float().sum()).backward()
    ((y_ref * g).sum() + (x_ref * g_res).float().sum()).backward()
    assert_bitwise_equal(fused.weight.grad, plain.weight.grad, "dw")
    if dtype == torch.float32:  # one FP32 rounding per step either way
        assert_bitwise_equal(x.grad, x_ref.grad, "dx")
    else:  # the fused backward rounds (norm dx + residual grad) once, autograd rounds each then the sum
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fused_residual", [False, True], ids=["plain", "fused-residual"])
def test_memory_efficient_layer_norm_saves_the_output(fused_residual):
    """``memory_efficient_layer_norm`` is the memory-efficient mode: the norm saves its output y (which
    the next linear layer keeps), not its input, and its gradients are the default mode's within the
    mode's stated bound (FP32 here: a few units of roundoff)."""
    fields = dict(fused_residual_rmsnorm=True) if fused_residual else {}
    norms = [
        MegatronCakeResidualRMSNorm(config=with_fields(make_config(), **fields, **mode), hidden_size=HIDDEN)
        for mode in ({}, dict(memory_efficient_layer_norm=True))
    ]
    assert [norm.memory_efficient for norm in norms] == [False, True]
    with torch.no_grad():
        norms[0].weight.normal_()
        norms[1].weight.copy_(norms[0].weight)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    g = torch.randn_like(x)
    grads = []
    for norm in norms:
        h = x.clone().requires_grad_()
        out, saved = saved_by(lambda: norm(h))  # noqa: B023 (called at once)
        y = out[0] if fused_residual else out
        saved_ptrs = {t.data_ptr() for t in saved}
        assert (y.data_ptr() in saved_ptrs, h.data_ptr() in saved_ptrs) == (
            (True, False) if norm.memory_efficient else (False, True)
        )
        (y * g).sum().backward()
        grads.append((h.grad, norm.weight.grad))
    for mode, default in zip(grads[1], grads[0]):
        torch.testing.assert_close(mode, default, rtol=1e-5, atol=1e-5)


def test_fused_residual_needs_has_residual_and_the_field():
    fused_config = with_fields(make_config(), fused_residual_rmsnorm=True)
    assert MegatronCakeResidualRMSNorm(config=fused_config, hidden_size=HIDDEN).fused_residual
    assert not MegatronCakeRMSNorm(config=fused_config, hidden_size=HIDDEN).fused_residual
    assert not MegatronCakeResidualRMSNorm(config=make_config(), hidden_size=HIDDEN).fused_residual


# --- specs ---------------------------------------------------------------------------------------------


def _norm_classes(submodules):
    attention = submodules.self_attention.submodules
    return (
        submodules.input_layernorm,
        submodules.pre_mlp_layernorm,
        attention.q_layernorm,
        attention.k_layernorm,
    )


def test_layer_spec_puts_cake_norms_in_every_norm_slot():
    spec = get_gpt_layer_spec(qk_layernorm=True)
    assert _norm_classes(spec.submodules) == (
        MegatronCakeResidualRMSNorm,
        MegatronCakeResidualRMSNorm,
        MegatronCakeQKRMSNorm,
        MegatronCakeQKRMSNorm,
    )
    stock = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    assert spec.submodules.sharded_state_dict_keys_map == stock.submodules.sharded_state_dict_keys_map


def test_qk_l2_norm_spec_keeps_megatrons_l2_norm():
    from megatron.core.transformer.torch_norm import L2Norm

    attention = get_gpt_layer_spec(qk_l2_norm=True).submodules.self_attention.submodules
    assert attention.q_layernorm is L2Norm and attention.k_layernorm is L2Norm


def test_spec_provider_returns_cake_builders():
    provider = CakeSpecProvider()
    assert provider.layer_norm(rms_norm=True) is MegatronCakeRMSNorm
    assert provider.layer_norm(rms_norm=True, has_residual=True) is MegatronCakeResidualRMSNorm
    assert provider.layer_norm(rms_norm=True, for_qk=True) is MegatronCakeQKRMSNorm
    assert (
        provider.column_parallel_linear()
        is get_submodules(get_gpt_layer_local_spec().submodules.mlp).linear_fc1
    )


def test_te_fused_norm_linear_is_unfused(monkeypatch):
    """Transformer Engine's spec fuses the input and pre-MLP norms into ``TELayerNormColumnParallelLinear``
    (its norm slots hold ``IdentityOp``): the cake spec keeps TE's plain linear after a cake norm, under the
    fused layer's checkpoint names. Checked on the spec (TE does not run here)."""
    from megatron.core.extensions import transformer_engine as te_ext

    monkeypatch.setattr("cake_cute.integrations.megatron_specs.HAS_TE", True)
    local = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    fused_qkv = dataclasses.replace(
        local.submodules.self_attention.submodules, linear_qkv=te_ext.TELayerNormColumnParallelLinear
    )
    fused_fc1 = dataclasses.replace(
        get_submodules(local.submodules.mlp), linear_fc1=te_ext.TELayerNormColumnParallelLinear
    )
    te_like = dataclasses.replace(
        local,
        submodules=dataclasses.replace(
            local.submodules,
            input_layernorm=IdentityOp,
            pre_mlp_layernorm=IdentityOp,
            self_attention=dataclasses.replace(local.submodules.self_attention, submodules=fused_qkv),
            mlp=with_submodules(local.submodules.mlp, fused_fc1),
            sharded_state_dict_keys_map={},
        ),
    )
    cake = with_cake_norms(te_like).submodules
    assert cake.input_layernorm is MegatronCakeResidualRMSNorm
    assert cake.pre_mlp_layernorm is MegatronCakeResidualRMSNorm
    assert cake.self_attention.submodules.linear_qkv is te_ext.TEColumnParallelLinear
    assert get_submodules(cake.mlp).linear_fc1 is te_ext.TEColumnParallelLinear
    assert cake.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }


def test_multi_latent_attention_layer_takes_the_residual_input_norm():
    """MLA's q / kv norm slots may be empty under qk_layernorm (TE's spec fuses those norms into its
    up-projections), so its layer's input norm is the one that does not refuse the field."""
    spec = with_cake_norms(get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm"))
    assert spec.submodules.input_layernorm is MegatronCakeResidualRMSNorm


def test_with_cake_norms_refuses_other_specs():
    with pytest.raises(TypeError, match="spec must be"):
        with_cake_norms(object())


# --- inside Megatron's modules -------------------------------------------------------------------------


def _gpt(config, spec, seed=0, **kwargs):
    torch.manual_seed(seed)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ, **kwargs
    )


def _tokens(seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ)


def _loss_and_grads(model, tokens, positions):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, CPU.causal_mask(SEQ), labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_tracks_stock(cake, stock) -> None:
    """The cake model, loaded from the stock one's state dict: its loss bitwise the stock one's (the forward
    is the same arithmetic), its gradients within ``assert_gradients_close``'s bound."""
    cake.load_state_dict(stock.state_dict())
    tokens, positions = _tokens()
    loss_stock, grads_stock = _loss_and_grads(stock, tokens, positions)
    loss_cake, grads_cake = _loss_and_grads(cake, tokens, positions)
    assert_bitwise_equal(loss_cake, loss_stock, "loss")
    assert_gradients_close(grads_cake, grads_stock)


def test_layer_output_bitwise_and_gradients_close_to_stock(megatron_cpu):
    config = make_config(qk_layernorm=True)
    torch.manual_seed(0)
    stock = build_module(
        get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), config=config, layer_number=1
    )
    torch.manual_seed(0)
    cake = build_module(get_gpt_layer_spec(qk_layernorm=True), config=config, layer_number=1)
    cake.load_state_dict(stock.state_dict())
    assert type(cake.self_attention.q_layernorm) is MegatronCakeQKRMSNorm
    assert cake.self_attention.k_layernorm.normalized_shape == (HIDDEN // HEADS,)  # the head size
    x = torch.randn(SEQ, BATCH, HIDDEN)
    outs = []
    for layer in (stock, cake):
        h = x.clone().requires_grad_()
        out, _ = layer(h, attention_mask=CPU.causal_mask(SEQ))
        out.square().sum().backward()
        outs.append((out, h.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert_bitwise_equal(outs[1][0], outs[0][0], "layer output")
    assert_gradients_close(outs[1][2] | {"input": outs[1][1]}, outs[0][2] | {"input": outs[0][1]})


def test_gpt_model_loss_bitwise_and_gradients_close_to_stock(megatron_cpu):
    config = make_config(qk_layernorm=True)
    stock = _gpt(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    block = get_gpt_decoder_block_spec(config)
    assert isinstance(block, TransformerBlockSubmodules) and len(block.layer_specs) == config.num_layers
    cake = _gpt(config, block)
    assert type(cake.decoder.final_layernorm) is MegatronCakeRMSNorm
    assert type(stock.decoder.final_layernorm) is torch.nn.RMSNorm
    assert cake.state_dict().keys() == stock.state_dict().keys()
    assert_tracks_stock(cake, stock)


def loss_curve(model, steps=3) -> list:
    """The losses of ``steps`` AdamW steps (lr 1e-2), one token batch each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss, _ = _loss_and_grads(model, *_tokens(seed=step))
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_steps_track_stock(megatron_cpu):
    config = make_config(qk_layernorm=True)
    models = [
        _gpt(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")),
        _gpt(config, get_gpt_decoder_block_spec(config)),
    ]
    models[1].load_state_dict(models[0].state_dict())
    curves = [loss_curve(model) for model in models]
    assert curves[1][0] == curves[0][0]  # the forward is the same arithmetic
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-5, atol=0)


def test_zero_centered_gamma_model_builds_zero_weights(megatron_cpu):
    config = make_config(layernorm_zero_centered_gamma=True, qk_layernorm=True)
    model = _gpt(config, get_gpt_decoder_block_spec(config))
    norms = [m for m in model.modules() if isinstance(m, MegatronCakeRMSNorm)]
    assert len(norms) == 4 * config.num_layers + 1
    assert all(n.weight_offset == 1.0 and not n.weight.any() for n in norms)


def _fake_tp_group_of_two():
    class TwoRanks:
        def size(self):
            return 2

    return TwoRanks()


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "qk-names"])
def test_finalize_model_grads_all_reduces_the_norm_weights(megatron_cpu, monkeypatch, sequence_parallel):
    """Megatron's ``finalize_model_grads`` sums over the TP group the grads of weights marked
    ``sequence_parallel`` (with config.sequence_parallel) and of q/k norm weights by name (with
    qk_layernorm). TP is 1 here, so the group is a stand-in of size 2 and all_reduce doubles in place."""
    from megatron.core.distributed import DistributedDataParallelConfig

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    allreduce = getattr(finalize, "_allreduce_non_tensor_model_parallel_grads", None) or (
        finalize._allreduce_layernorm_grads
    )
    config = make_config(qk_layernorm=True)
    model = _gpt(with_fields(config, sequence_parallel=sequence_parallel), get_gpt_decoder_block_spec(config))
    model.ddp_config = DistributedDataParallelConfig()
    _loss_and_grads(model, *_tokens())
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, **_: tensor.mul_(2))
    allreduce([model], with_fields(config, sequence_parallel=sequence_parallel), _fake_tp_group_of_two())
    summed = {name for name, p in model.named_parameters() if not torch.equal(p.grad, before[name])}
    norms = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, MegatronCakeRMSNorm)}
    qk_norms = {name for name in norms if "q_layernorm" in name or "k_layernorm" in name}
    assert len(qk_norms) == 2 * config.num_layers
    assert summed == (norms if sequence_parallel else qk_norms)


# --- checkpoints ---------------------------------------------------------------------------------------


def _dist_checkpoint_round_trip(source, target, directory):
    """Megatron's ``dist_checkpointing`` save and load (its default ``torch_dist`` format)."""
    from megatron.core import dist_checkpointing

    directory.mkdir()
    dist_checkpointing.save(source.sharded_state_dict(), str(directory))
    loaded = dist_checkpointing.load(target.sharded_state_dict(), str(directory))
    target.load_state_dict(loaded)


@pytest.mark.parametrize("direction", ["stock-to-cake", "cake-to-stock"])
def test_dist_checkpoint_moves_between_stock_and_cake(megatron_cpu, tmp_path, direction):
    config = make_config(qk_layernorm=True)
    stock = _gpt(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), seed=0)
    cake = _gpt(config, get_gpt_decoder_block_spec(config), seed=1)
    source, target = (stock, cake) if direction == "stock-to-cake" else (cake, stock)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    with CPU.cuda_calls_on_cpu():  # the torch_dist writer synchronizes CUDA and allocates a flag there
        _dist_checkpoint_round_trip(source, target, tmp_path / "ckpt")
    for (name, want), (_, got) in zip(source.state_dict().items(), target.state_dict().items()):
        if isinstance(want, torch.Tensor):
            assert_bitwise_equal(got, want, name)


def test_sharded_keys_are_the_stock_and_te_names(megatron_cpu):
    config = make_config(qk_layernorm=True)
    stock = _gpt(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    cake = _gpt(config, get_gpt_decoder_block_spec(config))
    keys = {k: v.key for k, v in cake.sharded_state_dict().items() if hasattr(v, "key")}
    assert keys == {k: v.key for k, v in stock.sharded_state_dict().items() if hasattr(v, "key")}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys.values()


# --- the fused-residual form inside TransformerLayer (Megatron-Core 0.17+) -----------------------------


@pytest.mark.skipif(
    not HAS_FUSED_RESIDUAL_LAYER, reason="TransformerLayer takes (output, residual) from 0.17"
)
def test_fused_residual_layer_matches_stock(megatron_cpu):
    config = make_config(qk_layernorm=True, fused_residual_rmsnorm=True)
    stock = _gpt(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    cake = _gpt(config, get_gpt_decoder_block_spec(config))
    assert cake.decoder.layers[0].input_layernorm.fused_residual
    assert_tracks_stock(cake, stock)


# --- multi-token prediction -----------------------------------------------------------------------------


def test_multi_token_prediction_norms_are_cake_norms_and_track_stock(megatron_cpu):
    """``get_gpt_mtp_block_spec``: Megatron's MTP block for the cake block, its enorm, hnorm and final norm
    cake norms (the MTP layer's own transformer layer is the block's last, cake norms already); the
    model with MTP against the stock one with its MTP (the MTP loss enters through the backward)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec as stock_mtp_block_spec

    from cake_cute.integrations.megatron import get_gpt_mtp_block_spec

    config = make_config(qk_layernorm=True, mtp_num_layers=1)
    stock_layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    block = get_gpt_decoder_block_spec(config)
    mtp = get_gpt_mtp_block_spec(config, block)
    assert mtp.layer_specs[0].submodules.enorm is MegatronCakeRMSNorm
    stock_mtp = stock_mtp_block_spec(config, stock_layer, use_transformer_engine=False)
    stock = _gpt(config, stock_layer, mtp_block_spec=stock_mtp)
    cake = _gpt(config, block, mtp_block_spec=mtp)
    norms = [name for name, m in cake.mtp.named_modules() if isinstance(m, MegatronCakeRMSNorm)]
    assert {"layers.0.enorm", "layers.0.hnorm", "layers.0.final_layernorm"} <= set(norms)
    with CPU.cuda_calls_on_cpu():  # the MTP loss tracker allocates on the current CUDA device
        assert_tracks_stock(cake, stock)


def test_no_multi_token_prediction_block_without_mtp_layers(megatron_cpu):
    from cake_cute.integrations.megatron import get_gpt_mtp_block_spec

    config = make_config(qk_layernorm=True)
    assert get_gpt_mtp_block_spec(config, get_gpt_decoder_block_spec(config)) is None


# --- selective recomputation of the norms ----------------------------------------------------------------


def test_selective_norm_recompute_matches_stock(megatron_cpu):
    """``recompute_granularity="selective"`` with ``"layernorm"``: Megatron frees each norm's output once
    the attention or MLP has read it and recomputes it in the backward (the cake spec's input norms are
    modules of their own, so they are recomputed too)."""
    config = make_config(qk_layernorm=True)
    recomputing = make_config(
        qk_layernorm=True, recompute_granularity="selective", recompute_modules=["layernorm"]
    )
    stock = _gpt(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    cake = _gpt(recomputing, get_gpt_decoder_block_spec(recomputing))
    assert all(
        layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm for layer in cake.decoder.layers
    )
    assert_tracks_stock(cake, stock)


def test_fused_residual_refuses_selective_norm_recompute():
    """The fused form's second output is the residual, which the layer adds after Megatron has freed the
    recomputed norm's outputs: refused by name rather than freed under the layer."""
    config = with_fields(
        make_config(recompute_granularity="selective", recompute_modules=["layernorm"]),
        fused_residual_rmsnorm=True,
    )
    with pytest.raises(
        ValueError, match="fused_residual_rmsnorm cannot be combined with config.recompute_modules"
    ):
        MegatronCakeResidualRMSNorm(config=config, hidden_size=HIDDEN)
    assert not MegatronCakeRMSNorm(config=config, hidden_size=HIDDEN).fused_residual  # not a residual norm


# --- the GPU evidence script's CPU smoke mode ----------------------------------------------------------


def test_training_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "megatron.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "megatron_train.py"),
            str(out),
            "--device",
            "cpu",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--seq",
            "32",
            "--steps",
            "3",
            "--runs",  # the compiled-norms run is the GPU's bound; inductor's CPU build is slow here
            "stock,stock-again,cake,cake-fused-residual",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert runs.keys() == {"stock", "stock-again", "cake", "cake-fused-residual"}
    if not HAS_FUSED_RESIDUAL_LAYER:
        assert "0.17" in runs.pop("cake-fused-residual")["skipped"]
    for run in runs.values():
        assert len(run["losses"]) == 3 and all(loss > 0 for loss in run["losses"])
    assert "MegatronCakeRMSNorm" in runs["cake"]["norm_classes"]
    assert len({run["init_checksum"] for run in runs.values()}) == 1  # one seed, the same start
    assert runs["stock-again"]["losses"] == runs["stock"]["losses"]
    assert runs["cake"]["losses"][0] == runs["stock"]["losses"][0]
    torch.testing.assert_close(runs["cake"]["losses"], runs["stock"]["losses"], rtol=1e-4, atol=0)
