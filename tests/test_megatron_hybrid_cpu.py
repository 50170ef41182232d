"""Megatron-Core's hybrid models on the CPU (``HybridModel``, Megatron-LM's ``pretrain_hybrid.py``): the
cake stack spec ``hybrid_stack_spec`` against Megatron's own, both built by ``HybridModel``.

Megatron's stack spec names Transformer Engine's layers, which do not run here (without TE they are
placeholders): both specs are built with local layers in their place (``NormColumnParallelLinear``, the
stand-in for TE's norm-fused column-parallel linear, from the Gated DeltaNet tests; Megatron's local
linear, attention and norm layers), and the cake spec is derived as where TE imports. The stack builds
its final norm itself (``TENorm``): the stock stack gets torch's RMSNorm there. The layers run here are a
Gated DeltaNet layer (0.17+), an attention layer and an MLP layer ("G*-"); the Mamba mixer needs mamba_ssm's
GPU kernels, and the MoE, MLA and multi-token prediction layers are checked on the spec. The hybrid
modules import triton (not installed beside Megatron-Core 0.16.1 in CI): the tests skip there and run on
0.19.2 (``scripts/megatron_versions.sh``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest
import torch

pytest.importorskip("megatron.core")
cake_megatron = pytest.importorskip("cake_cute.integrations.megatron")
if not cake_megatron.HAS_HYBRID:
    pytest.skip("Megatron's hybrid stack does not import here (it needs triton)", allow_module_level=True)

from megatron.core.extensions import transformer_engine as te_ext  # noqa: E402
from megatron.core.models.mamba import mamba_layer_specs  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from cake_cute.integrations.megatron import (  # noqa: E402
    CakeHybridStack,
    MegatronCakeInputRMSNorm,
    MegatronCakeQKRMSNorm,
    MegatronCakeResidualRMSNorm,
    MegatronCakeRMSNorm,
    with_cake_stack_norms,
)

from ._megatron_cpu import CPU  # noqa: E402
from .test_megatron_cpu import (  # noqa: E402
    HAS_FUSED_RESIDUAL_LAYER,
    SEQ,
    _tokens,
    assert_gradients_close,
)
from .test_megatron_gdn_cpu import (  # noqa: E402
    GDN_FIELDS,
    NormColumnParallelLinear,
    assert_same_weights,
    by_checkpoint_key,
    make_config,
    move_checkpoint,
)
from .test_megatron_gdn_cpu import _loss_and_grads as loss_and_grads  # noqa: E402

VOCAB = 96
HYBRID = mamba_layer_specs.mamba_stack_spec
# Gated DeltaNet layers ("G") from 0.17 on; the fused-residual field from 0.17 on.
HAS_GDN_LAYERS = hasattr(HYBRID.submodules, "gdn_layer")
PATTERN = "G*-" if HAS_GDN_LAYERS else "*-"


def _local_layers() -> dict:
    """TE's layers (placeholders here) and the local layers built in their place."""
    return {
        te_ext.TELayerNormColumnParallelLinear: NormColumnParallelLinear,
        te_ext.TEColumnParallelLinear: ColumnParallelLinear,
        te_ext.TERowParallelLinear: RowParallelLinear,
        te_ext.TEDotProductAttention: DotProductAttention,
        te_ext.TENorm: WrappedTorchNorm,
    }


def localized(spec, layers: dict):
    """``spec`` with every TE layer in ``layers`` replaced by its local layer, at any depth."""
    if any(spec is te for te in layers):
        return next(local for te, local in layers.items() if spec is te)
    if isinstance(spec, functools.partial):
        return functools.partial(
            spec.func, *spec.args, **{k: localized(v, layers) for k, v in spec.keywords.items()}
        )
    if isinstance(spec, list):
        return [localized(item, layers) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {
            f.name: localized(getattr(spec, f.name), layers) for f in dataclasses.fields(spec) if f.init
        }
        return dataclasses.replace(spec, **fields)
    return spec


@pytest.fixture
def hybrid(megatron_cpu, monkeypatch):
    """The stock and the cake stack specs with local layers, the cake spec derived as where TE imports;
    the stock stack's final norm torch's RMSNorm; Gated DeltaNet without fla."""
    monkeypatch.setattr("cake_cute.integrations.megatron_specs.HAS_TE", True)
    monkeypatch.setattr(_stack_module(), "TENorm", WrappedTorchNorm)
    layers = _local_layers()
    with CPU.gated_delta_net_without_fla():
        yield localized(HYBRID, layers), localized(with_cake_stack_norms(HYBRID), layers)


def _with_torch_qk_norms(spec):
    """The stock stack spec with torch's RMSNorm in the attention layer's q/k slots (what Megatron 0.19
    fills them with, TE's norm, does not run here)."""
    layer = spec.submodules.attention_layer
    attention = layer.submodules.self_attention
    qk = dataclasses.replace(attention.submodules, q_layernorm=WrappedTorchNorm, k_layernorm=WrappedTorchNorm)
    layer = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules, self_attention=dataclasses.replace(attention, submodules=qk)
        ),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, attention_layer=layer))


