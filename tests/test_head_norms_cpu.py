"""Per-head (q / k) norms under torch.compile, without a GPU.

``swap_rmsnorm`` marks the norms over the head_dim of ``[..., heads, head_dim]`` projections
(``compiled_as="torch"``) and leaves every other norm to the kernel; a compiled graph of a marked norm
holds its PyTorch math and no ``cake_cute`` op, an unmarked one the ops. The math is the module's (eps,
eps=None, weight_offset, cast policy, autocast output dtypes, residual mode), so a compiled norm agrees
with the eager kernel: the forward bitwise where the graph runs torch's own ops (aot_eager), the
gradients to FP32 rounding (the kernel's backward formula and its row-ordered dW sum are not
autograd's), and to one bf16 unit under inductor (which drops the bf16 rounding of the normalized
values inside a fused kernel, as it does for the Hugging Face module itself).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch import nn
from torch._functorch.aot_autograd import aot_module_simplified

from cake_cute import CakeRMSNorm, casts, fuse_residual_rmsnorm, swap_rmsnorm
from cake_cute.forward_names import INPUT_NAME

from ._hf_helpers import NormCalls

transformers = pytest.importorskip("transformers")

HEAD_DIM, HEADS = 16, 4
FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
BF16_UNIT = 2**-7  # relative: one bf16 unit


def _traced_graphs(norm: nn.Module, inputs: dict) -> list[torch.fx.GraphModule]:
    """The forward and backward graphs torch.compile traces for one forward + backward of ``norm``."""
    graphs = []

    def keep(graph_module, _):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    def recording(graph_module, example_inputs):
        return aot_module_simplified(graph_module, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    out = torch.compile(norm, fullgraph=True, backend=recording)(**inputs)
    sum(t.float().sum() for t in (out if isinstance(out, tuple) else (out,))).backward()
    return graphs


def _cake_ops(graphs) -> list[str]:
    return [str(n.target) for g in graphs for n in g.graph.nodes if "cake_cute" in str(n.target)]


def _head_input(dtype, seed=1) -> torch.Tensor:
    """A q projection as attention views it: [batch, tokens, heads, head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, HEADS, HEAD_DIM, generator=generator).to(dtype)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("compiled_as", ["torch", "kernel"])
def test_the_compiled_graph_holds_the_kernel_only_when_asked(compiled_as, residual):
    norm = CakeRMSNorm(HEAD_DIM, compiled_as=compiled_as)
    x = _head_input(torch.float32).requires_grad_()
    inputs = {INPUT_NAME: x, "residual": _head_input(torch.float32, seed=2)} if residual else {INPUT_NAME: x}
    graphs = _traced_graphs(norm, inputs)
    assert len(graphs) == 2  # the forward and the backward
    ops = _cake_ops(graphs)
    if compiled_as == "torch":
        assert ops == []
    else:
        assert ops == ["cake_cute.rmsnorm_fwd.default", "cake_cute.rmsnorm_bwd.default"]


def test_a_marked_norm_runs_the_kernel_in_eager():
    norm = CakeRMSNorm(HEAD_DIM, compiled_as="torch")
    with NormCalls() as calls:
        norm(_head_input(torch.bfloat16))
    assert calls.plain == 1


# (CakeRMSNorm arguments, weight dtype): the kernels' own math with eps=None, Gemma's 1 + weight, a
# Llama-style norm whose FP32 weight scales the rounded normalized values, a T5 norm.
CASES = {
    "torch_eps_none": (dict(eps=None), None),
    "gemma_offset": (dict(eps=1e-6, weight_offset=1.0, cast_policy="scale_then_round"), None),
    "llama_fp32_weight": (dict(eps=1e-6, cast_policy="round_then_scale"), torch.float32),
    "t5_fp32_weight": (dict(eps=1e-6, cast_policy="t5"), torch.float32),
}


def _marked_norm(case: str, dtype) -> CakeRMSNorm:
    """A marked norm with a random weight (around its offset, so dW is not trivial)."""
    arguments, w_dtype = CASES[case]
    norm = CakeRMSNorm(HEAD_DIM, dtype=w_dtype or dtype, compiled_as="torch", **arguments)
    with torch.no_grad():
        norm.weight.normal_(1.0 - norm.weight_offset, 0.5, generator=torch.Generator().manual_seed(3))
    return norm


def _forward_backward(norm, x, residual=None):
    """(outputs..., dx, [d_residual,] dw) of one call with a fixed upstream gradient."""
    x = x.detach().requires_grad_()
    leaves = [x] if residual is None else [x, residual.detach().requires_grad_()]
    out = norm(x) if residual is None else norm(x, residual=leaves[1])
    outs = out if isinstance(out, tuple) else (out,)
    generator = torch.Generator().manual_seed(4)
    grads = [torch.randn(t.shape, generator=generator).to(t.dtype) for t in outs]
    return (*outs, *torch.autograd.grad(outs, [*leaves, norm.weight], grads))


