"""torchtitan 0.3's Qwen3.5 with ``cake_cute.integrations.torchtitan_qwen35`` (its one config line): the
two overrides replace every ``OffsetRMSNorm`` and ``RMSNormGated`` config of the debug model keeping
``param_init`` and the ``ShardingConfig``; the model builds, passes ``verify_module_protocol``,
initializes its norms as the stock model does, and its forward is the stock forward bitwise in FP32.

Without fla (CPU machines), ``tests.torchtitan_harness.cpu.import_qwen35`` gives the model placeholder
fla modules whose chunked delta rule is transformers' torch implementation, in the stock and cake models
alike. The trainer's loss curves are ``test_torchtitan_cpu.py``'s ``qwen35_1proc`` case.
"""

from __future__ import annotations

import pytest
import torch

from tests.torchtitan_harness.cpu import built_on_cpu, import_qwen35, prepare

try:
    prepare()
    import_qwen35()
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.models.qwen3_5.model import OffsetRMSNorm, RMSNormGated

    from cake_cute.integrations.torchtitan_qwen35 import (
        TorchtitanCakeOffsetRMSNorm,
        TorchtitanCakeRMSNormGated,
    )
    from tests.torchtitan_harness.config_registry import VOCAB, qwen35_debugmodel_cpu
    from tests.torchtitan_harness.runs import QWEN35_LINE
except ImportError as error:  # torchtitan absent, or a version without Qwen3.5 or its overrides
    pytest.skip(f"torchtitan 0.3's Qwen3.5 does not import here: {error}", allow_module_level=True)

TARGETS = QWEN35_LINE[1].split(",")
N_OFFSET, N_GATED = 21, 6  # two per layer of eight, q and k in the two attention layers, the final norm


def _model_config(targets: list):
    config = qwen35_debugmodel_cpu()
    config.model_spec.model.update_from_config(config=config)
    if targets:
        apply_overrides(OverrideConfig(imports=targets), config)
    return config.model_spec.model


def _norm_configs(model_config, cls) -> dict:
    return {fqn: cfg for fqn, cfg, _, _ in model_config.traverse(cls.Config)}


def test_override_keeps_init_and_sharding():
    stock, cake = _model_config([]), _model_config(TARGETS)
    for cls, cake_cls, count in (
        (OffsetRMSNorm, TorchtitanCakeOffsetRMSNorm, N_OFFSET),
        (RMSNormGated, TorchtitanCakeRMSNormGated, N_GATED),
    ):
        before, after = _norm_configs(stock, cls), _norm_configs(cake, cls)
        assert sorted(before) == sorted(after) and len(after) == count, cls
        for fqn, cfg in after.items():
            assert type(cfg) is cake_cls.Config, fqn
            assert (cfg.dim, cfg.eps) == (before[fqn].dim, before[fqn].eps)
            assert cfg.param_init == before[fqn].param_init, fqn
            assert cfg.sharding_config == before[fqn].sharding_config, fqn


def test_memory_efficient_offset_norms():
    config = _model_config([(TARGETS[0], {"memory_efficient": True}), TARGETS[1]])
    norms = _norm_configs(config, OffsetRMSNorm)
    assert len(norms) == N_OFFSET and all(cfg.memory_efficient for cfg in norms.values())
    with pytest.raises(TypeError, match="memory_efficient"):
        _model_config([(TARGETS[0], {"memory_efficient": "yes"})])


def _built(targets: list, seed: int = 0):
    return built_on_cpu(_model_config(targets), seed)


def test_model_protocol_init_and_forward_names():
    model = _built(TARGETS)
    offset = [m for m in model.modules() if isinstance(m, TorchtitanCakeOffsetRMSNorm)]
    gated = [m for m in model.modules() if isinstance(m, TorchtitanCakeRMSNormGated)]
    assert (len(offset), len(gated)) == (N_OFFSET, N_GATED)
    assert not any(type(m) in (OffsetRMSNorm, RMSNormGated) for m in model.modules())
    assert all(not m.weight.any() for m in offset)  # zero: the scale 1 + w starts at 1
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in gated)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    stock = _built([])
    stock_offset = next(m for m in stock.modules() if type(m) is OffsetRMSNorm)
    stock_gated = next(m for m in stock.modules() if type(m) is RMSNormGated)
    assert offset[0]._cache_pos_arg_names() == stock_offset._cache_pos_arg_names() == ["x"]
    assert gated[0]._cache_pos_arg_names() == stock_gated._cache_pos_arg_names() == ["x", "gate"]


def _step(model, tokens):
    """Logits and the parameters' gradients of one forward and backward of a text batch."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    special = {"image_id": VOCAB, "video_id": VOCAB + 1}
    logits = model(tokens, positions=positions, special_tokens=special)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    model.zero_grad()
    loss.backward()
    return logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_forward_bitwise_and_gradients_close_to_stock():
    """FP32 on CPU: the logits are the stock model's bitwise (each norm's FP32 operations in torchtitan's
    order); the gradients within 1e-4 relative of autograd's chain through the stock norms (the
    kernels' closed-form backward rounds elsewhere)."""
    stock, cake = _built([]), _built(TARGETS)
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(3))
    want_logits, want = _step(stock, tokens)
    got_logits, got = _step(cake, tokens)
    assert torch.equal(got_logits, want_logits)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
