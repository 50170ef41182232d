"""The Hugging Face conformance matrix on CPU: every decoder family of the installed transformers that
has an RMSNorm, as tiny random-weight models (2 layers, hidden 64, vocab 128, 8 tokens; no download),
swapped and fused by cake_cute and compared with the untouched model and with the swapped, unfused one.

Each check is one test parametrized by family, so the matrix reads off the test ids
(``scripts/hf_matrix.py`` turns a run into ``docs/hf_families.md``). Tolerances:

* fused vs the swapped unfused model: FP32 loss and gradients bitwise (the ops' CPU kernels round
  ``h = a + b`` as torch's add does, and the FP32 backward adds the residual branch's gradient exactly);
  bf16 loss bitwise; bf16 gradients within 3e-2 in relative norm (about eight bf16 ulps): the fused
  backward rounds dx once after adding the residual branch's gradient where the unfused graph rounds
  twice, and these one-ulp differences propagate through the other layers' backward (measured: up to
  1.4e-2, GLM4's embedding gradient).
* fused vs the untouched model (its own RMSNorm modules), FP32: loss rtol 1e-6 and gradients rtol 1e-4 /
  atol 1e-6, because the Hugging Face norms compute ``rsqrt(mean(x^2) + eps)`` with torch's reductions
  where the cake CPU kernel sums in its own order and divides once: a few FP32 ulps per norm, grown by
  the backward through two layers.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field

import pytest
import torch

from cake_cute import CakeRMSNorm, fuse_residual_rmsnorm, swap_rmsnorm

from ._hf_helpers import NormCalls

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, TOKENS = 128, 64, 2, 8


@dataclass(frozen=True)
class Family:
    """A decoder family: its config and causal-LM classes, config values that make it tiny (beyond
    the common ones), how many norms it has per layer, and what fusion does to it."""

    config: str
    model: str
    norms_per_layer: int
    extra: dict = field(default_factory=dict)
    refusal: str | None = None  # the ValueError fuse_residual_rmsnorm raises, when it refuses
    # transformers versions (prefixes) whose own model of this family does not run here, and why
    stock_fails: dict = field(default_factory=dict)
    # transformers versions (prefixes) whose own model of this family does not come back from
    # save_pretrained / from_pretrained as it was (the save and load check is skipped there), and why
    reload_fails: dict = field(default_factory=dict)


_MOE = {"num_experts_per_tok": 2}
FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", 2),
    "mistral": Family("MistralConfig", "MistralForCausalLM", 2),
    "ministral": Family("MinistralConfig", "MinistralForCausalLM", 2),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", 2, {"num_local_experts": 4, **_MOE}),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", 2),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", 4),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        4,
        {"num_experts": 4, "moe_intermediate_size": 32, **_MOE},
    ),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", 2),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", 4),
    "gemma3_text": Family("Gemma3TextConfig", "Gemma3ForCausalLM", 6),
    "glm": Family("GlmConfig", "GlmForCausalLM", 2),
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", 4),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", 2, {"resid_pdrop": 0.1}),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", 2, {"residual_multiplier": 0.5}),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", 2),
    "apertus": Family(  # its norms have other names
        "ApertusConfig",
        "ApertusForCausalLM",
        4,
        reload_fails={
            "4.57.6": "the reloaded stock model's loss differs in the last bits",
            "5.0.0": "from_pretrained fails building its xIELU activation on the meta device",
        },
    ),
    "deepseek_v3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        4,  # with the q and kv LoRA norms
        {
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "head_dim": 8,  # the rotary part
            "num_key_value_heads": 4,  # multi-head latent attention: one key per head
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            **_MOE,
        },
    ),
    "llama4_text": Family(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        2,
        {
            "num_local_experts": 2,
            "intermediate_size_mlp": 128,
            "use_qk_norm": False,
            "interleave_moe_layer_step": 2,
        },
        stock_fails={
            "4.51.": "does not run: its eager attention multiplies a bf16 query by an fp32 key on CPU"
        },
    ),
    "olmo2": Family(
        "Olmo2Config", "Olmo2ForCausalLM", 4, refusal="Olmo2DecoderLayer: it is a post-norm layer"
    ),
    "olmo3": Family(
        "Olmo3Config", "Olmo3ForCausalLM", 4, refusal="Olmo3DecoderLayer: it is a post-norm layer"
    ),
}
COMPILED = ["llama", "qwen3", "gemma2"]  # one pre-norm, one with q/k norms, one sandwich (CI time)
FUSED = [name for name, family in FAMILIES.items() if family.refusal is None]


def _skip_where(versions: dict, model: str) -> None:
    """Skip, with the reason, where the installed transformers' version starts with a key of ``versions``."""
    for prefix, reason in versions.items():
        if transformers.__version__.startswith(prefix):
            pytest.skip(f"{model} of transformers {transformers.__version__}: {reason}")


