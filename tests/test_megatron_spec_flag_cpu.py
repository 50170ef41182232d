"""The ``--spec`` objects against the config: ``--spec cake_cute.integrations.megatron gpt_layer_spec`` (and
``gpt_decoder_block_spec``) built as Megatron-LM's GPT builders build a model from them, beside the model the
builder builds for the same config without ``--spec``: the same parameters, shapes and checkpoint keys,
cake norms in the norm positions a spec reaches, Megatron's norms where it does not, and named refusals.

The two builders: Megatron-LM 0.16-0.18 (``gpt_builders.gpt_builder``) hands the imported object to
``GPTModel`` as it is; 0.19 (``megatron/training/models/gpt.py``, ``GPTModelBuilder``) first calls one that
is not a ``ModuleSpec`` with its model config (a ``GPTModelConfig`` holding the ``TransformerConfig`` as
``transformer``) and ``vp_stage``, and builds the multi-token prediction block from Megatron's own layer
specs whatever ``--spec`` says. The first is a file of Megatron-LM's repository, not of the megatron-core
wheel, and the second (in the wheel's ``megatron.training``) needs Python 3.12: ``flag_model`` and
``stock_model`` follow their code for ``transformer_impl="local"``.

Stand-ins, for the stock and the cake models alike: multi-latent attention's local core attention does
not take the ``k_channels`` / ``v_channels`` it is passed in these versions (MLA runs on TE's), and its
module believes TE imports where Megatron's TE extension imports with placeholders: a core attention that
takes them (it has no parameters) and ``HAVE_TE`` off; Megatron-Core 0.16's local grouped-GEMM experts
assert that the ``grouped_gemm`` package imports, which they are told (their weights are plain
parameters).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.transformer import multi_latent_attention, transformer_block, transformer_layer  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, import_module  # noqa: E402
from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_config import (  # noqa: E402
    MLATransformerConfig,
    TransformerConfig,
)

from cake_cute.integrations.megatron import (  # noqa: E402
    CakeGPTLayer,
    MegatronCakeQKRMSNorm,
    MegatronCakeRMSNorm,
    get_gpt_mtp_block_spec,
    gpt_decoder_block_spec,
    gpt_layer_spec,
)

from ._megatron_cpu import CPU  # noqa: E402
from .test_megatron_cpu import _gpt, assert_tracks_stock, make_config, with_fields  # noqa: E402

try:  # Megatron-Core 0.16's local grouped-GEMM experts (0.19's local spec takes SequentialMLP)
    from megatron.core.transformer.moe import grouped_gemm_util
except ImportError:
    grouped_gemm_util = None

MODULE = "cake_cute.integrations.megatron"
# Megatron builds the final norm of a model from a layer spec itself (transformer_block.LayerNormImpl):
# torch's norm here, where neither Transformer Engine nor Apex imports.
TORCH_FINAL_NORM = transformer_block.LayerNormImpl is WrappedTorchNorm
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)


def builder_config(config_class=TransformerConfig, **fields):
    """A small GPT config as ``pretrain_gpt.py --transformer-impl local --normalization RMSNorm
    --no-persist-layer-norm`` makes it, four layers."""
    base = dict(num_layers=4, transformer_impl="local", persist_layer_norm=False)
    return make_config(config_class, **base, **fields)


def mla_config(**fields):
    """A multi-latent attention config (``--multi-latent-attention``: an ``MLATransformerConfig``)."""
    return builder_config(MLATransformerConfig, multi_latent_attention=True, **MLA, **fields)


class MLACoreAttention(DotProductAttention):
    """Megatron's local core attention, taking the head sizes multi-latent attention passes (unused: it
    has no parameters)."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)


@pytest.fixture
def buildable_on_cpu(monkeypatch):
    """The stand-ins of the module docstring."""
    monkeypatch.setattr(LocalSpecProvider, "core_attention", lambda self: MLACoreAttention)
    monkeypatch.setattr(multi_latent_attention, "HAVE_TE", False)
    if grouped_gemm_util is not None:
        monkeypatch.setattr(grouped_gemm_util, "grouped_gemm_is_available", lambda: True)


def stock_decoder_spec(config):
    """The decoder spec Megatron-LM's GPT builder takes without ``--spec`` (``transformer_impl="local"``):
    the decoder block spec for an MoE config, else the local layer spec (which the builder calls
    without ``qk_l2_norm``)."""
    if config.num_moe_experts:
        return gpt_layer_specs.get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        config.num_moe_experts,
        config.moe_grouped_gemm,
        config.qk_layernorm,
        config.multi_latent_attention,
        normalization=config.normalization,
    )