def _assert_agree(got, want, *, forward_bitwise: bool, outputs: int):
    for index, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        if index < outputs and forward_bitwise:
            assert torch.equal(a, b), index
        elif a.dtype == torch.bfloat16:
            # One bf16 unit of the element, or of the tensor's largest one (a sum rounded twice).
            torch.testing.assert_close(a, b, rtol=BF16_UNIT, atol=BF16_UNIT * b.abs().max().item())
        else:
            torch.testing.assert_close(a, b, **FP32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_math_matches_the_eager_kernel(case, dtype):
    """aot_eager runs the traced graph's aten ops: the forward is bitwise the kernel's."""
    norm = _marked_norm(case, dtype)
    x = _head_input(dtype)
    want = _forward_backward(norm, x)
    torch._dynamo.reset()
    got = _forward_backward(torch.compile(norm, fullgraph=True, backend="aot_eager"), x)
    _assert_agree(got, want, forward_bitwise=True, outputs=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["torch_eps_none", "gemma_offset", "llama_fp32_weight"])
def test_inductor_compiled_math_matches_the_eager_kernel(case, dtype):
    """Inductor's own sums differ from the kernel's in order; with its casts emulated (else a fused
    kernel keeps the normalized values in FP32 where the graph rounds them to bf16, as it does for the
    Hugging Face module itself) the results agree to rounding."""
    norm = _marked_norm(case, dtype)
    x = _head_input(dtype)
    want = _forward_backward(norm, x)
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        got = _forward_backward(torch.compile(norm, fullgraph=True, backend="inductor"), x)
    _assert_agree(got, want, forward_bitwise=False, outputs=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_mode_compiles_to_the_math_too(dtype):
    """h = x + residual rounded as the kernel rounds it (bitwise); its gradient, the sum of h's and y's,
    is rounded twice by autograd where the kernel rounds once (one bf16 unit)."""
    norm = _marked_norm("gemma_offset", dtype)
    x, residual = _head_input(dtype), _head_input(dtype, seed=2)
    want = _forward_backward(norm, x, residual)
    torch._dynamo.reset()
    got = _forward_backward(torch.compile(norm, fullgraph=True, backend="aot_eager"), x, residual)
    _assert_agree(got, want, forward_bitwise=True, outputs=2)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_autocast_output_dtypes_are_the_kernels(case):
    norm = _marked_norm(case, torch.float32)
    x = _head_input(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "cannot dispatch to fused implementation"
        want = _forward_backward(norm, x)
        torch._dynamo.reset()
        got = _forward_backward(torch.compile(norm, fullgraph=True, backend="aot_eager"), x)
    _assert_agree(got, want, forward_bitwise=True, outputs=1)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_cuda_autocast_policy_gives_the_kernels_fp32_output(monkeypatch, residual):
    """torch.nn.RMSNorm's policy where CUDA autocast lists rms_norm (FP32 inputs, an FP32 output), on
    CPU tensors with CUDA's autocast state patched in: the math path takes the same casts."""
    monkeypatch.setattr(casts, "_cuda_autocast", lambda x: True)
    norm = _marked_norm("torch_eps_none", torch.float32)
    x, r = _head_input(torch.bfloat16), _head_input(torch.bfloat16, seed=2)
    want = _forward_backward(norm, x, r if residual else None)
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    got = _forward_backward(compiled, x, r if residual else None)
    assert got[0].dtype == torch.float32
    _assert_agree(got, want, forward_bitwise=True, outputs=2 if residual else 1)


def test_compiled_as_is_checked_shown_and_saved(tmp_path):
    with pytest.raises(ValueError, match="compiled_as must be one of 'kernel', 'torch'; got 'inductor'"):
        CakeRMSNorm(HEAD_DIM, compiled_as="inductor")
    norm = CakeRMSNorm(HEAD_DIM, compiled_as="torch")
    assert "compiled_as=torch" in repr(norm) and "compiled_as" not in repr(CakeRMSNorm(HEAD_DIM))
    torch.save(nn.Sequential(norm), tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=False)[0].compiled_as == "torch"


# --- which norms swap_rmsnorm marks ----------------------------------------------------------------------

_MOE = {"num_experts_per_tok": 2}
# family -> (config class, causal-LM class, extra config, the names of its per-head norms)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, {"q_norm", "k_norm"}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 32, **_MOE},
        {"q_norm", "k_norm"},
    ),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, {"q_norm", "k_norm"}),
    "llama4_text": (  # a weightless L2 norm over every head, named qk_norm
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "num_local_experts": 2,
            "intermediate_size_mlp": 128,
            "use_qk_norm": True,
            "interleave_moe_layer_step": 2,
        },
        {"qk_norm"},
    ),
    # OLMo2 / OLMo3 normalize the whole q and k projections (heads x head_dim): not per head.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, set()),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}, set()),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, set()),
}


