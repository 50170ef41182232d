"""CakeRMSNorm, swap_rmsnorm and the torch.library custom ops, without a GPU.

On CPU tensors both autograd paths run the custom ops, whose CPU kernels (``cake_cute.cpu``) follow the
SPEC's math. The ``kernels`` fixture also switches on the eager fast path that CUDA tensors take (direct
launches, no dispatcher), with the same CPU math standing in for the launches, and counts each path's
calls, so the tests see which path ran."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import cake_cute
from cake_cute import (
    CakeRMSNorm,
    CakeRMSNormFunction,
    autograd,
    cake_rmsnorm,
    casts,
    cpu,
    dispatch,
    library_ops,
    swap_rmsnorm,
)
from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance
from cake_cute.routing import OP, PYTHON

EPS = 1e-6

# The CPU math itself, kept before any test patches the module attributes.
_CPU_FORWARD, _CPU_BACKWARD = cpu.forward, cpu.backward


def _direct_forward(call):
    """``dispatch.python_forward``'s results (rstd ``[T]``) from the CPU math."""
    y, rstd, h_new = _CPU_FORWARD(*call[:5])
    return (y, rstd.reshape(-1)) if call.residual is None else (y, rstd.reshape(-1), h_new)


def _direct_backward(g, h, w, rstd, g_residual, weight_offset, memory_efficient):
    """``launch.backward_from_saved``'s results from the CPU math."""
    backward = cpu.backward_from_output if memory_efficient else _CPU_BACKWARD
    return backward(g, h, w, rstd, g_residual, weight_offset)


@pytest.fixture
def kernels(monkeypatch):
    """Counts of kernel calls keyed "eager.fwd", "eager.bwd" (the direct path) and "op.fwd", "op.bwd"
    (the custom ops' CPU kernels), with the direct path switched on for CPU tensors."""
    calls = collections.Counter()

    def counted(label, fn):
        def wrapper(*args, **kwargs):
            calls[label] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(cpu, "forward", counted("op.fwd", _CPU_FORWARD))
    monkeypatch.setattr(cpu, "backward", counted("op.bwd", _CPU_BACKWARD))

    def python_route(x, w):
        return OP if torch.compiler.is_compiling() else PYTHON

    monkeypatch.setattr(autograd, "route", python_route)
    monkeypatch.setattr(casts, "route", python_route)
    monkeypatch.setattr(autograd, "operands_of", lambda x, w: None)  # no device facts on the CPU
    monkeypatch.setattr(
        autograd, "norm_call", lambda *a, **k: cake_cute.calls.norm_call(*a, **{**k, "on_gpu": False})
    )
    monkeypatch.setattr(dispatch, "python_forward", counted("eager.fwd", _direct_forward))
    monkeypatch.setattr(library_ops, "backward_from_saved", counted("eager.bwd", _direct_backward))
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def _problem(residual: bool, shape=(2, 5, 64), dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, g_y, g_h, res = (torch.randn(shape, generator=gen).to(dtype) for _ in range(4))
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(dtype)
    return x, w, (res if residual else None), g_y, (g_h if residual else None)


def _forward_backward(fn, inputs, out_grads, params=()):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, out_grads[: len(outs)])
    return (
        [o.detach() for o in outs]
        + [leaf.grad for leaf in leaves if leaf is not None]
        + [p.grad for p in params]
    )


def _assert_bitwise(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a, e)


# --- CakeRMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [64, (64,), [64], torch.Size([64])])
def test_module_accepts_an_int_or_1_tuple(shape):
    norm = CakeRMSNorm(shape)
    assert norm.normalized_shape == (64,)
    assert isinstance(norm.weight, nn.Parameter) and norm.weight.shape == (64,)
    assert torch.equal(norm.weight, torch.ones(64))
    assert norm.eps is None and norm.elementwise_affine and norm.weight_offset == 0.0


@pytest.mark.parametrize("shape", [(4, 64), (), 0, -3, 2.5, "64", True, (64.0,)])
def test_module_rejects_other_normalized_shapes(shape):
    with pytest.raises(ValueError, match="normalized_shape"):
        CakeRMSNorm(shape)