def tiny(name: str, dtype=torch.float32) -> torch.nn.Module:
    """The family's tiny random-weight causal LM (norm weights random too, so a wrong dw shows)."""
    family = FAMILIES[name]
    if not hasattr(transformers, family.model):
        pytest.skip(f"transformers {transformers.__version__} has no {family.model}")
    _skip_where(family.stock_fails, family.model)
    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HIDDEN // 4,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
    }
    config = getattr(transformers, family.config)(attn_implementation="eager", **{**sizes, **family.extra})
    torch.manual_seed(0)
    model = getattr(transformers, family.model)(config).to(dtype)
    with torch.no_grad():
        for parameter_name, p in model.named_parameters():
            if "norm" in parameter_name:
                p.uniform_(-0.5, 0.5) if "gemma" in name else p.uniform_(0.5, 1.5)
    return model


def tokens():
    return torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))


def step(model, count=True):
    """(loss, {name: grad}, NormCalls of the forward) of one forward + backward on fixed tokens; without
    ``count`` (a compiled model: dynamo does not trace under a dispatch mode) the calls stay at zero."""
    model.zero_grad(set_to_none=True)
    ids = tokens().to(next(model.parameters()).device)
    torch.manual_seed(2)  # the same dropout masks (Phi3's residual dropouts) in every step
    calls = NormCalls()
    with calls if count else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, calls


def converted(model, fuse: bool):
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weight_offset guess warning
        count = (fuse_residual_rmsnorm if fuse else swap_rmsnorm)(model)
    return model, count


def assert_grads(actual, expected, *, exact, rtol=0.0, atol=0.0):
    assert actual.keys() == expected.keys()
    for name, g in expected.items():
        if g is None:
            assert actual[name] is None, name
        elif exact:
            assert torch.equal(actual[name], g), name
        else:
            torch.testing.assert_close(actual[name], g, rtol=rtol, atol=atol, msg=name)


