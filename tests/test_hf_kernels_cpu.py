"""Hugging Face's kernel route to cake_cute's norms on CPU: the layer repository the package ships,
``cake_cute.hf_kernel_config`` (transformers' ``set_use_kernels`` / ``from_pretrained(use_kernels=True)``)
and ``cake_cute.hf_kernel_mapping`` (the ``kernels`` package's ``kernelize``), against the same norms
swapped by ``swap_rmsnorm`` / ``swap_gated_rmsnorm``.

On CPU the layers run cake_cute's ops on their reference kernels, as a swapped model does, and the
route runs there as on CUDA: ``CakeKernelConfig`` serves both devices (transformers' own list of
devices has no CPU). What is checked:

* the repository: its metadata's digest is its files', and each layer loads through the installed
  ``kernels`` package as ``cake_cute.hf.kernel_layers``' class;
* class by class: a kernelized norm's y and gradients bitwise the swapped module's (fp32, bf16, a bf16
  input with an fp32 weight, ``[H]``, no rows, a row-strided view), and traced by torch.compile whole;
* model by model, every family of the conformance matrices (``test_hf_conformance_cpu``,
  ``test_gated_models_cpu``): FP32 logits, loss and gradients bitwise the model with the same norms
  swapped; FP32 logits and loss bitwise the stock model's, its gradients within the conformance bound;
  a family whose norms transformers does not decorate is refused by name. A subset under CPU bf16
  autocast, Hugging Face's gradient checkpointing, torch.compile (``Mode.TRAINING | Mode.TORCH_COMPILE``)
  and in inference, and through the kernels package's ``kernelize`` in each mode;
* ``from_pretrained(use_kernels=True)``, which kernelizes in eval mode, then ``train()``: the layers
  stay; a ``Trainer`` run of three steps: its losses and final weights bitwise the swapped model's;
* refusals by name: a class whose weight offset would be a guess (by the config and by the layer on
  its first call), a gate it does not read, an unknown or absent layer name, an unusable kernels release.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.metadata
import json
import warnings

import pytest
import torch
from packaging.version import Version
from torch import nn

from cake_cute import NormNotServed, hf_kernel_config, hf_kernel_mapping, swap_gated_rmsnorm, swap_rmsnorm
from cake_cute.hf import kernel_layers, kernel_route

from .test_gated_models_cpu import FAMILIES as GATED_FAMILIES
from .test_gated_models_cpu import _hf_class, _holding, _tiny_model
from .test_hf_conformance_cpu import FAMILIES, TOKENS, VOCAB, tiny, tokens

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")
if Version(transformers.__version__) < Version(kernel_route.MIN_TRANSFORMERS):
    pytest.skip(f"the route needs transformers >= {kernel_route.MIN_TRANSFORMERS}", allow_module_level=True)

from kernels import LocalLayerRepository, Mode  # noqa: E402

VARIANT = kernel_route.REPOSITORY / "build" / "torch-universal"
HIDDEN = 64


def _route_layer(module: nn.Module) -> str | None:
    name = getattr(type(module), "kernel_layer_name", None)
    return name if name in kernel_route.LAYERS else None


def _swapped_like_route(model: nn.Module, names) -> nn.Module:
    """A copy of ``model`` with exactly the norms the route replaces (those registered under ``names``)
    swapped, each alone, by swap_rmsnorm or swap_gated_rmsnorm."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if _route_layer(child) in names:
                holder = _holding(child)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # swap_rmsnorm's note about what it leaves alone
                    (swap_gated_rmsnorm if _route_layer(child) == "RMSNormGated" else swap_rmsnorm)(holder)
                setattr(parent, child_name, holder.norm)
    return model


def _kernelized(model: nn.Module, mode=None) -> nn.Module:
    """A copy of ``model`` kernelized through transformers' route with cake_cute's config."""
    model = copy.deepcopy(model)
    model.set_use_kernels(True, kernel_config=hf_kernel_config(model), mode=mode)
    return model