def _tiny(name: str) -> nn.Module:
    config_name, model_name, extra, _ = FAMILIES[name]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(
        vocab_size=128,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
        pad_token_id=0,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def _compiled_as(model: nn.Module) -> dict[str, str]:
    """{module path: compiled_as} of every CakeRMSNorm."""
    return {name: m.compiled_as for name, m in model.named_modules() if isinstance(m, CakeRMSNorm)}


def _quiet(convert, model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weight_offset guess
        return convert(model, **kwargs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_swap_marks_the_per_head_norms_only(name):
    per_head = FAMILIES[name][3]
    model = _tiny(name)
    _quiet(swap_rmsnorm, model)
    swapped = _compiled_as(model)
    names = {path.rsplit(".", 1)[-1] for path in swapped}
    assert per_head < names  # the per-head norms and others were swapped
    for path, compiled_as in swapped.items():
        assert compiled_as == ("torch" if path.rsplit(".", 1)[-1] in per_head else "kernel"), path


@pytest.mark.parametrize("convert", [swap_rmsnorm, fuse_residual_rmsnorm])
def test_compiled_head_norms_kernel_keeps_every_norm_on_the_kernel(convert):
    model = _tiny("qwen3")
    _quiet(convert, model, compiled_head_norms="kernel")
    assert set(_compiled_as(model).values()) == {"kernel"}
    default = _tiny("qwen3")
    _quiet(convert, default)
    assert default.model.layers[0].self_attn.q_norm.compiled_as == "torch"


@pytest.mark.parametrize("convert", [swap_rmsnorm, fuse_residual_rmsnorm])
@pytest.mark.parametrize("bad", ["inductor", None, True, ["torch"]])
def test_compiled_head_norms_is_checked_before_anything_changes(convert, bad):
    model = _tiny("qwen3")
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match="compiled_head_norms must be one of 'kernel', 'torch'"):
        convert(model, compiled_head_norms=bad)
    assert repr(model) == repr(before) and not _compiled_as(model)


class _Attention(nn.Module):
    """A hand-written attention module (torchtitan's layout): ``head_dim`` and torch.nn.RMSNorm q / k
    norms; and a norm of head_dim's size in a module without one."""

    def __init__(self):
        super().__init__()
        self.head_dim = HEAD_DIM
        self.q_norm = nn.RMSNorm(HEAD_DIM)
        self.k_norm = nn.RMSNorm(HEAD_DIM)
        self.out_norm = nn.RMSNorm(HEADS * HEAD_DIM)


def test_torch_rmsnorm_head_norms_of_a_hand_written_attention():
    model = nn.ModuleDict({"attention": _Attention(), "block": nn.Sequential(nn.RMSNorm(HEAD_DIM))})
    swap_rmsnorm(model)
    assert _compiled_as(model) == {
        "attention.q_norm": "torch",
        "attention.k_norm": "torch",
        "attention.out_norm": "kernel",
        "block.0": "kernel",
    }


def _graph_norm_calls(graph_module) -> tuple[int, int]:
    """(residual-mode, plain) ``cake_cute::rmsnorm_fwd`` calls in a dynamo graph."""
    calls = [n for n in graph_module.graph.nodes if "cake_cute.rmsnorm_fwd" in str(n.target)]
    with_residual = sum(1 for n in calls if (n.args[3] if len(n.args) > 3 else n.kwargs.get("residual")))
    return with_residual, len(calls) - with_residual


def _step(model):
    """(loss, {name: grad}) of one forward + backward on fixed tokens."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled_head_norms", ["torch", "kernel"])
def test_a_compiled_fused_qwen3_leaves_its_head_norms_to_torch(compiled_head_norms):
    """torch.compile(fullgraph=True) of a fused Qwen3: the residual adds and the layer norms in the
    residual-mode op, the first input norm in the plain op, the q / k norms as torch math by default
    (in the plain op with "kernel"); the step agrees with the eager one (aot_eager: the loss bitwise)."""
    model = _tiny("qwen3")
    _quiet(fuse_residual_rmsnorm, model, compiled_head_norms=compiled_head_norms)
    layers = len(model.model.layers)
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    eager_loss, eager_grads = _step(model)
    torch._dynamo.reset()
    loss, grads = _step(torch.compile(model, fullgraph=True, backend=recording))
    (graph,) = graphs
    head_norm_calls = 2 * layers if compiled_head_norms == "kernel" else 0
    assert _graph_norm_calls(graph) == (2 * layers, 1 + head_norm_calls)
    assert torch.equal(loss, eager_loss)
    assert grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