def test_module_validates_eps_and_weight_offset():
    assert CakeRMSNorm(8, eps=1e-5).eps == 1e-5
    with pytest.raises(ValueError, match="eps"):
        CakeRMSNorm(8, eps=-1.0)
    with pytest.raises(TypeError, match="eps"):
        CakeRMSNorm(8, eps="1e-6")
    with pytest.raises(TypeError, match="weight_offset"):
        CakeRMSNorm(8, weight_offset="1")


def test_module_device_dtype_and_offset_init():
    norm = CakeRMSNorm(16, device="meta", dtype=torch.bfloat16)
    assert norm.weight.device.type == "meta" and norm.weight.dtype == torch.bfloat16
    gemma = CakeRMSNorm(16, weight_offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(16)), "scale = weight + 1 must start at 1"
    gemma.weight.data.fill_(3.0)
    gemma.reset_parameters()
    assert torch.equal(gemma.weight, torch.zeros(16))


def test_module_without_affine_has_a_ones_buffer():
    norm = CakeRMSNorm(16, elementwise_affine=False)
    assert not isinstance(norm.weight, nn.Parameter) and not norm.weight.requires_grad
    assert torch.equal(norm.weight, torch.ones(16))
    assert list(norm.parameters()) == []
    assert norm.state_dict() == {}  # like torch.nn.RMSNorm(elementwise_affine=False)


def test_module_state_dict_is_torch_compatible():
    torch_norm = nn.RMSNorm(32)
    with torch.no_grad():
        torch_norm.weight.normal_()
    norm = CakeRMSNorm(32)
    norm.load_state_dict(torch_norm.state_dict())
    assert torch.equal(norm.weight, torch_norm.weight)


def test_module_extra_repr():
    assert repr(CakeRMSNorm(64, eps=1e-5, weight_offset=1.0)) == (
        "CakeRMSNorm((64,), eps=1e-05, elementwise_affine=True, weight_offset=1.0)"
    )


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_module_forward_matches_torch_rmsnorm(kernels, weight_offset):
    """eps=None resolves to the input dtype's epsilon, as in torch.nn.RMSNorm; the offset adds to w."""
    x = torch.randn(3, 7, 32)
    norm = CakeRMSNorm(32, weight_offset=weight_offset)
    torch_norm = nn.RMSNorm(32)
    with torch.no_grad():
        torch_norm.weight.normal_()
        norm.weight.copy_(torch_norm.weight - weight_offset)
    torch.testing.assert_close(norm(x), torch_norm(x))
    y, h_new = norm(x, residual=x)
    torch.testing.assert_close(h_new, 2 * x)
    torch.testing.assert_close(y, torch_norm(2 * x))
    assert kernels["eager.fwd"] == 2 and kernels["op.fwd"] == 0


