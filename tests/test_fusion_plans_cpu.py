"""The decoder-layer forms ``cake_cute.hf.plans`` recognizes beyond the installed transformers' own:
the forms of transformers 4.x (the ``outputs = (hidden_states,)`` tail returning attention weights and
router logits, the MLP's router-logit tuples, statements that prepare the attention call's arguments),
written here as subclasses of the installed Llama layer. Each fused layer returns what its own forward
returns, bitwise, and every form that differs from them is refused naming the first statement that
differs. (The real 4.x layers run through the conformance matrix on the oldest declared transformers.)"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from packaging.version import Version

from cake_cute import fuse_residual_rmsnorm, swap_rmsnorm
from cake_cute.hf.plans import _layer_plan

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

HIDDEN, TOKENS = 64, 6


class OutputsTupleLayer(LlamaDecoderLayer):
    """transformers 4.51's Llama layer: the attention weights kept, an outputs tuple returned."""

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, **kwargs):
        residual = hidden_states

        hidden_states = self.input_layernorm(hidden_states)

        # Self Attention
        hidden_states, self_attn_weights = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, **kwargs
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states

        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)

        return outputs


class SetupLayer(LlamaDecoderLayer):
    """transformers 4.51's Gemma2 / Llama4 layers: statements before the attention call that prepare
    its arguments (a mask chosen, a local assigned and passed on)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        chunk_mask=None,
        output_attentions=False,
        position_embeddings_global=None,
        position_embeddings_local=None,
        **kwargs,
    ):
        if self.use_chunks and chunk_mask is not None:
            scaled = chunk_mask * 2.0
            attention_mask = scaled
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.use_chunks:
            position_embeddings = position_embeddings_local
        else:
            position_embeddings = position_embeddings_global
        hidden_states, self_attn_weights = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        return outputs


class RouterTupleLayer(LlamaDecoderLayer):
    """transformers 4.51's Qwen3-MoE layer: the MLP may return (output, router logits)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        output_attentions=False,
        output_router_logits=False,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, **kwargs
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if isinstance(hidden_states, tuple):
            hidden_states, router_logits = hidden_states
        else:
            router_logits = None
        hidden_states = residual + hidden_states
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if output_router_logits:
            outputs += (router_logits,)
        return outputs


def _layer_pair(cls, **attributes):
    """(the layer of ``cls``, swapped; the same layer fused) in one tiny Llama model, FP32, random norms."""
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    layer = model.model.layers[0]
    layer.__class__ = cls
    for name, value in attributes.items():
        setattr(layer, name, value)
    unfused, fused = copy.deepcopy(model), copy.deepcopy(model)
    swap_rmsnorm(unfused)
    fuse_residual_rmsnorm(fused)
    return unfused.model.layers[0], fused.model.layers[0], model.model.rotary_emb


def _inputs(rotary):
    torch.manual_seed(1)
    hidden = torch.randn(2, TOKENS, HIDDEN)
    rope = rotary(hidden, position_ids=torch.arange(TOKENS).unsqueeze(0))
    mask = torch.full((TOKENS, TOKENS), float("-inf")).triu(1).expand(2, 1, TOKENS, TOKENS)
    return hidden, rope, mask


def _assert_same(got, expected):
    assert type(got) is type(expected) and len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("output_attentions", [False, True])
def test_an_outputs_tuple_layer_fuses_and_returns_its_tuple(output_attentions):
    plan = _layer_plan(OutputsTupleLayer)
    assert plan.template == "pre-norm" and plan.outputs == (("output_attentions", "attention"),)
    unfused, fused, rotary = _layer_pair(OutputsTupleLayer)
    hidden, rope, mask = _inputs(rotary)
    expected = unfused(hidden, mask, output_attentions=output_attentions, position_embeddings=rope)
    got = fused(hidden, mask, output_attentions=output_attentions, position_embeddings=rope)
    assert len(expected) == (2 if output_attentions else 1)
    _assert_same(got, expected)


@pytest.mark.parametrize("use_chunks", [False, True])
def test_setup_statements_run_as_in_the_original(use_chunks):
    """The statements that prepare the attention's arguments run on the bound arguments: the chunk
    mask replaces the mask only where the original replaces it, and a local is passed on by name."""
    plan = _layer_plan(SetupLayer)
    assert plan.setup is not None and {"scaled", "position_embeddings"} <= plan.named
    unfused, fused, rotary = _layer_pair(SetupLayer, use_chunks=use_chunks)
    hidden, rope, mask = _inputs(rotary)
    chunk_mask = torch.zeros_like(mask)
    local = tuple(t * 0.5 for t in rope)
    expected = unfused(hidden, mask, chunk_mask, True, rope, local)
    got = fused(hidden, mask, chunk_mask, True, rope, local)
    _assert_same(got, expected)
    if use_chunks:  # the chunk mask (no causal mask) and the local embeddings really reached the attention
        plain = unfused(hidden, mask, None, True, rope, rope)
        assert not torch.equal(plain[1], expected[1])