def assert_same_step(model, reference, *, fused_adds=2 * LAYERS):
    """model's step is bitwise reference's (FP32), with ``fused_adds`` residual-mode norm calls."""
    loss, grads, calls = step(model)
    expected_loss, expected_grads, _ = step(reference)
    assert calls.fused == fused_adds
    assert torch.equal(loss, expected_loss)
    assert_grads(grads, expected_grads, exact=True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_swap_and_fuse_counts(name):
    """Every norm swapped (the family's count), every residual add that feeds a norm fused: two per
    layer (the in-layer add into the next norm of the layer, the layer-ending add into the next layer's
    input norm or the final norm); post-norm families refused with the reason, nothing swapped."""
    family, model = FAMILIES[name], tiny(name)
    swapped, count = converted(model, fuse=False)
    assert count == family.norms_per_layer * LAYERS + 1
    assert not any(
        type(m).__name__.endswith("RMSNorm") and not isinstance(m, CakeRMSNorm) for m in swapped.modules()
    )
    if family.refusal is not None:
        with pytest.raises(ValueError, match=family.refusal + r".*nothing to fuse"):
            converted(model, fuse=True)
        return
    fused, fused_count = converted(model, fuse=True)
    assert fused_count == count
    assert step(fused)[2].fused == 2 * LAYERS
    assert step(swapped)[2].fused == 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_matches_the_untouched_model(name):
    """Forward and gradients of the converted model (fused where the family fuses) against the model
    with its own norms; bitwise against the swapped, unfused model."""
    model = tiny(name)
    expected_loss, expected_grads, _ = step(model)
    converted_model, _ = converted(model, fuse=FAMILIES[name].refusal is None)
    loss, grads, _ = step(converted_model)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0.0)
    assert_grads(grads, expected_grads, exact=False, rtol=1e-4, atol=1e-6)
    if FAMILIES[name].refusal is None:
        assert_same_step(converted_model, converted(model, fuse=False)[0])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp64_matches_the_untouched_model(name):
    """An FP64 model runs with its norms swapped (and fused where the family fuses) and computes what
    the untouched one computes: the Hugging Face norms take their statistics in FP32 whatever the
    model's dtype, and the swapped ones follow (a few FP32 ulps apart, as in the FP32 check)."""
    model = tiny(name, torch.float64)
    try:
        expected_loss, expected_grads, _ = step(model)
    except RuntimeError as err:  # the MoE families' grouped matmul takes no FP64
        pytest.skip(f"the untouched model does not run in FP64: {err}")
    converted_model, _ = converted(model, fuse=FAMILIES[name].refusal is None)
    loss, grads, _ = step(converted_model)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0.0)
    assert_grads(grads, expected_grads, exact=False, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", FUSED)
def test_bf16(name):
    model = tiny(name, torch.bfloat16)
    fused_loss, fused_grads, calls = step(converted(model, fuse=True)[0])
    loss, grads, _ = step(converted(model, fuse=False)[0])
    assert calls.fused == 2 * LAYERS
    assert torch.equal(fused_loss, loss)
    for key, grad in grads.items():
        error = (fused_grads[key].float() - grad.float()).norm() / grad.float().norm()
        assert error <= 3e-2, (key, error)


# Relative-norm bounds of a half model's gradients against the untouched model's: the one difference
# docs/module.md states (a class rounding xhat before a weight of the input's bf16 / fp16 dtype, where the
# kernel rounds once), at every norm, through the backward of both layers (measured: up to 5.4e-2 in bf16
# and 1.0e-2 in fp16, Apertus's).
HALF_GRADIENT_BOUND = {torch.bfloat16: 8e-2, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_half_model_matches_the_untouched_model(name, dtype):
    """A bf16 / fp16 model (its weights and activations in the dtype), converted as in
    ``test_fp32_matches_the_untouched_model``: it runs wherever the untouched model runs, its gradients
    have the untouched model's dtypes, its loss is within 1e-3 relative and its gradients within the
    dtype's bound (``HALF_GRADIENT_BOUND``) of the untouched model's. An MoE model's gradients are held to
    their dtypes only: a top-k choice is discontinuous, so one half-precision ulp of a norm's output can
    move a token to another expert and change the router's and those experts' gradients by their own size
    (seen on transformers 4.51's Qwen3-MoE in bf16: 0.16 and 0.32 relative)."""
    model = tiny(name, dtype)
    expected_loss, expected_grads, _ = step(model)
    loss, grads, _ = step(converted(model, fuse=FAMILIES[name].refusal is None)[0])
    torch.testing.assert_close(loss, expected_loss, rtol=1e-3, atol=0.0)
    assert grads.keys() == expected_grads.keys()
    for key, expected in expected_grads.items():
        if expected is None:
            assert grads[key] is None, key
            continue
        assert grads[key].dtype == expected.dtype, key
        if "num_experts_per_tok" in FAMILIES[name].extra:
            continue
        error = (grads[key].float() - expected.float()).norm() / expected.float().norm()
        assert error <= HALF_GRADIENT_BOUND[dtype], (key, error)


@pytest.mark.parametrize("name", FUSED)
def test_autocast(name):
    """fp32 weights under CPU bf16 autocast (HF Trainer's bf16=True): the residual stream stays fp32 and
    the branches are mostly bf16; each add whose operands share a dtype is fused (e.g. a mixture of
    experts summed in fp32), each mixed one stays torch's type-promoting add (no crash, no bf16 rounding
    of the residual stream), and the step is bitwise the swapped, unfused model's."""
    model = tiny(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, unfused = converted(model, fuse=True)[0], converted(model, fuse=False)[0]
        loss, grads, calls = step(fused)
        expected_loss, expected_grads, unfused_calls = step(unfused)
    assert torch.equal(loss, expected_loss)
    assert_grads(grads, expected_grads, exact=True)
    # Each fused call replaced one same-dtype add of the unfused model; no mixed add was fused. (A norm
    # that scales an fp32-weighted output in fp32, as GLM4's post-attention norm, makes its add fp32 +
    # fp32: fused.)
    assert calls.fused == unfused_calls.same_dtype_adds - calls.same_dtype_adds
    assert calls.mixed_adds == unfused_calls.mixed_adds
    assert calls.fused + calls.mixed_adds > 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", FUSED)
def test_checkpointing(name, reentrant):
    """gradient_checkpointing_enable: the fused forward runs under the checkpoint; non-reentrant fuses
    both adds of every layer, reentrant the in-layer ones (its first pass has no grad to hand over)."""
    model = tiny(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradient_checkpointing_enable's deprecation
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert_same_step(
        converted(model, fuse=True)[0],
        converted(model, fuse=False)[0],
        fused_adds=LAYERS if reentrant else 2 * LAYERS,
    )


@pytest.mark.parametrize("name", FUSED)
def test_save_and_load(name, tmp_path):
    """state_dict keys unchanged; save_pretrained / from_pretrained round trip; the loaded model fuses;
    torch.save / torch.load of the whole fused model stays fused."""
    model = tiny(name)
    _skip_where(FAMILIES[name].reload_fails, FAMILIES[name].model)
    fused, _ = converted(model, fuse=True)
    assert fused.state_dict().keys() == model.state_dict().keys()
    fused.save_pretrained(tmp_path)
    loaded = getattr(transformers, FAMILIES[name].model).from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    for key, tensor in fused.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert_same_step(converted(loaded.train(fused.training), fuse=True)[0], fused)
    torch.save(fused, tmp_path / "whole.pt")
    assert_same_step(torch.load(tmp_path / "whole.pt", weights_only=False), fused)


@pytest.mark.parametrize("name", COMPILED)
def test_compile(name):
    """torch.compile(fullgraph=True) of the fused model (aot_eager: the traced graph, run eagerly): the
    loss is bitwise the eager fused step's, and so are the gradients, except where per-head q / k norms
    compile to their PyTorch math (Qwen3), whose autograd backward agrees with the kernel's to FP32
    rounding."""
    fused, _ = converted(tiny(name), fuse=True)
    head_norms = any(isinstance(m, CakeRMSNorm) and m.compiled_as == "torch" for m in fused.modules())
    assert head_norms == (name == "qwen3")
    eager_loss, eager_grads, _ = step(fused)
    torch._dynamo.reset()
    loss, grads, _ = step(torch.compile(fused, fullgraph=True, backend="aot_eager"), count=False)
    assert torch.equal(loss, eager_loss)
    assert_grads(grads, eager_grads, exact=not head_norms, rtol=1e-4, atol=1e-6)


def _hf_matrix():
    """scripts/hf_matrix.py, the generator of docs/hf_families.md, as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "hf_matrix.py"
    spec = importlib.util.spec_from_file_location("hf_matrix", path)
    hf_matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_matrix)
    return hf_matrix


def test_the_family_table_keeps_one_section_per_version():
    """Each run replaces its own transformers version's section and keeps the others, ordered by
    version; a file from before the per-version layout loses its old body."""
    hf_matrix = _hf_matrix()
    old = "# Hugging Face families\n\nGenerated from 5.24.0\n\n| llama | ... |\n\n## Every decoder layer\n"
    newest = "## transformers 5.24.0\n\nnew 5.24 table\n"
    oldest = "## transformers 4.51.3\n\n4.51 table\n"
    document = hf_matrix.merged(hf_matrix.merged(old, newest), oldest)
    assert document == hf_matrix.HEADER + "\n" + oldest + "\n" + newest
    again = hf_matrix.merged(document, "## transformers 4.51.3\n\nrerun\n")
    assert again == hf_matrix.HEADER + "\n## transformers 4.51.3\n\nrerun\n\n" + newest
    assert "Generated from" not in again and "5.10.0" not in again
    later = hf_matrix.merged(again, "## transformers 5.10.0\n\nx\n")  # ordered as versions, not text
    assert later.index("4.51.3") < later.index("5.10.0") < later.index("5.24.0")


def test_the_family_table_reads_each_outcome(tmp_path):
    """scripts/hf_matrix.py maps each test id of this file (family, and the checkpointing variant) to its
    outcome, so a failing check shows as a failure in the generated table."""
    hf_matrix = _hf_matrix()
    junit = tmp_path / "run.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_hf_conformance_cpu" name="test_bf16[llama]"/>'
        '<testcase classname="tests.test_hf_conformance_cpu" name="test_checkpointing[gemma2-reentrant]">'
        '<failure message="x"/></testcase>'
        '<testcase classname="tests.test_hf_conformance_cpu" name="test_compile[qwen3]"><skipped/></testcase>'
        '<testcase classname="tests.test_hf_conformance_cpu" name="test_plain"/>'
        "</testsuite></testsuites>"
    )
    assert hf_matrix.outcomes(junit) == {
        ("test_bf16", "llama", None): "passed",
        ("test_checkpointing", "gemma2", "reentrant"): "failed",
        ("test_compile", "qwen3", None): "skipped",
    }
