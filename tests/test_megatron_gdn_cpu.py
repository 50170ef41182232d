"""Megatron-Core's Qwen3-Next layers on the CPU: the block spec Megatron builds for a config with
``experimental_attention_variant="gated_delta_net"`` (Gated DeltaNet layers and attention layers with q/k
norms), through ``get_gpt_decoder_block_spec``, against Megatron's own block.

Megatron builds those layers from Transformer Engine's specs only; TE does not run here. Megatron's
block function runs as it is, with its backend replaced by the local one plus a stand-in for TE's
norm-fused column-parallel linear (``NormColumnParallelLinear``: an RMSNorm whose weight it holds as
``layer_norm_weight``, TE's name, then Megatron's local column-parallel linear), put in TE's place for
the cake spec too. Gated DeltaNet's fla kernels are replaced by torch forms (``benchmarks/megatron_cpu.py``).

The models are compared within bounds, not bitwise: Gated DeltaNet compiles its ``_apply_gated_norm``
(Megatron's ``jit_fuser``), where inductor generates its own reduction for the stock torch RMSNorm (it
differs from torch's eager op in the last bits), while the cake norm is an op the compiled code calls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core.extensions import transformer_engine as te_ext  # noqa: E402
from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.models.gpt import experimental_attention_variant_module_specs as variant_specs  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402

from cake_cute.integrations.megatron import (  # noqa: E402
    MegatronCakeQKRMSNorm,
    MegatronCakeResidualRMSNorm,
    MegatronCakeRMSNorm,
    get_gpt_decoder_block_spec,
    gpt_layer_spec,
)
from cake_cute.integrations.megatron_norms import with_fused_output_gate  # noqa: E402

from ._helpers import assert_bitwise_equal  # noqa: E402
from ._megatron_cpu import CPU  # noqa: E402
from .test_megatron_cpu import (  # noqa: E402
    BATCH,
    HIDDEN,
    SEQ,
    VOCAB,
    _dist_checkpoint_round_trip,
    _tokens,
    assert_gradients_close,
    loss_curve,
    make_config,
)

GDN_FIELDS = dict(
    experimental_attention_variant="gated_delta_net",
    linear_attention_freq=[1, 0],  # a Gated DeltaNet layer, then an attention layer
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    activation_func=F.silu,
    gated_linear_unit=True,
    qk_layernorm=True,
    transformer_impl="transformer_engine",
)


class NormColumnParallelLinear(ColumnParallelLinear):
    """Stand-in for TE's ``TELayerNormColumnParallelLinear``: RMSNorm (weight ``layer_norm_weight``), then
    Megatron's local column-parallel linear; the arguments Megatron builds TE's layer with."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm_eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))

    def forward(self, x):
        return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.norm_eps))


class FusedLocalSpecProvider(LocalSpecProvider):
    """Megatron's local backend with the norm fused into the column-parallel linear, as TE's backend."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return NormColumnParallelLinear


def _attention_spec(config, backend=None):
    """The attention layers' spec: the local one, with the input norm fused into linear_qkv as TE's."""
    attention = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, linear_qkv=NormColumnParallelLinear)
    return dataclasses.replace(attention, submodules=submodules, metainfo={"fuse_input_layernorm": True})


@pytest.fixture
def te_stand_ins(megatron_cpu, monkeypatch):
    """Megatron's experimental block function on the local backend, the TE names the cake spec looks
    for bound to the stand-ins, and Gated DeltaNet without fla."""
    monkeypatch.setattr(variant_specs, "_get_backend_spec_provider", lambda config: FusedLocalSpecProvider())
    monkeypatch.setattr(variant_specs, "_get_self_attention_module_spec", _attention_spec)
    monkeypatch.setattr(te_ext, "TELayerNormColumnParallelLinear", NormColumnParallelLinear)
    monkeypatch.setattr(te_ext, "TEColumnParallelLinear", ColumnParallelLinear)
    monkeypatch.setattr("cake_cute.integrations.megatron_specs.HAS_TE", True)
    with CPU.gated_delta_net_without_fla():
        yield


def _config(**fields):
    return make_config(**(GDN_FIELDS | fields))


def _gpt(config, spec, seed=0):
    torch.manual_seed(seed)
    with CPU.cuda_calls_on_cpu():  # Gated DeltaNet allocates its convolution and gate parameters there
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def by_checkpoint_key(model) -> dict:
    """The model's parameters by their checkpoint keys (``sharded_state_dict`` holds the parameters
    themselves), which the stock and cake models share where their module names differ."""
    entries = model.sharded_state_dict().values()
    return {e.key: e.data for e in entries if isinstance(getattr(e, "data", None), torch.nn.Parameter)}


def _loss_and_grads(model, tokens, positions):
    """The loss and every parameter's gradient, by checkpoint key."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, CPU.causal_mask(SEQ), labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), {key: p.grad for key, p in by_checkpoint_key(model).items()}