def _assert_bound(model: nn.Module, mapped=None) -> int:
    """Every norm under a mapped layer name (default: the model's kernel config's) runs cake_cute's
    layer; returns how many."""
    mapped = set(model.kernel_config.kernel_mapping if mapped is None else mapped)
    norms = [m for m in model.modules() if _route_layer(m) in mapped]
    for m in norms:
        layer = getattr(kernel_layers, kernel_route.LAYERS[_route_layer(m)])
        assert m.forward.__func__ is layer.forward, type(m).__name__
    return len(norms)


def _step(model: nn.Module):
    """(logits, loss, {name: grad}) of one forward + backward on fixed tokens."""
    model.zero_grad(set_to_none=True)
    ids = tokens().to(next(model.parameters()).device)
    torch.manual_seed(2)  # the same dropout masks in every step
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same_step(actual, expected):
    (logits, loss, grads), (want_logits, want_loss, want_grads) = actual, expected
    assert torch.equal(logits, want_logits)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert (grads[name] is None) if g is None else torch.equal(grads[name], g), name


# --- the repository -----------------------------------------------------------------------------


def test_the_metadata_digest_is_the_files():
    """The kernels package checks a variant's files against the digest in its metadata (sha256,
    base64, every file but metadata.json); an edited layer file needs the digest below."""
    files = sorted(p for p in VARIANT.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digests = {
        p.relative_to(VARIANT).as_posix(): base64.b64encode(hashlib.sha256(p.read_bytes()).digest()).decode()
        for p in files
        if p.name != "metadata.json"
    }
    metadata = json.loads((VARIANT / "metadata.json").read_text())
    assert metadata["digest"] == {"algorithm": "sha256", "files": digests}, json.dumps(digests, indent=2)


@pytest.mark.parametrize("layer", sorted(kernel_route.LAYERS.values()))
def test_each_layer_loads_through_the_installed_kernels(layer, caplog):
    loaded = LocalLayerRepository(repo_path=kernel_route.REPOSITORY, layer_name=layer).load()
    assert loaded is getattr(kernel_layers, layer)
    assert "digest" not in caplog.text


# --- class by class -----------------------------------------------------------------------------

PLAIN_CLASSES = [
    ("llama", "LlamaRMSNorm"),
    ("qwen3", "Qwen3RMSNorm"),
    ("glm4", "Glm4RMSNorm"),
    ("deepseek_v3", "DeepseekV3RMSNorm"),
    ("qwen3_5", "Qwen3_5RMSNorm"),  # "RMSNormZeroCentered": 1 + weight, scaled in FP32
]
GATED_CLASSES = [
    ("qwen3_next", "Qwen3NextRMSNormGated"),
    ("qwen3_5", "Qwen3_5RMSNormGated"),
    ("olmo_hybrid", "OlmoHybridRMSNormGated"),
    ("lara_mini", "LaraMiniRMSNormGated"),  # one final rounding
    ("kimi_linear", "KimiLinearRMSNormGated"),  # a sigmoid gate
    ("glm5_next", "Glm5NextTextRMSNormGated"),  # a sigmoid gate
]
# (input dtype, weight dtype, input shape, H): an input wider than H is read as a row-strided view of
# its first H columns.
CASES = {
    "fp32": (torch.float32, torch.float32, (2, 3, HIDDEN), HIDDEN),
    "bf16": (torch.bfloat16, torch.bfloat16, (2, 3, HIDDEN), HIDDEN),
    "bf16-fp32-weight": (torch.bfloat16, torch.float32, (2, 3, HIDDEN), HIDDEN),
    "one-row-1d": (torch.bfloat16, torch.bfloat16, (HIDDEN,), HIDDEN),
    "no-rows": (torch.bfloat16, torch.bfloat16, (0, HIDDEN), HIDDEN),
    "row-strided": (torch.bfloat16, torch.bfloat16, (5, 2 * HIDDEN), HIDDEN),
    "h7-t129": (torch.bfloat16, torch.bfloat16, (129, 7), 7),
    "h1-t2": (torch.float16, torch.float16, (2, 1), 1),
}


def _class_pair(family: str, name: str, weight_dtype, hidden: int = HIDDEN):
    """(kernelized, swapped) copies of one norm of the class, random weight."""
    torch.manual_seed(0)
    norm = _hf_class(family, name)(hidden, eps=1e-6).to(weight_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    kernelized = _holding(copy.deepcopy(norm))
    with kernels.use_kernel_mapping(hf_kernel_mapping(kernelized), inherit_mapping=False):
        kernels.kernelize(kernelized, mode=Mode.TRAINING, device="cpu")
    return kernelized.norm, _swapped_like_route(_holding(norm), kernel_route.LAYERS).norm


def _inputs(count: int, dtype, shape, hidden: int = HIDDEN):
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randn(shape, generator=gen).to(dtype) for _ in range(count + 1)]
    if shape[-1] != hidden:
        tensors = [t[..., :hidden] for t in tensors]  # rows 2 H apart, each row contiguous
    return tensors[:count], tensors[count]


def _run(module: nn.Module, inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    module.zero_grad(set_to_none=True)
    y = module(*leaves)
    torch.autograd.backward(y, dy.to(y.dtype))
    return [y, *(leaf.grad for leaf in leaves), module.weight.grad]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("family", "name", "gated"), [(*c, False) for c in PLAIN_CLASSES] + [(*c, True) for c in GATED_CLASSES]
)
def test_a_kernelized_norm_computes_what_the_swapped_module_computes(family, name, gated, case):
    dtype, weight_dtype, shape, hidden = CASES[case]
    kernelized, swapped = _class_pair(family, name, weight_dtype, hidden)
    inputs, dy = _inputs(2 if gated else 1, dtype, shape, hidden)
    for got, want in zip(_run(kernelized, inputs, dy), _run(swapped, inputs, dy)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("family", "name", "gated"), [(*PLAIN_CLASSES[-1], False), (*GATED_CLASSES[0], True)]
)
def test_a_kernelized_norm_compiles_whole(family, name, gated):
    """torch.compile(fullgraph=True) traces the layer (its class read outside the graph) to the eager
    module's values."""
    kernelized, _ = _class_pair(family, name, torch.bfloat16)
    inputs, dy = _inputs(2 if gated else 1, torch.bfloat16, (2, 3, HIDDEN))
    eager = _run(kernelized, inputs, dy)
    torch._dynamo.reset()
    compiled = _run(torch.compile(kernelized, fullgraph=True, backend="aot_eager"), inputs, dy)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


# --- model by model -----------------------------------------------------------------------------


# Gated-matrix families whose stock model does not run here, by transformers version (prefix).
STOCK_FAILS = {
    "falcon_h1": {"5.17.": "its CPU chunk scan allocates 16 GiB for 8 tokens (chunk size 256)"},
    "glm5_next": {"5.17.": "the tiny config's layer type indexed_attention is newer than this release"},
}


def _family_model(name: str) -> nn.Module:
    if name in FAMILIES:
        return tiny(name)
    for prefix, reason in STOCK_FAILS.get(name, {}).items():
        if transformers.__version__.startswith(prefix):
            pytest.skip(f"{name} of transformers {transformers.__version__}: {reason}")
    try:
        return _tiny_model(name)
    except (ImportError, AttributeError):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")


@pytest.mark.parametrize("name", list(FAMILIES) + [f for f in GATED_FAMILIES if f not in FAMILIES])
def test_fp32_bitwise_the_swapped_norms_and_close_to_stock(name):
    """Each family: the route's model bitwise the same norms swapped; against the stock model, FP32
    logits and loss bitwise (the CPU kernels do the classes' FP32 operations and round once) and
    gradients within the conformance matrix's bound (the kernels' closed-form backward against
    autograd's chain); a family with no norm decorated for the route is refused by name."""
    model = _family_model(name).train()
    names = {_route_layer(m) for m in model.modules()} - {None}
    if not names:
        with pytest.raises(ValueError, match="has no module that transformers' kernel route replaces"):
            hf_kernel_config(model)
        return
    kernelized = _kernelized(model)
    assert _assert_bound(kernelized) >= 1
    result = _step(kernelized)
    _assert_same_step(result, _step(_swapped_like_route(model, names)))
    stock_logits, stock_loss, stock_grads = _step(model)
    assert torch.equal(result[0], stock_logits) and torch.equal(result[1], stock_loss)
    for key, g in stock_grads.items():
        if g is not None:
            torch.testing.assert_close(result[2][key], g, rtol=1e-4, atol=1e-6, msg=key)


SUBSET = ["llama", "qwen3", "qwen3_next", "qwen3_5"]


@pytest.mark.parametrize("name", SUBSET)
def test_autocast(name):
    """CPU bf16 autocast over fp32 weights (Trainer's bf16=True): bitwise the swapped norms' step."""
    model = _family_model(name).train()
    reference = _swapped_like_route(model, kernel_route.LAYERS)
    kernelized = _kernelized(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_step(_step(kernelized), _step(reference))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", SUBSET)
def test_gradient_checkpointing(name, reentrant):
    model = _family_model(name).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradient_checkpointing_enable's deprecation
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _assert_same_step(_step(_kernelized(model)), _step(_swapped_like_route(model, kernel_route.LAYERS)))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_compiled_training(name):
    """``Mode.TRAINING | Mode.TORCH_COMPILE``, torch.compile(fullgraph=True): bitwise the swapped
    norms compiled alike (their per-head norms the kernel too, as the layer runs them)."""
    model = tiny(name).train()
    kernelized = _kernelized(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    reference = _swapped_like_route(model, kernel_route.LAYERS)
    results = []
    for m in (kernelized, reference):
        torch._dynamo.reset()
        results.append(_step(torch.compile(m, fullgraph=True, backend="aot_eager")))
    _assert_same_step(*results)


@pytest.mark.parametrize("mode", ["training", "training-compile", "inference"])
def test_the_kernels_package_route_in_each_mode(mode):
    """``kernels.kernelize(model, mode=...)`` under ``hf_kernel_mapping``: the layers bound in each mode,
    the step (compiled for ``TORCH_COMPILE``; logits without grad for inference) bitwise the swapped
    norms'."""
    model = tiny("qwen3").train(mode != "inference")
    flags = {"training": Mode.TRAINING, "inference": Mode.INFERENCE}.get(
        mode, Mode.TRAINING | Mode.TORCH_COMPILE
    )
    kernelized = copy.deepcopy(model)
    with kernels.use_kernel_mapping(hf_kernel_mapping(kernelized), inherit_mapping=False):
        kernels.kernelize(kernelized, mode=flags, device="cpu")
    reference = _swapped_like_route(model, kernel_route.LAYERS)
    assert _assert_bound(kernelized, ["RMSNorm"]) == 4 * 2 + 1
    if mode == "inference":
        with torch.no_grad():
            ids = tokens()
            assert torch.equal(kernelized(input_ids=ids).logits, reference(input_ids=ids).logits)
        return
    if mode == "training-compile":
        torch._dynamo.reset()
        kernelized, reference = (
            torch.compile(m, fullgraph=True, backend="aot_eager") for m in (kernelized, reference)
        )
    _assert_same_step(_step(kernelized), _step(reference))


def test_compiling_each_decoder_layer_adds_no_recompile():
    """The layers read their class outside the graph and guard on no module instance, so decoder
    layers compiled one by one share their graph as the stock layers do."""
    from torch._dynamo.testing import CompileCounter

    model = tiny("llama").train()
    frames = []
    for m in (model, _kernelized(model)):
        torch._dynamo.reset()
        counter = CompileCounter()
        for layer in m.model.layers:
            layer.compile(fullgraph=True, backend=counter)
        _step(m)
        frames.append(counter.frame_count)
    assert frames[1] == frames[0]


@pytest.mark.parametrize("name", SUBSET)
def test_inference(name):
    """eval() re-kernelizes for ``Mode.INFERENCE``: the layers stay, logits bitwise under no_grad."""
    model = _family_model(name)
    kernelized = _kernelized(model).eval()
    reference = _swapped_like_route(model, kernel_route.LAYERS).eval()
    _assert_bound(kernelized)
    with torch.no_grad():
        ids = tokens()
        assert torch.equal(kernelized(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_from_pretrained_then_train(tmp_path):
    """from_pretrained kernelizes in eval mode; train() re-kernelizes for training and the layers stay
    (transformers' own KernelConfig registers the eval mode only and the stock forward would return)."""
    tiny("qwen3").save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, use_kernels=True, kernel_config=hf_kernel_config(config), attn_implementation="eager"
    )
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert _assert_bound(model) == 4 * 2 + 1
    assert set(model.kernel_config.kernel_mapping["RMSNorm"]) == {"cuda", "cpu"}  # either device, later
    model.train()
    assert _assert_bound(model) == 4 * 2 + 1
    _assert_same_step(_step(model), _step(_swapped_like_route(stock.train(), kernel_route.LAYERS)))


def assert_trainer_runs_alike(routed: nn.Module, swapped: nn.Module, out, **arguments) -> None:
    """Three Trainer steps (AdamW) of each model on the same data: the logged losses and the final
    weights bitwise alike, and the route's layers still bound after the Trainer's train()."""
    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (8, TOKENS), generator=gen)]
    logs = []
    for model, name in ((routed, "route"), (swapped, "swap")):
        args = transformers.TrainingArguments(
            output_dir=str(out / name),
            max_steps=3,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            **arguments,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        logs.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(logs[0]) == 3 and logs[0] == logs[1]
    _assert_bound(routed)
    for (name, p), q in zip(routed.named_parameters(), swapped.parameters()):
        assert torch.equal(p, q), name


def test_trainer(tmp_path):
    pytest.importorskip("accelerate")  # the Trainer's
    model = tiny("llama")
    kernelized, reference = _kernelized(model), _swapped_like_route(model, kernel_route.LAYERS)
    assert_trainer_runs_alike(kernelized, reference, tmp_path, use_cpu=True)


# --- refusals -----------------------------------------------------------------------------------


class _GuessedOffsetRMSNorm(nn.Module):
    """An RMSNorm whose forward copies its weight into a local: whether it scales by weight or by
    1 + weight is not in the source swap_rmsnorm reads."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        scale = self.weight
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return scale * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


_GuessedOffsetRMSNorm = kernels.use_kernel_forward_from_hub("RMSNorm")(_GuessedOffsetRMSNorm)
GUESS = "_GuessedOffsetRMSNorm: its forward does not show whether it scales by weight or by 1 \\+ weight"


def test_a_class_whose_offset_would_be_a_guess_is_refused_by_the_config():
    with pytest.raises(NormNotServed, match=GUESS):
        hf_kernel_config(_holding(_GuessedOffsetRMSNorm(HIDDEN)))


def test_a_class_whose_offset_would_be_a_guess_is_refused_by_the_layer_on_its_first_call():
    """A mapping made for another model reaches the class: the layer refuses before computing."""
    holder = _holding(_GuessedOffsetRMSNorm(HIDDEN))
    mapping = hf_kernel_mapping(_holding(_hf_class("llama", "LlamaRMSNorm")(HIDDEN)))
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(holder, mode=Mode.TRAINING, device="cpu")
    with pytest.raises(NormNotServed, match=GUESS):
        holder.norm(torch.randn(2, HIDDEN))


class _TanhRMSNormGated(nn.Module):
    """A gated norm whose gate is a tanh, which the kernels do not compute."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * torch.tanh(gate.to(torch.float32))
        return hidden_states.to(input_dtype)


_TanhRMSNormGated = kernels.use_kernel_forward_from_hub("RMSNormGated")(_TanhRMSNormGated)


def test_a_gate_the_swap_does_not_read_is_refused_and_can_be_left_out():
    holder = _holding(_TanhRMSNormGated(HIDDEN))
    holder.plain = _hf_class("llama", "LlamaRMSNorm")(HIDDEN)
    with pytest.raises(NormNotServed, match="_TanhRMSNormGated: its forward does not gate as"):
        hf_kernel_config(holder)
    assert list(hf_kernel_config(holder, layers=["RMSNorm"]).kernel_mapping) == ["RMSNorm"]


@pytest.mark.parametrize(
    ("layers", "error", "match"),
    [
        (["RMSNormGated"], ValueError, "has no module registered as 'RMSNormGated'"),
        (
            ["LayerNorm"],
            ValueError,
            "cake_cute serves RMSNorm, RMSNormZeroCentered, RMSNormGated, not 'LayerNorm'",
        ),
        ("RMSNorm", TypeError, "not the string 'RMSNorm'"),
    ],
)
def test_layer_names_are_checked(layers, error, match):
    with pytest.raises(error, match=match):
        hf_kernel_config(_holding(_hf_class("llama", "LlamaRMSNorm")(HIDDEN)), layers=layers)


def test_a_model_that_is_neither_module_nor_config_is_refused():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or a transformers config"):
        hf_kernel_config("meta-llama/Llama-3.2-1B")


@pytest.mark.parametrize(
    ("installed", "match"),
    [("0.9.0", "needs kernels >= 0.16.0; 0.9.0 is installed"), (None, "needs kernels >= 0.16.0")],
    ids=["old", "missing"],
)
def test_an_unusable_kernels_release_is_refused_by_name(monkeypatch, installed, match):
    real = importlib.metadata.version

    def version(package):
        if package != "kernels":
            return real(package)
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(package)
        return installed

    monkeypatch.setattr(kernel_route.importlib.metadata, "version", version)
    with pytest.raises(ImportError, match=match):
        hf_kernel_config(_holding(_hf_class("llama", "LlamaRMSNorm")(HIDDEN)))


def test_the_route_turned_off_by_use_hub_kernels_is_refused(monkeypatch):
    """USE_HUB_KERNELS=NO makes from_pretrained keep the stock norms with a log line; the config refuses."""
    from transformers.integrations import hub_kernels

    off = (lambda: False) if callable(hub_kernels._kernels_enabled) else False
    monkeypatch.setattr(hub_kernels, "_kernels_enabled", off)
    with pytest.raises(ValueError, match="USE_HUB_KERNELS turns transformers' kernel route off"):
        hf_kernel_config(_holding(_hf_class("llama", "LlamaRMSNorm")(HIDDEN)))


def test_a_repository_the_kernels_package_cannot_load_is_refused(monkeypatch, tmp_path):
    """transformers would fall back to the stock forward when a layer does not load; the config fails."""
    monkeypatch.setattr(kernel_route, "REPOSITORY", tmp_path)
    with pytest.raises(ImportError, match="cannot load cake_cute's layer repository"):
        hf_kernel_config(_holding(_hf_class("llama", "LlamaRMSNorm")(HIDDEN)))


def test_other_devices_are_refused():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny("llama").config)
    config = hf_kernel_config(model)
    with pytest.raises(ValueError, match="run on cuda and cpu, not on meta"):
        config.create_compatible_mapping(model)