def stock_mtp_block_spec(config):
    """The multi-token prediction block Megatron-LM's builder builds (0.19 also under ``--spec``): from
    the last of Megatron's own decoder layer specs."""
    if config.mtp_num_layers is None:
        return None
    last = gpt_layer_specs.get_gpt_decoder_layer_specs(
        config, use_transformer_engine=False, normalization=config.normalization, qk_l2_norm=config.qk_l2_norm
    )[-1]
    return gpt_layer_specs.get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)


def stock_model(config):
    return _gpt(config, stock_decoder_spec(config), mtp_block_spec=stock_mtp_block_spec(config))


def spec_from_flag(name, config, *, calls_functions):
    """What Megatron-LM's builder passes ``GPTModel`` for ``--spec cake_cute.integrations.megatron name``:
    the imported object (0.16-0.18), or (0.19, ``calls_functions``) what it returns when it is a callable
    other than a ``ModuleSpec``, called with the model config and ``vp_stage``."""
    spec = import_module((MODULE, name))
    if calls_functions and callable(spec) and not isinstance(spec, ModuleSpec):
        spec = spec(types.SimpleNamespace(transformer=config), vp_stage=None)
    return spec


def flag_model(name, config, *, calls_functions=True):
    spec = spec_from_flag(name, config, calls_functions=calls_functions)
    return _gpt(config, spec, mtp_block_spec=stock_mtp_block_spec(config))


def parameter_shapes(model) -> dict:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def sharded_keys(model) -> dict:
    return {k: v.key for k, v in model.sharded_state_dict().items() if hasattr(v, "key")}


def megatron_owned(name: str, flag: str) -> bool:
    """Whether the norm at ``name`` is built by Megatron whatever the ``--spec`` object says: the
    multi-token prediction block's, and under a layer spec the final norm."""
    return name.startswith("mtp.") or (flag == "gpt_layer_spec" and name == "decoder.final_layernorm")


def assert_same_model_with_cake_norms(cake, stock, flag: str) -> None:
    """The parameters, shapes, state-dict and sharded checkpoint keys of the stock model; each of its
    norms (torch's RMSNorm) a cake norm where the spec reaches it, Megatron's own where it does not."""
    assert parameter_shapes(cake) == parameter_shapes(stock)
    assert cake.state_dict().keys() == stock.state_dict().keys()
    assert sharded_keys(cake) == sharded_keys(stock)
    stock_norms = {name for name, m in stock.named_modules() if isinstance(m, torch.nn.RMSNorm)}
    assert stock_norms
    cake_modules = dict(cake.named_modules())
    for name in stock_norms:
        owner = torch.nn.RMSNorm if megatron_owned(name, flag) else MegatronCakeRMSNorm
        assert isinstance(cake_modules[name], owner), (name, type(cake_modules[name]))


FLAGS = ("gpt_layer_spec", "gpt_decoder_block_spec")
CONFIGS = {
    "dense": dict(),
    "dense-qk": dict(qk_layernorm=True),
    "moe-every-layer": dict(**MOE),
    "moe-freq-2": dict(**MOE, moe_layer_freq=2),
    "moe-pattern": dict(**MOE, moe_layer_freq=[1, 0, 0, 1]),
    "moe-pattern-qk": dict(**MOE, moe_layer_freq=[0, 1, 1, 0], qk_layernorm=True),
    "moe-shared-experts": dict(**MOE, moe_layer_freq=[1, 0, 1, 0], moe_shared_expert_intermediate_size=32),
    "moe-grouped-gemm": dict(**MOE, moe_layer_freq=[1, 1, 0, 0], moe_grouped_gemm=True),
    "mtp": dict(qk_layernorm=True, mtp_num_layers=1),
    "moe-mtp": dict(**MOE, moe_layer_freq=[1, 0, 1, 0], mtp_num_layers=1),
}


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("fields", CONFIGS.values(), ids=CONFIGS.keys())
def test_flag_builds_the_stock_model_with_cake_norms(megatron_cpu, buildable_on_cpu, flag, fields):
    config = builder_config(**fields)
    stock, cake = stock_model(config), flag_model(flag, config)
    assert_same_model_with_cake_norms(cake, stock, flag)


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("fields", [{}, dict(**MOE, moe_layer_freq=[1, 0, 0, 1])], ids=["mla", "mla-moe"])
def test_multi_latent_attention_takes_cake_q_and_kv_norms(megatron_cpu, buildable_on_cpu, flag, fields):
    config = mla_config(qk_layernorm=True, **fields)
    with CPU.cuda_calls_on_cpu():  # its rotary embedding asks for the current CUDA device
        stock, cake = stock_model(config), flag_model(flag, config)
    assert_same_model_with_cake_norms(cake, stock, flag)
    attention = cake.decoder.layers[0].self_attention
    assert type(attention).__name__ == "MLASelfAttention"
    assert type(attention.q_layernorm) is MegatronCakeQKRMSNorm
    assert attention.kv_layernorm.normalized_shape == (MLA["kv_lora_rank"],)