def assert_loaded_model_tracks_stock(cake, stock, tmp_path) -> None:
    """The cake model loaded from the stock one's checkpoint: the loss within relative 1e-6 (the stock
    output norm is inductor's own reduction inside the Gated DeltaNet layer's compiled gate), the
    gradients within ``assert_gradients_close``'s bound."""
    move_checkpoint(stock, cake, tmp_path / "ckpt", scale=0.1)
    tokens, positions = _tokens()
    loss_stock, grads_stock = loss_and_grads(stock, tokens, positions)
    loss_cake, grads_cake = loss_and_grads(cake, tokens, positions)
    torch.testing.assert_close(loss_cake, loss_stock, rtol=1e-6, atol=0)
    assert_gradients_close(grads_cake, grads_stock)


def _stack_module():
    """The module whose ``TENorm`` the stack builds its final norm from (``hybrid_block``; ``mamba_block``
    before 0.19)."""
    return importlib.import_module(CakeHybridStack.__mro__[1].__module__)


def _config(**fields):
    gdn = {
        k: v
        for k, v in GDN_FIELDS.items()
        if k not in ("linear_attention_freq", "experimental_attention_variant")
    }
    return make_config(**(gdn | {"num_layers": len(PATTERN), "qk_layernorm": False} | fields))


def _model(config, spec, seed=0):
    from megatron.core.models.mamba.mamba_model import MambaModel

    torch.manual_seed(seed)
    with CPU.cuda_calls_on_cpu():
        return MambaModel(
            config=config,
            mamba_stack_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_override_pattern=PATTERN,
        )


def test_stack_spec_puts_cake_norms_in_every_layer_kind(monkeypatch):
    monkeypatch.setattr("cake_cute.integrations.megatron_specs.HAS_TE", True)
    cake = with_cake_stack_norms(HYBRID)
    assert cake.module is CakeHybridStack
    subs = cake.submodules
    mamba = subs.mamba_layer.submodules
    assert mamba.norm is MegatronCakeRMSNorm
    assert mamba.mixer.submodules.in_proj is te_ext.TEColumnParallelLinear
    assert mamba.sharded_state_dict_keys_map == {"norm.": "mixer.in_proj.layer_norm_"}
    if HAS_GDN_LAYERS:
        gdn = subs.gdn_layer.submodules
        assert gdn.input_layernorm is MegatronCakeResidualRMSNorm
        assert gdn.self_attention.submodules.out_norm is MegatronCakeRMSNorm
        assert gdn.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    attention = subs.attention_layer.submodules
    # Megatron's hybrid attention layer has no q/k norms in its spec: its input norm refuses qk_layernorm.
    assert attention.input_layernorm is MegatronCakeInputRMSNorm
    assert attention.self_attention.submodules.linear_qkv is te_ext.TEColumnParallelLinear
    # MLA and DSA layers (0.19): their q / kv norms fused into TE's up-projections are kept.
    for name in ("mla_layer", "dsa_layer"):
        if hasattr(subs, name):
            assert getattr(subs, name).submodules.input_layernorm is MegatronCakeResidualRMSNorm
    assert subs.mlp_layer.submodules.pre_mlp_layernorm is MegatronCakeResidualRMSNorm
    assert subs.moe_layer.submodules.pre_mlp_layernorm is MegatronCakeResidualRMSNorm
    if getattr(subs, "mtp_block_spec", None) is not None:  # the stack's MTP block (0.19)
        mtp = subs.mtp_block_spec.submodules.layer_specs[0].submodules
        assert mtp.enorm is mtp.hnorm is mtp.layer_norm is MegatronCakeRMSNorm


def test_qk_norm_stack_spec_puts_cake_norms_in_the_attention_q_k_slots(monkeypatch):
    monkeypatch.setattr("cake_cute.integrations.megatron_specs.HAS_TE", True)
    attention = with_cake_stack_norms(HYBRID, qk_layernorm=True).submodules.attention_layer.submodules
    assert attention.self_attention.submodules.q_layernorm is MegatronCakeQKRMSNorm
    assert attention.self_attention.submodules.k_layernorm is MegatronCakeQKRMSNorm
    assert attention.input_layernorm is MegatronCakeResidualRMSNorm


def test_qk_layernorm_model_builds_cake_q_k_norms_and_tracks_stock(hybrid, tmp_path):
    """With config.qk_layernorm the stock attention layer gets torch's norms here (TE's where TE imports:
    Megatron 0.19 fills the spec's empty q/k slots itself), the cake one the spec's cake q/k norms."""
    stock_spec, _ = hybrid
    stock_spec = localized(_with_torch_qk_norms(stock_spec), _local_layers())
    cake_spec = localized(with_cake_stack_norms(HYBRID, qk_layernorm=True), _local_layers())
    config = _config(qk_layernorm=True)
    stock, cake = _model(config, stock_spec), _model(config, cake_spec, seed=1)
    assert type(cake.decoder.layers[-2].self_attention.q_layernorm) is MegatronCakeQKRMSNorm
    assert_loaded_model_tracks_stock(cake, stock, tmp_path)