@pytest.mark.parametrize("moe", [False, True])
def test_router_logits_of_a_tuple_returning_mlp(moe):
    plan = _layer_plan(RouterTupleLayer)
    assert plan.mlp_output == "if_tuple"
    assert plan.outputs == (("output_attentions", "attention"), ("output_router_logits", "router"))
    unfused, fused, rotary = _layer_pair(RouterTupleLayer)
    if moe:  # an MLP returning (output, router logits), as a mixture of experts does
        for layer in (unfused, fused):
            mlp = layer.mlp
            layer.mlp = _TupleMLP(mlp)
    hidden, rope, _ = _inputs(rotary)
    expected = unfused(hidden, output_router_logits=True, position_embeddings=rope)
    got = fused(hidden, output_router_logits=True, position_embeddings=rope)
    assert (expected[1] is None) == (not moe)
    assert torch.equal(got[0], expected[0])
    assert got[1] is None if not moe else torch.equal(got[1], expected[1])


class _TupleMLP(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        y = self.inner(x)
        return y, y.sum(-1)


def _refusal(cls) -> str:
    with pytest.raises(ValueError) as error:
        _layer_plan(cls)
    return str(error.value)


def _line(cls, text: str) -> int:
    """The file line of the first line of ``cls.forward`` that contains ``text``."""
    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


class ExtraTailLayer(OutputsTupleLayer):
    def forward(self, hidden_states, output_attentions=False, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states * 2
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        return outputs


class UnknownOutputLayer(OutputsTupleLayer):
    def forward(self, hidden_states, output_attentions=False, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (residual,)
        return outputs


class HiddenSetupLayer(OutputsTupleLayer):
    """A statement before the attention that changes hidden_states is no setup: refused."""

    def forward(self, hidden_states, **kwargs):
        hidden_states = hidden_states.float()
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class MisplacedSplitLayer(OutputsTupleLayer):
    """The router-logit unpacking after the input norm, not after the MLP: refused."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if isinstance(hidden_states, tuple):
            hidden_states, router_logits = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class ShortLayer(OutputsTupleLayer):
    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states


def test_refusals_name_the_first_statement_that_differs():
    """The closest template (the most statements matched in a row) and the first statement of the
    forward that differs from it, whatever the two lengths."""
    message = _refusal(ExtraTailLayer)
    line = _line(ExtraTailLayer, "hidden_states * 2")
    assert f"closest, the pre-norm template: line {line}: 'hidden_states = hidden_states * 2'" in message
    message = _refusal(HiddenSetupLayer)
    line = _line(HiddenSetupLayer, ".float()")
    assert f"the pre-norm template: line {line}: 'hidden_states = hidden_states.float()'" in message
    line = _line(ShortLayer, "return hidden_states")
    assert f"the pre-norm template: line {line}: 'return hidden_states'" in _refusal(ShortLayer)


def test_forms_that_would_run_differently_are_refused():
    assert "adds 'residual' under 'output_attentions'" in _refusal(UnknownOutputLayer)
    message = _refusal(MisplacedSplitLayer)
    assert "unpacks the output of self.input_layernorm, not of its MLP self.mlp" in message


def test_the_installed_layers_keep_their_plain_form():
    """The installed transformers' Llama layer (5.x: returns hidden_states) has no 4.x parts."""
    if Version(transformers.__version__) < Version("5"):
        pytest.skip("the 4.x layers return an outputs tuple")
    plan = _layer_plan(LlamaDecoderLayer)
    assert (plan.outputs, plan.setup, plan.mlp_output) == (None, None, "plain")


class KeywordSetupLayer(OutputsTupleLayer):
    """A statement that reads **kwargs is no setup (the bound arguments hold its items, not it)."""

    def forward(self, hidden_states, **kwargs):
        mask = kwargs.get("attention_mask")
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def test_a_statement_reading_kwargs_is_refused():
    line = _line(KeywordSetupLayer, "kwargs.get")
    assert f"line {line}: \"mask = kwargs.get('attention_mask')\"" in _refusal(KeywordSetupLayer)