def test_module_casts_a_low_precision_weight_for_fp32_input(kernels):
    norm = CakeRMSNorm(32, dtype=torch.bfloat16)
    x = torch.randn(4, 32, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert norm.weight.grad.dtype == torch.bfloat16


# --- swap_rmsnorm --------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    """Hugging Face's Llama RMSNorm (weight * normalized, eps in ``variance_epsilon``)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class GemmaRMSNorm(nn.Module):
    """Hugging Face's Gemma RMSNorm: scale (1 + weight), zeros init, eps in ``eps``."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Gemma3nRMSNorm(GemmaRMSNorm):
    """Gemma3n's RMSNorm scales by plain weight despite its name."""

    def forward(self, x):
        return (self._norm(x.float()) * self.weight.float()).type_as(x)


class Qwen3NextRMSNorm(GemmaRMSNorm):
    """Qwen3-Next's RMSNorm scales by (1 + weight) without "Gemma" in its name."""

    def forward(self, hidden_states):
        hidden_states = self._norm(hidden_states.float())
        return (hidden_states * (1 + self.weight.float())).type_as(hidden_states)


class BiasedRMSNorm(LlamaRMSNorm):
    """Not a plain RMSNorm: a bias parameter."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size))


class MambaRMSNormGated(LlamaRMSNorm):
    """Not an RMSNorm by name (gated variants end in "Gated")."""


class ToyModel(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.torch_norm = nn.RMSNorm(dim, eps=1e-5)
        self.torch_norm_default_eps = nn.RMSNorm((dim,))
        self.torch_norm_plain = nn.RMSNorm(dim, elementwise_affine=False)
        self.torch_norm_2d = nn.RMSNorm((4, dim))
        self.llama = LlamaRMSNorm(dim, eps=1e-5)
        self.gemma = GemmaRMSNorm(dim)
        self.gemma3n = Gemma3nRMSNorm(dim)
        self.qwen3_next = Qwen3NextRMSNorm(dim)
        self.biased = BiasedRMSNorm(dim)
        self.gated = MambaRMSNormGated(dim)
        self.layer_norm = nn.LayerNorm(dim)
        self.blocks = nn.Sequential(nn.Linear(dim, dim), LlamaRMSNorm(dim))


def test_swap_replaces_every_rmsnorm_and_keeps_parameters():
    model = ToyModel().train()
    model.gemma.eval()
    before = dict(model.named_modules())
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert swap_rmsnorm(model) == 8
    # Every offset read from a forward the package recognizes: no guess to warn about.
    assert not [w for w in caught if "guessed" in str(w.message)]
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, CakeRMSNorm)}
    assert set(swapped) == {
        "torch_norm",
        "torch_norm_default_eps",
        "torch_norm_plain",
        "llama",
        "gemma",
        "gemma3n",
        "qwen3_next",
        "blocks.1",
    }
    for name, new in swapped.items():
        old = before[name]
        if name != "torch_norm_plain":
            assert new.weight is old.weight, name  # same Parameter: optimizer state and ties stay valid
        assert new.training == old.training, name
    assert model.torch_norm.eps == 1e-5 and model.torch_norm_default_eps.eps is None
    assert model.llama.eps == 1e-5 and model.gemma.eps == 1e-6
    assert (
        not model.torch_norm_plain.elementwise_affine and model.torch_norm_plain.weight.device.type == "cpu"
    )
    offsets = {name: m.weight_offset for name, m in swapped.items()}
    assert offsets == dict.fromkeys(swapped, 0.0) | {"gemma": 1.0, "qwen3_next": 1.0}
    for name in ("torch_norm_2d", "biased", "gated", "layer_norm"):
        assert type(model.get_submodule(name)) is type(before[name]), name
    assert {id(p) for p in model.parameters()} == {
        id(p) for group in opt.param_groups for p in group["params"]
    }
    assert swap_rmsnorm(model) == 0


def test_swap_keeps_device_and_dtype():
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.RMSNorm(8, elementwise_affine=False))
    model.to(device="meta", dtype=torch.bfloat16)
    assert swap_rmsnorm(model) == 2
    assert model[1].weight.device.type == "meta" and model[1].weight.dtype == torch.bfloat16
    assert model[2].weight.device.type == "meta"  # the weightless one follows the model's device


def test_swap_shared_and_tied_modules():
    shared = LlamaRMSNorm(8)
    tied_a, tied_b = nn.RMSNorm(8), nn.RMSNorm(8)
    tied_b.weight = tied_a.weight
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared), "tied_a": tied_a, "tied_b": tied_b})
    assert swap_rmsnorm(model, weight_offset=0.0) == 3
    assert model["a"] is model["b"][0] and isinstance(model["a"], CakeRMSNorm)
    assert model["tied_a"].weight is model["tied_b"].weight


def test_swap_refuses_an_rmsnorm_root():
    with pytest.raises(ValueError, match="itself an RMSNorm"):
        swap_rmsnorm(nn.RMSNorm(8))


def test_swap_falls_back_to_the_class_name_without_source():
    namespace = {"torch": torch, "nn": nn}
    exec(
        "class SomeGemmaRMSNorm(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.weight = nn.Parameter(torch.zeros(8))\n"
        "        self.eps = 1e-6\n"
        "    def forward(self, x):\n"
        "        return x\n",
        namespace,
    )
    model = nn.Sequential(namespace["SomeGemmaRMSNorm"]())
    with pytest.warns(UserWarning, match="SomeGemmaRMSNorm: 1.0"):
        assert swap_rmsnorm(model) == 1
    assert model[0].weight_offset == 1.0


def test_swapped_model_computes_what_the_original_did(kernels):
    torch.manual_seed(0)
    model = nn.Sequential(LlamaRMSNorm(32), nn.RMSNorm(32, eps=1e-5), GemmaRMSNorm(32), Qwen3NextRMSNorm(32))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(4, 9, 32)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each offset read from a recognized forward: nothing guessed
        assert swap_rmsnorm(model) == 4
    torch.testing.assert_close(model(x), expected)


class ShiftedRMSNorm(LlamaRMSNorm):
    """Its scale is the weight plus an attribute: what the forward adds is not read from its source."""

    shift = 0.25

    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        scale = self.weight + self.shift
        return scale * (hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon))


def test_swap_warns_once_where_it_guesses_the_offset():
    """A forward whose scale the package does not recognize: one warning naming the class and the
    guess, pointing at this line; the recognized norms beside it are not named."""
    model = nn.Sequential(ShiftedRMSNorm(8), ShiftedRMSNorm(8), LlamaRMSNorm(8), GemmaRMSNorm(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert swap_rmsnorm(model) == 4
    guesses = [w for w in caught if "guessed" in str(w.message)]
    assert len(guesses) == 1 and guesses[0].filename == __file__
    assert str(guesses[0].message).startswith("swap_rmsnorm guessed weight_offset")
    assert "ShiftedRMSNorm: 0.0" in str(guesses[0].message)
    assert "LlamaRMSNorm" not in str(guesses[0].message) and "GemmaRMSNorm" not in str(guesses[0].message)


def test_swap_weight_offset_override_decides_without_a_warning():
    model = ToyModel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert swap_rmsnorm(model, weight_offset=1.0) == 8
    assert model.gemma3n.weight_offset == 1.0 and model.llama.weight_offset == 1.0
    assert model.torch_norm_plain.weight_offset == 0.0  # a ones buffer has no offset to add to
    with pytest.raises(TypeError, match="weight_offset"):
        swap_rmsnorm(ToyModel(), weight_offset="1")


def test_swap_without_hugging_face_modules_does_not_warn():
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert swap_rmsnorm(model) == 1
    assert model[1].weight_offset == 0.0


def test_module_sequence_parallel_marks_the_weight():
    assert CakeRMSNorm(8, sequence_parallel=True).weight.sequence_parallel is True
    assert not hasattr(CakeRMSNorm(8).weight, "sequence_parallel")


# --- the CPU kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(3, 7, 37), (0, 64), (1, 5)])
def test_cpu_ops_match_the_fp64_reference(dtype, residual, shape):
    gen = torch.Generator().manual_seed(1)
    x, r, g, g_h = (torch.randn(shape, generator=gen).to(dtype) for _ in range(4))
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r if residual else None, 0.5)
    y_ref, rstd_ref, h_ref = forward_reference(x, w, EPS, r if residual else None, 0.5)
    assert y.dtype == dtype and rstd.shape == shape[:-1] and rstd.dtype == torch.float32
    assert rel_error(y, y_ref) <= tolerance(dtype) and rel_error(rstd, rstd_ref) <= 1e-6
    if residual:
        assert torch.equal(h_new, h_ref)
    dx, dw = torch.ops.cake_cute.rmsnorm_bwd(g, h_ref, w, rstd, g_h if residual else None, 0.5)
    dx_ref, dw_ref = backward_reference(g, h_ref, w, rstd, g_h if residual else None, 0.5)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert rel_error(dx, dx_ref) <= tolerance(dtype) and rel_error(dw, dw_ref) <= tolerance(dtype)
    if x.numel() == 0:
        assert torch.equal(dw, torch.zeros_like(dw))


def test_cpu_dw_does_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(2)
    g, h = (torch.randn(4096, 96, generator=gen) for _ in range(2))
    w, rstd = torch.rand(96, generator=gen), torch.rand(4096, generator=gen) + 0.5
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(torch.ops.cake_cute.rmsnorm_bwd(g, h, w, rstd)[1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


def _torch_norm(x, w, r):
    h = x if r is None else x + r
    y = torch.nn.functional.rms_norm(h, (x.shape[-1],), w, EPS)
    return y if r is None else (y, h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("w_dtype", ["same", "fp32"])
@pytest.mark.parametrize("shape", [(2, 5, 64), (129, 7), (1, 4097), (3, 1)])
def test_cpu_ops_compute_bitwise_what_torch_computes(dtype, w_dtype, shape):
    """Plain mode: y, dx and dw are torch's CPU rms_norm and autograd bits (the same FP32 operations)."""
    x, w, _, g_y, _ = _problem(False, shape, dtype)
    w = w if w_dtype == "same" else w.float()
    with _OpRecorder() as recorder:
        ours = _forward_backward(lambda x, w: cake_rmsnorm(x, w, EPS), (x, w), (g_y,))
    assert {"cake_cute::rmsnorm_fwd", "cake_cute::rmsnorm_bwd"} <= set(recorder.names)
    _assert_bitwise(ours, _forward_backward(lambda x, w: _torch_norm(x, w, None), (x, w), (g_y,)))


def test_cpu_residual_mode_rounds_the_gradient_once():
    """Residual mode: y and h_new are torch's bits; dx (of x and of the residual) is torch's FP32
    gradient of the norm plus the residual's gradient, rounded once (torch's autograd rounds the norm's
    gradient first), and dw is torch's."""
    x, w, res, g_y, g_h = _problem(True)
    y, h_new, dx, dw, d_res = _forward_backward(
        lambda x, w, r: cake_rmsnorm(x, w, EPS, r), (x, w, res), (g_y, g_h)
    )
    _assert_bitwise([y, h_new], _forward_backward(_torch_norm, (x, w, res), (g_y, g_h))[:2])
    h32, w_leaf = (x + res).float().requires_grad_(), w.clone().requires_grad_()
    y32 = torch.nn.functional.rms_norm(h32, (x.shape[-1],), w_leaf, EPS)
    d_norm, expected_dw = torch.autograd.grad(y32, (h32, w_leaf), g_y.float())
    expected_dx = (d_norm + g_h.float()).to(x.dtype)
    _assert_bitwise([dx, d_res, dw], [expected_dx, expected_dx, expected_dw])
    assert not torch.equal(dx, d_norm.to(x.dtype) + g_h)  # the two roundings differ somewhere here


@pytest.mark.parametrize("path", ["eager", "op"])
def test_only_h_new_used_passes_its_gradient_through(kernels, path):
    """h_new = x + residual alone in the loss: x and residual get its gradient, w gets none (eager) or
    zeros (the op's autograd materializes the unused y gradient)."""
    x, w, res, _, g_h = _problem(True, dtype=torch.float32)
    x, w, res = (t.clone().requires_grad_() for t in (x, w, res))
    if path == "eager":
        _, h_new = cake_rmsnorm(x, w, EPS, res)
    else:
        _, _, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, res)
    h_new.backward(g_h)
    assert torch.equal(x.grad, g_h) and torch.equal(res.grad, g_h)
    assert w.grad is None or not w.grad.any()