def test_stack_spec_object_for_the_spec_flag():
    """``--spec cake_cute.integrations.megatron hybrid_stack_spec``: Megatron-LM imports the attribute."""
    from megatron.core.transformer.spec_utils import import_module

    spec = import_module(("cake_cute.integrations.megatron", "hybrid_stack_spec"))
    assert isinstance(spec, ModuleSpec) and spec.module is CakeHybridStack
    qk = import_module(("cake_cute.integrations.megatron", "hybrid_stack_spec_qk_norm"))
    assert (
        qk.submodules.attention_layer.submodules.self_attention.submodules.q_layernorm
        is MegatronCakeQKRMSNorm
    )
    assert import_module(("cake_cute.integrations.megatron", "mamba_stack_spec")) is spec


def test_with_cake_stack_norms_refuses_other_specs():
    with pytest.raises(TypeError, match="HybridStack ModuleSpec"):
        with_cake_stack_norms(object())


def test_model_builds_cake_norms_under_the_stock_checkpoint_keys(hybrid):
    stock_spec, cake_spec = hybrid
    stock, cake = _model(_config(), stock_spec), _model(_config(), cake_spec, seed=1)
    assert type(cake.decoder.final_norm) is MegatronCakeRMSNorm
    *gdn, attention, mlp = cake.decoder.layers
    for layer in gdn:
        assert type(layer.input_layernorm) is MegatronCakeResidualRMSNorm
        assert type(layer.self_attention.out_norm) is MegatronCakeRMSNorm
    assert type(attention.input_layernorm) is MegatronCakeInputRMSNorm
    assert type(mlp.pre_mlp_layernorm) is MegatronCakeResidualRMSNorm
    assert by_checkpoint_key(cake).keys() == by_checkpoint_key(stock).keys()


@pytest.mark.parametrize("direction", ["stock-to-cake", "cake-to-stock"])
def test_dist_checkpoint_moves_between_stock_and_cake(hybrid, tmp_path, direction):
    stock_spec, cake_spec = hybrid
    stock, cake = _model(_config(), stock_spec), _model(_config(), cake_spec, seed=1)
    source, target = (stock, cake) if direction == "stock-to-cake" else (cake, stock)
    move_checkpoint(source, target, tmp_path / "ckpt")
    assert_same_weights(target, source)


def test_loss_and_gradients_close_to_stock(hybrid, tmp_path):
    stock_spec, cake_spec = hybrid
    stock, cake = _model(_config(), stock_spec), _model(_config(), cake_spec, seed=1)
    assert_loaded_model_tracks_stock(cake, stock, tmp_path)


@pytest.mark.skipif(not HAS_FUSED_RESIDUAL_LAYER, reason="fused_residual_rmsnorm: Megatron-Core 0.17+")
def test_fused_residual_form_in_the_hybrid_layers(hybrid):
    """``fused_residual_rmsnorm``: the Gated DeltaNet, attention and MLP layers of the stack take
    ``(output, residual)`` from their cake norms; the model computes what it computes without the field."""
    _, cake_spec = hybrid
    plain, fused = (_model(_config(fused_residual_rmsnorm=on), cake_spec, seed=1) for on in (False, True))
    fused.load_state_dict(plain.state_dict())
    assert all(
        norm.fused_residual
        for layer in fused.decoder.layers
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm)
        if isinstance(norm, MegatronCakeRMSNorm)
    )
    (loss_plain, grads_plain), (loss_fused, grads_fused) = (
        loss_and_grads(m, *_tokens()) for m in (plain, fused)
    )
    assert torch.equal(loss_fused, loss_plain)
    assert_gradients_close(grads_fused, grads_plain)


@pytest.mark.skipif(not HAS_GDN_LAYERS, reason="Gated DeltaNet layers in hybrid stacks: Megatron-Core 0.17+")
def test_fused_output_gate_in_the_hybrid_gated_delta_net_layers(hybrid, tmp_path):
    """``fused_output_gate=True``: the stack's Gated DeltaNet layers take the fused-gate class and the
    model tracks stock as the unfused one does."""
    from cake_cute.integrations.megatron_norms import with_fused_output_gate

    stock_spec, _ = hybrid
    fused_spec = localized(with_cake_stack_norms(HYBRID, fused_output_gate=True), _local_layers())
    stock, fused = _model(_config(), stock_spec), _model(_config(), fused_spec, seed=1)
    *gdn, _attention, _mlp = fused.decoder.layers
    for layer in gdn:
        assert type(layer.self_attention) is with_fused_output_gate(
            type(stock.decoder.layers[0].self_attention)
        )
    assert_loaded_model_tracks_stock(fused, stock, tmp_path)