def _stock_and_cake(config, tmp_path=None):
    """Megatron's block and the cake block in GPT models; with ``tmp_path``, the cake model loaded from
    the stock one's checkpoint (``dist_checkpointing``: the plain state dicts name the input norms
    differently, the sharded ones alike), the stock weights first moved off their start."""
    stock = _gpt(config, variant_specs.get_transformer_block_with_experimental_attention_variant_spec(config))
    cake = _gpt(config, get_gpt_decoder_block_spec(config), seed=1)
    if tmp_path is not None:
        move_checkpoint(stock, cake, tmp_path / "ckpt", scale=0.1)
    return stock, cake


def move_checkpoint(source, target, directory, scale=1.0) -> None:
    """``source``'s weights moved off their start (plus ``scale`` times normal noise), saved with
    Megatron's ``dist_checkpointing`` and loaded into ``target``."""
    with torch.no_grad():
        for p in source.parameters():
            p.add_(scale * torch.randn_like(p))
    with CPU.cuda_calls_on_cpu():  # the torch_dist writer synchronizes CUDA
        _dist_checkpoint_round_trip(source, target, directory)


def assert_same_weights(target, source) -> None:
    """Every weight of ``target`` bitwise the one of ``source`` under the same checkpoint key."""
    got = by_checkpoint_key(target)
    for key, want in by_checkpoint_key(source).items():
        assert_bitwise_equal(got[key], want, key)


def test_block_spec_puts_cake_norms_in_the_gated_delta_net_layers(te_stand_ins):
    block = get_gpt_decoder_block_spec(_config())
    gdn, attention = (layer.submodules for layer in block.layer_specs)
    assert gdn.self_attention.module is variant_specs.GatedDeltaNet
    assert gdn.input_layernorm is MegatronCakeResidualRMSNorm
    assert gdn.self_attention.submodules.in_proj is ColumnParallelLinear
    assert gdn.self_attention.submodules.out_norm is MegatronCakeRMSNorm
    assert gdn.pre_mlp_layernorm is MegatronCakeResidualRMSNorm
    assert gdn.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.in_proj.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    assert attention.self_attention.submodules.q_layernorm is MegatronCakeQKRMSNorm
    assert (
        attention.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"
    )
    assert block.layer_norm is MegatronCakeRMSNorm


def test_moe_layers_pre_mlp_norm_is_a_cake_norm(te_stand_ins):
    """Qwen3-Next's layers are MoE: Megatron keeps their pre-MLP norm a norm of its own (not fused)."""
    block = get_gpt_decoder_block_spec(_config(num_moe_experts=4, moe_layer_freq=1, moe_ffn_hidden_size=32))
    for layer in block.layer_specs:
        assert layer.submodules.pre_mlp_layernorm is MegatronCakeResidualRMSNorm
        assert "pre_mlp_layernorm." not in layer.submodules.sharded_state_dict_keys_map


def test_layer_spec_flag_builds_the_variant_block_layers(te_stand_ins):
    """``--spec cake_cute.integrations.megatron gpt_layer_spec`` for a Gated DeltaNet config builds the
    layers of the block Megatron-LM's builder takes for it (a Gated DeltaNet, then an attention layer),
    with cake norms and the stock block's checkpoint keys; the final norm stays Megatron's."""
    config = _config()
    stock = _gpt(config, variant_specs.get_transformer_block_with_experimental_attention_variant_spec(config))
    cake = _gpt(config, gpt_layer_spec)
    shapes = [{key: tuple(p.shape) for key, p in by_checkpoint_key(model).items()} for model in (stock, cake)]
    assert shapes[1] == shapes[0]
    gdn, attention = cake.decoder.layers
    assert type(gdn.self_attention) is variant_specs.GatedDeltaNet
    assert type(gdn.input_layernorm) is MegatronCakeResidualRMSNorm
    assert type(gdn.self_attention.out_norm) is MegatronCakeRMSNorm
    assert type(attention.self_attention.q_layernorm) is MegatronCakeQKRMSNorm
    assert not isinstance(cake.decoder.final_layernorm, MegatronCakeRMSNorm)