def test_compile_with_inductor_on_cpu_matches_eager():
    """Inductor compiles the code around the opaque op (it needs a C++ compiler)."""
    x, _, res, g_y, g_h = _problem(True, dtype=torch.float32)
    norm = CakeRMSNorm(64, eps=EPS)

    def block(x, r):
        y, h = norm(x * 2, residual=r)
        return torch.relu(y), h

    torch._dynamo.reset()
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="inductor")):
        norm.weight.grad = None
        results.append(_forward_backward(fn, (x, res), (g_y, g_h), params=(norm.weight,)))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


# --- the custom ops ------------------------------------------------------------------------------


def test_op_schemas_express_optional_residuals():
    fwd = str(torch.ops.cake_cute.rmsnorm_fwd.default._schema)
    bwd = str(torch.ops.cake_cute.rmsnorm_bwd.default._schema)
    assert "Tensor? residual" in fwd and "float eps" in fwd and "float weight_offset" in fwd
    # dw comes back in w's dtype: no dtype argument, which DTensor's sharding cache would not key on.
    assert "Tensor? g_residual" in bwd and "ScalarType" not in bwd


@pytest.mark.parametrize("device", ["cuda", "meta"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_fake_implementations_propagate_shapes(device, w_dtype):
    """Fake CUDA tensors need no GPU; meta tensors run the same fake implementations."""
    mode = FakeTensorMode() if device == "cuda" else torch.device("meta")
    with mode:
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16, device=device)
        w = torch.empty(64, dtype=w_dtype, device=device)
        y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS)
        assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device) and y.is_contiguous()
        assert (rstd.shape, rstd.dtype, rstd.device) == ((2, 3), torch.float32, x.device)
        assert h_new.numel() == 0
        y, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, x, 1.0)
        assert (h_new.shape, h_new.dtype, h_new.device) == (x.shape, x.dtype, x.device)
        dx, dw = torch.ops.cake_cute.rmsnorm_bwd(x, x, w, rstd, None, 0.0)
        assert (dx.shape, dx.dtype, dx.device) == (x.shape, x.dtype, x.device)
        assert (dw.shape, dw.dtype, dw.device) == ((64,), w_dtype, x.device)