def test_layer_spec_makes_moe_layers_after_the_pattern(megatron_cpu):
    """The MoE config of the motivating run: the layers Megatron's pattern asks for, not dense MLPs."""
    config = builder_config(**MOE, moe_layer_freq=[1, 0, 0, 1])
    model = flag_model("gpt_layer_spec", config)
    assert [layer.is_moe_layer for layer in model.decoder.layers] == [True, False, False, True]
    assert [type(layer) for layer in model.decoder.layers] == [transformer_layer.TransformerLayer] * 4


def test_moe_model_tracks_stock(megatron_cpu, monkeypatch):
    """The cake MoE model, loaded from the stock one: its loss bitwise the stock one's, its gradients
    within the bound of the dense models' (``assert_tracks_stock``). Megatron-Core 0.16's router looks
    up Transformer Engine's GEMM, a name it leaves undefined where TE does not import: None there, its
    torch path."""
    monkeypatch.setattr(
        moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False
    )
    config = builder_config(**MOE, moe_layer_freq=[1, 0, 0, 1], qk_layernorm=True)
    with CPU.cuda_calls_on_cpu():  # the router allocates on the current CUDA device
        assert_tracks_stock(flag_model("gpt_layer_spec", config), stock_model(config))


def test_qk_l2_norm_keeps_megatrons_l2_norm(megatron_cpu):
    """``qk_l2_norm`` as the config says: Megatron's weightless ``L2Norm`` in the q/k slots (Megatron-LM's
    builder drops the field for a dense local model, whose layer spec it calls without it)."""
    config = builder_config(qk_l2_norm=True)
    for flag in FLAGS:
        model = flag_model(flag, config)
        attention = model.decoder.layers[0].self_attention
        assert type(attention.q_layernorm) is L2Norm and type(attention.k_layernorm) is L2Norm
        assert parameter_shapes(model) == parameter_shapes(stock_model(config))


def test_zero_centered_gamma_in_every_norm_of_the_block_spec(megatron_cpu):
    """``--apply-layernorm-1p``: every norm (the final one included) scales by ``1 + weight`` from zeros.
    The stock model's norms are torch's here, which refuse the field: its parameters are compared with the
    stock model built without it."""
    config = builder_config(**MOE, moe_layer_freq=[1, 0, 0, 1], qk_layernorm=True)
    centered = with_fields(config, layernorm_zero_centered_gamma=True)
    model = flag_model("gpt_decoder_block_spec", centered)
    norms = [m for m in model.modules() if isinstance(m, MegatronCakeRMSNorm)]
    assert len(norms) == 4 * config.num_layers + 1
    assert all(norm.weight_offset == 1.0 and not norm.weight.any() for norm in norms)
    assert parameter_shapes(model) == parameter_shapes(stock_model(config))


def test_mtp_block_for_the_layer_spec_in_a_model_provider(megatron_cpu):
    """``get_gpt_mtp_block_spec(config, gpt_layer_spec)``: the multi-token prediction block of the layers
    ``gpt_layer_spec`` builds for the config, its norms cake norms."""
    config = builder_config(**MOE, moe_layer_freq=[1, 0, 1, 0], mtp_num_layers=1)
    mtp = get_gpt_mtp_block_spec(config, gpt_layer_spec, use_transformer_engine=False)
    model = _gpt(config, gpt_layer_spec, mtp_block_spec=mtp)
    norms = {
        name: type(m)
        for name, m in model.mtp.named_modules()
        if isinstance(m, (torch.nn.RMSNorm, MegatronCakeRMSNorm))
    }
    assert {"layers.0.enorm", "layers.0.hnorm", "layers.0.final_layernorm"} <= norms.keys()
    assert all(issubclass(norm, MegatronCakeRMSNorm) for norm in norms.values()), norms
    assert parameter_shapes(model) == parameter_shapes(stock_model(config))