def test_block_spec_refuses_a_variant_without_transformer_engine(te_stand_ins):
    with pytest.raises(ValueError, match="use_transformer_engine"):
        get_gpt_decoder_block_spec(_config(), use_transformer_engine=False)
    with pytest.raises(ValueError, match="config.transformer_impl"):
        get_gpt_decoder_block_spec(_config(transformer_impl="local"))


def test_block_spec_of_a_variant_needs_transformer_engine(megatron_cpu, monkeypatch):
    monkeypatch.setattr("cake_cute.integrations.megatron_specs.HAS_TE", False)
    with pytest.raises(ImportError, match="Transformer Engine does not import"):
        get_gpt_decoder_block_spec(_config())


def test_model_builds_cake_norms_under_the_stock_checkpoint_keys(te_stand_ins):
    stock, cake = _stock_and_cake(_config())
    layer = cake.decoder.layers[0]
    assert type(layer.input_layernorm) is MegatronCakeResidualRMSNorm
    assert type(layer.self_attention.out_norm) is MegatronCakeRMSNorm
    assert layer.self_attention.out_norm.normalized_shape == (16,)  # the value head size
    assert type(stock.decoder.layers[0].self_attention.in_proj) is NormColumnParallelLinear
    assert isinstance(stock.decoder.layers[0].input_layernorm, IdentityOp)
    assert by_checkpoint_key(cake).keys() == by_checkpoint_key(stock).keys()
    keys = sorted(by_checkpoint_key(cake))
    assert [k for k in keys if k.endswith("layer_norm_weight")] == [  # layers of two kinds: keyed apart
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.self_attention.in_proj.layer_norm_weight",
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
    ]


@pytest.mark.parametrize("direction", ["stock-to-cake", "cake-to-stock"])
def test_dist_checkpoint_moves_between_stock_and_cake(te_stand_ins, tmp_path, direction):
    stock, cake = _stock_and_cake(_config())
    source, target = (stock, cake) if direction == "stock-to-cake" else (cake, stock)
    move_checkpoint(source, target, tmp_path / "ckpt")
    assert_same_weights(target, source)


def test_loss_and_gradients_close_to_stock(te_stand_ins, tmp_path):
    stock, cake = _stock_and_cake(_config(), tmp_path)
    tokens, positions = _tokens()
    loss_stock, grads_stock = _loss_and_grads(stock, tokens, positions)
    loss_cake, grads_cake = _loss_and_grads(cake, tokens, positions)
    torch.testing.assert_close(loss_cake, loss_stock, rtol=1e-6, atol=0)
    assert_gradients_close(grads_cake, grads_stock)


def test_zero_centered_gamma_reaches_the_output_norm(te_stand_ins):
    """TE's norms scale by 1 + weight under layernorm_zero_centered_gamma, the output norm included (the
    local norms refuse the field, so there is no stock model to run beside it here)."""
    cake = _gpt(_config(layernorm_zero_centered_gamma=True), get_gpt_decoder_block_spec(_config()))
    norm = cake.decoder.layers[0].self_attention.out_norm
    assert norm.weight_offset == 1.0 and not norm.weight.any()


def test_training_steps_track_stock(te_stand_ins, tmp_path):
    curves = [loss_curve(model) for model in _stock_and_cake(_config(), tmp_path)]
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-5, atol=0)


def _out_norm_output(model, x):
    """The Gated DeltaNet layer's output and its out_norm's output for the input x."""
    outputs = []
    handle = model.decoder.layers[0].self_attention.out_norm.register_forward_hook(
        lambda module, args, out: outputs.append(out)
    )
    try:
        layer_out, _ = model.decoder.layers[0](x, attention_mask=None)
    finally:
        handle.remove()
    return layer_out, outputs[0]