def test_fake_forward_reports_bad_arguments_while_tracing():
    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="w must have shape"):
            torch.ops.cake_cute.rmsnorm_fwd(x, torch.empty(32, dtype=torch.bfloat16, device="cuda"), EPS)
        with pytest.raises(ValueError, match="residual"):
            short = torch.empty(2, 64, dtype=torch.bfloat16, device="cuda")
            torch.ops.cake_cute.rmsnorm_fwd(x, torch.empty(64, device="cuda"), EPS, short)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_opcheck(kernels, residual):
    x, w, res, g, g_res = _problem(residual)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, res)]
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_fwd.default, (*leaves[:2], EPS, leaves[2], 1.0))
    rstd = torch.rand(x.shape[:-1]) + 0.5
    torch.library.opcheck(torch.ops.cake_cute.rmsnorm_bwd.default, (g, x, w, rstd, g_res, 1.0))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_op_autograd_matches_the_eager_function(kernels, residual):
    def via_op(x, w, r):
        y, _, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r, 0.5)
        return y if r is None else (y, h_new)

    x, w, res, g_y, g_h = _problem(residual)
    eager = _forward_backward(
        lambda x, w, r: cake_rmsnorm(x, w, EPS, r, weight_offset=0.5), (x, w, res), (g_y, g_h)
    )
    _assert_bitwise(_forward_backward(via_op, (x, w, res), (g_y, g_h)), eager)
    assert kernels["op.fwd"] == kernels["op.bwd"] == 1