def test_spec_flag_names():
    """``gpt_layer_spec_qk_norm`` (the name that chose q/k norms before the spec followed the config)
    is ``gpt_layer_spec``; both are layer specs of the adapting layer class, so both builders hand them
    to the model uncalled."""
    layer = import_module((MODULE, "gpt_layer_spec"))
    assert import_module((MODULE, "gpt_layer_spec_qk_norm")) is layer is gpt_layer_spec
    assert isinstance(layer, ModuleSpec) and layer.module is CakeGPTLayer
    assert issubclass(CakeGPTLayer, transformer_layer.BaseTransformerLayer)
    assert import_module((MODULE, "gpt_decoder_block_spec")) is gpt_decoder_block_spec


def test_block_function_handed_over_uncalled_is_refused(megatron_cpu):
    """Megatron-LM before 0.19 hands a ``--spec`` function to the model uncalled: Megatron refuses it
    (``TransformerBlock`` builds layer or block specs only) before any layer is built."""
    with pytest.raises(Exception, match="specialize for function"):
        flag_model("gpt_decoder_block_spec", builder_config(), calls_functions=False)


def test_block_function_takes_a_transformer_config(megatron_cpu):
    config = builder_config(**MOE, moe_layer_freq=2)
    block = gpt_decoder_block_spec(config)
    assert block.layer_norm is MegatronCakeRMSNorm and len(block.layer_specs) == config.num_layers


# --- refusals ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_layer_built():
    """Fails if a ``TransformerLayer`` is constructed while entered."""
    built = []
    init = transformer_layer.TransformerLayer.__init__

    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("layer_number"))
        init(self, *args, **kwargs)

    transformer_layer.TransformerLayer.__init__ = counting_init
    try:
        yield
    finally:
        transformer_layer.TransformerLayer.__init__ = init
    assert not built, f"layers {built} were built before the refusal"


REFUSED = {
    "layernorm": (dict(normalization="LayerNorm"), r"config\.normalization must be 'RMSNorm'"),
    "te-absent": (
        dict(transformer_impl="transformer_engine"),
        r"config\.transformer_impl='transformer_engine' but Transformer Engine does not import",
    ),
    "inference-optimized": (
        dict(transformer_impl="inference_optimized"),
        r"config\.transformer_impl='inference_optimized'",
    ),
    "heterogeneous": (dict(heterogeneous_block_specs=True), r"config\.heterogeneous_block_specs=True"),
}


def refused_config(fields):
    """The MoE builder config with ``fields`` set; a heterogeneous one hands each layer a config of its
    own (``get_config_for_layer``: a copy with the flag still set), here itself."""
    config = with_fields(builder_config(**MOE, moe_layer_freq=[1, 0, 0, 1]), **fields)
    if fields.get("heterogeneous_block_specs"):
        config.get_config_for_layer = lambda layer_number: config
    return config


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("fields, message", REFUSED.values(), ids=REFUSED.keys())
def test_configs_not_served_are_refused_by_name(megatron_cpu, flag, fields, message):
    if "transformer_engine" in fields.values() and gpt_layer_specs.HAVE_TE:
        pytest.skip("Transformer Engine imports here")
    with no_layer_built(), pytest.raises(ValueError, match=message):
        flag_model(flag, refused_config(fields))


@pytest.mark.skipif(not TORCH_FINAL_NORM, reason="Megatron's final norm is torch's only without TE and Apex")
@pytest.mark.parametrize(
    "field, value",
    [
        ("layernorm_zero_centered_gamma", True),
        ("persist_layer_norm", True),
        ("memory_efficient_layer_norm", True),
        ("sequence_parallel", True),
    ],
)
def test_layer_spec_refuses_what_megatrons_final_norm_refuses(megatron_cpu, field, value):
    """Under a layer spec Megatron builds the final norm itself, torch's here, which refuses these fields
    after every layer is built: the layer spec refuses them by name first, and names the block spec."""
    config = with_fields(builder_config(**MOE), **{field: value})
    with (
        no_layer_built(),
        pytest.raises(ValueError, match=rf"config\.{field}=True: .*gpt_decoder_block_spec"),
    ):
        flag_model("gpt_layer_spec", config)