def test_bf16_layer_rounds_the_norm_before_the_gate_as_stock(te_stand_ins, tmp_path):
    """bf16 weights and activations, the models cast as Megatron's ``Float16Module`` casts them (its
    local norms make FP32 weights; TE's and the cake norms take params_dtype). The layer gates the
    norm's bf16 output in FP32 and rounds again: so does TE's layer, whose norm is a kernel of its own;
    the local norm, traced into the same compiled function, would fuse with the gate and lose that
    rounding unless inductor emulates precision casts, which this test sets, so that the stock layer
    computes what the TE layer computes. Then the cake layer's output is the stock one's, bitwise."""
    stock, cake = _stock_and_cake(_config(params_dtype=torch.bfloat16, bf16=True), tmp_path)
    stock, cake = stock.bfloat16(), cake.bfloat16()
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16)
    tokens, positions = _tokens()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        (stock_out, stock_norm), (cake_out, cake_norm) = (_out_norm_output(m, x) for m in (stock, cake))
        losses = [_loss_and_grads(model, tokens, positions)[0] for model in (stock, cake)]
    assert cake_norm.dtype == cake_out.dtype == torch.bfloat16
    assert_bitwise_equal(cake_norm, stock_norm, "output norm")
    assert_bitwise_equal(cake_out, stock_out, "Gated DeltaNet layer")
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-3, atol=0)


# --- the opt-in fused output gate (fused_output_gate=True) ----------------------------------------


def _stock_and_fused(config, tmp_path):
    """Megatron's block and the cake block with the fused output gate, the latter loaded from the
    former's checkpoint (its weights moved off their start)."""
    stock = _gpt(config, variant_specs.get_transformer_block_with_experimental_attention_variant_spec(config))
    fused = _gpt(config, get_gpt_decoder_block_spec(config, fused_output_gate=True), seed=1)
    move_checkpoint(stock, fused, tmp_path / "ckpt", scale=0.1)
    return stock, fused


def test_fused_output_gate_is_the_gated_delta_net_layers_alone(te_stand_ins):
    """The Gated DeltaNet layer's class becomes its fused-gate subclass (its norm slots as without the
    option); the attention layer is untouched."""
    block = get_gpt_decoder_block_spec(_config(), fused_output_gate=True)
    gdn, attention = (layer.submodules.self_attention for layer in block.layer_specs)
    assert gdn.module is with_fused_output_gate(variant_specs.GatedDeltaNet)
    assert issubclass(gdn.module, variant_specs.GatedDeltaNet)
    assert gdn.submodules.out_norm is MegatronCakeRMSNorm
    plain = get_gpt_decoder_block_spec(_config())
    assert attention == plain.layer_specs[1].submodules.self_attention


def test_fused_output_gate_trains_like_stock_under_its_checkpoint_keys(te_stand_ins, tmp_path):
    """FP32: the fused layer's loss and gradients within the bounds of the unfused cake block (its
    norm and gate are one FP32 expression either way), under the stock checkpoint keys."""
    stock, fused = _stock_and_fused(_config(), tmp_path)
    assert by_checkpoint_key(fused).keys() == by_checkpoint_key(stock).keys()
    layer = fused.decoder.layers[0].self_attention
    assert type(layer) is with_fused_output_gate(variant_specs.GatedDeltaNet)
    norm_calls = []  # the fused gate reads out_norm's weight and eps; it never calls the module
    layer.out_norm.register_forward_hook(lambda *args: norm_calls.append(args))
    tokens, positions = _tokens()
    loss_stock, grads_stock = _loss_and_grads(stock, tokens, positions)
    loss_fused, grads_fused = _loss_and_grads(fused, tokens, positions)
    assert not norm_calls
    torch.testing.assert_close(loss_fused, loss_stock, rtol=1e-6, atol=0)
    assert_gradients_close(grads_fused, grads_stock)


def test_fused_output_gate_in_bf16_rounds_once(te_stand_ins, tmp_path):
    """bf16: the fused layer rounds the gated output once, the stock layer the norm's output and then
    the gated one; the layers' outputs differ by the norm's rounding (within 2**-7 of their scale)."""
    config = _config(params_dtype=torch.bfloat16, bf16=True)
    stock, fused = (m.bfloat16() for m in _stock_and_fused(config, tmp_path))
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16)
    outputs = [model.decoder.layers[0](x, attention_mask=None)[0] for model in (stock, fused)]
    assert outputs[1].dtype == torch.bfloat16
    scale = outputs[0].float().abs().max().item()
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), rtol=0, atol=2**-7 * scale)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(activation_func=F.gelu, gated_linear_unit=False), "config.activation_func must be F.silu"),
        (dict(memory_efficient_layer_norm=True), "config.memory_efficient_layer_norm"),
    ],
    ids=["gelu", "memory-efficient"],
)
def test_fused_output_gate_refuses_what_it_cannot_compute(te_stand_ins, fields, match):
    config = _config(**fields)
    with pytest.raises(ValueError, match=match):
        _gpt(config, get_gpt_decoder_block_spec(config, fused_output_gate=True))