class _SavedTensors:
    """Records the tensors autograd saves for backward."""

    def __init__(self):
        self.saved = []

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, t):
        self.saved.append(t)
        return t


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_both_paths_save_exactly_h_w_rstd(kernels, path, residual):
    x, w, res, _, _ = _problem(residual)
    x, w = x.requires_grad_(), w.requires_grad_()
    with _SavedTensors() as record:
        if path == "eager":
            out = cake_rmsnorm(x, w, EPS, res)
        else:
            out = torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, res, 0.0)
    h = out[-1] if residual else x
    assert len(record.saved) == 3
    assert record.saved[0] is h or torch.equal(record.saved[0], h)
    # rstd: [T] from the direct launch, x.shape[:-1] at the op boundary.
    rstd_shape = (10,) if path == "eager" else (2, 5)
    assert record.saved[1] is w and record.saved[2].dtype == torch.float32
    assert record.saved[2].shape == rstd_shape


class _OpRecorder(TorchDispatchMode):
    """Names of the operators that reach the dispatcher below autograd."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_eager_calls_bypass_the_custom_ops(kernels, residual):
    x, w, res, g_y, g_h = _problem(residual)
    norm = CakeRMSNorm(64, dtype=torch.bfloat16)
    with _OpRecorder() as recorder:
        _forward_backward(lambda x, w, r: cake_rmsnorm(x, w, EPS, r), (x, w, res), (g_y, g_h))
        _forward_backward(lambda x, w, r: CakeRMSNormFunction.apply(x, w, EPS, r), (x, w, res), (g_y, g_h))
        _forward_backward(lambda x, r: norm(x, residual=r), (x, res), (g_y, g_h))
    assert not [name for name in recorder.names if name.startswith("cake_cute::")]
    assert kernels["eager.fwd"] == kernels["eager.bwd"] == 3
    assert kernels["op.fwd"] == kernels["op.bwd"] == 0

    with _OpRecorder() as recorder:  # the recorder does see the op when it is called
        torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, res)
    assert "cake_cute::rmsnorm_fwd" in recorder.names


def _via_function(x, w, r):
    return cake_rmsnorm(x, w, EPS, r, weight_offset=0.25)


def _via_autograd_function(x, w, r):
    return CakeRMSNormFunction.apply(x, w, EPS, r, True, 0.25)


@pytest.mark.parametrize(
    "entry", [_via_function, _via_autograd_function], ids=["cake_rmsnorm", "Function.apply"]
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_compile_fullgraph_uses_the_ops_and_matches_eager(kernels, entry, residual):
    x, w, res, g_y, g_h = _problem(residual)
    explanation = torch._dynamo.explain(entry)(x, w, res)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    if entry is _via_function:
        assert "torch.ops.cake_cute.rmsnorm_fwd" in explanation.graphs[0].code
    expected = _forward_backward(entry, (x, w, res), (g_y, g_h))
    eager_calls = dict(kernels)
    compiled = torch.compile(entry, fullgraph=True, backend="aot_eager")
    _assert_bitwise(_forward_backward(compiled, (x, w, res), (g_y, g_h)), expected)
    assert kernels["op.fwd"] >= 1 and kernels["op.bwd"] >= 1
    assert (
        kernels["eager.fwd"] == eager_calls["eager.fwd"] and kernels["eager.bwd"] == eager_calls["eager.bwd"]
    )


@pytest.mark.parametrize(
    "entry", [_via_function, _via_autograd_function], ids=["cake_rmsnorm", "Function.apply"]
)
def test_compile_dynamic_rows_traces_once_in_one_graph(entry):
    """With dynamic shapes (eps a symbolic float too) one fullgraph trace serves every T, equal to eager."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(entry, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for rows in (64, 200, 3):
        x, w, _, g_y, _ = _problem(False, shape=(rows, 96))  # no row count equals H (duck sizing)
        expected = _forward_backward(entry, (x, w, None), (g_y,))
        _assert_bitwise(_forward_backward(compiled, (x, w, None), (g_y,)), expected)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled for a new row count: {frames}"


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_compiled_module_matches_eager(kernels, residual):
    x, _, res, g_y, g_h = _problem(residual)
    norm = CakeRMSNorm(64, weight_offset=1.0, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    results = []
    for module in (norm, torch.compile(norm, fullgraph=True, backend="aot_eager", dynamic=True)):
        norm.weight.grad = None
        results.append(
            _forward_backward(
                lambda x, r, m=module: m(x, residual=r), (x, res), (g_y, g_h), params=(norm.weight,)
            )
        )
    _assert_bitwise(results[1], results[0])


def test_exports():
    for name in ("CakeRMSNorm", "swap_rmsnorm"):
        assert name in cake_cute.__all__ and hasattr(cake_cute, name)
