"""CakeRMSNorm as a drop-in for the module it replaces, without a GPU: torch.nn.RMSNorm's signature,
eps=None, [H] inputs and autocast policy; the casts of the Hugging Face norms ``swap_rmsnorm``
replaces (Llama, Gemma, T5, weightless L2 norms) and the ones it refuses; non-tensor arguments; and
fake kernels whose output strides are the real kernels' for every layout the ops accept."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.library import opcheck
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm, Llama4TextRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

try:  # newer transformers releases only
    from transformers.models.dory.modeling_dory import DoryL2Norm
except ImportError:
    DoryL2Norm = None

from cake_cute import CakeRMSNorm, casts, forward_names, swap_rmsnorm

H = 64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_EPS = torch.finfo(torch.float32).eps


def _pair(dtype, eps=None, hidden=H, seed=0):
    """A torch.nn.RMSNorm with a random weight and a CakeRMSNorm holding the same values."""
    torch.manual_seed(seed)
    ref = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
    nn.init.normal_(ref.weight, 1.0, 0.5)
    cake = CakeRMSNorm(hidden, eps=eps, dtype=dtype)
    cake.load_state_dict(ref.state_dict())
    return ref, cake


# --- torch.nn.RMSNorm semantics ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(H,), (5, H), (2, 3, H), (3, 37)], ids=["1d", "2d", "3d", "odd_h"])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_forward_is_bitwise_torch_rmsnorm(dtype, shape, eps):
    ref, cake = _pair(dtype, eps, hidden=shape[-1])
    x = torch.randn(shape).to(dtype)
    y = cake(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_eps_none_is_the_fp32_compute_epsilon(dtype):
    """Small-magnitude rows, where eps decides the result: torch uses FP32's epsilon for every dtype."""
    ref, cake = _pair(dtype, eps=None)
    x = (torch.randn(8, H) * 1e-3).to(dtype)
    assert torch.equal(cake(x), ref(x))
    own_dtype_eps = CakeRMSNorm(H, eps=torch.finfo(dtype).eps, dtype=dtype)
    own_dtype_eps.load_state_dict(ref.state_dict())
    if dtype != torch.float32:  # the input dtype's epsilon would move these rows a long way
        assert not torch.allclose(own_dtype_eps(x).float(), ref(x).float(), rtol=0.05)


def test_gradients_match_torch_rmsnorm_for_a_1d_input():
    ref, cake = _pair(torch.float32)
    x = torch.randn(H, requires_grad=True)
    g = torch.randn(H)
    want = torch.autograd.grad(ref(x), [x, ref.weight], g)
    got = torch.autograd.grad(cake(x), [x, cake.weight], g)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _other_input_name(name: str) -> str:
    return "input" if name == "x" else "x"


def test_input_by_keyword_and_residual_keyword_only():
    """The input by the running torch's name (``x`` in torch 2.13, ``input`` before) or by position; the
    other name is the TypeError torch.nn.RMSNorm raises for it."""
    ref, cake = _pair(torch.float32)
    x, r = torch.randn(2, 3, H), torch.randn(2, 3, H)
    name = forward_names.INPUT_NAME
    if torch.__version__ >= (2, 13):
        assert name == "x"
    assert torch.equal(cake(**{name: x}), cake(x))
    assert torch.equal(cake(**{name: x}), ref(**{name: x}))
    y, h = cake(**{name: x}, residual=r)
    assert torch.equal(h, x + r) and torch.equal(y, cake(x + r))
    with pytest.raises(TypeError, match="positional"):
        cake(x, r)
    other = _other_input_name(name)
    with pytest.raises(TypeError) as torch_error:
        ref(**{other: x})
    with pytest.raises(TypeError) as cake_error:
        cake(**{other: x})
    assert str(cake_error.value) == str(torch_error.value).replace("RMSNorm.", "CakeRMSNorm.", 1)


def test_forward_signature_is_torch_rmsnorms():
    """The same parameter names and kinds as the running torch's torch.nn.RMSNorm.forward, plus the
    keyword-only residual."""
    torch_params = list(inspect.signature(nn.RMSNorm.forward).parameters.values())
    cake_params = list(inspect.signature(CakeRMSNorm.forward).parameters.values())
    assert [(p.name, p.kind) for p in cake_params[:2]] == [(p.name, p.kind) for p in torch_params]
    assert (cake_params[2].name, cake_params[2].kind) == ("residual", inspect.Parameter.KEYWORD_ONLY)


class _RMSNormBefore213(nn.Module):
    """torch.nn.RMSNorm.forward's signature up to torch 2.12."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input


def test_input_name_before_torch_213():
    """The name derived from a forward written as torch up to 2.12 wrote it, and a forward renamed to
    it: called by that name, by position, and refused under the other name."""
    assert forward_names.forward_input_name(_RMSNormBefore213.forward) == "input"
    assert forward_names.forward_input_name(nn.RMSNorm.forward) == forward_names.INPUT_NAME

    class Norm(CakeRMSNorm):
        forward = forward_names.with_input_named(CakeRMSNorm.forward, "input")

    norm, x, r = Norm(H), torch.randn(2, H), torch.randn(2, H)
    assert list(inspect.signature(Norm.forward).parameters) == ["self", "input", "residual"]
    assert torch.equal(norm(input=x), norm(x))
    y, h = norm(input=x, residual=r)
    assert torch.equal(h, x + r) and torch.equal(y, norm(x + r))
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        norm(x=x)


def test_renaming_refuses_a_name_taken_by_a_local():
    with pytest.raises(ValueError, match="residual"):
        forward_names.with_input_named(CakeRMSNorm.forward, "residual")
    unchanged = forward_names.with_input_named(CakeRMSNorm.forward, forward_names.INPUT_NAME)
    assert unchanged is CakeRMSNorm.forward


def test_1d_input_with_residual():
    _, cake = _pair(torch.bfloat16)
    x, r = torch.randn(H).bfloat16(), torch.randn(H).bfloat16()
    y, h = cake(x, residual=r)
    assert y.shape == h.shape == (H,)
    assert torch.equal(h, x + r) and torch.equal(y, cake(x + r))


@pytest.mark.parametrize("bad", [None, [1.0] * H, "x", 3.0])
def test_non_tensor_arguments_name_the_argument(bad):
    cake = CakeRMSNorm(H)
    expected = f"{forward_names.INPUT_NAME} must be a torch.Tensor, got {type(bad).__name__}"
    with pytest.raises(TypeError, match=expected):
        cake(bad)
    bad_residual = "r" if bad is None else bad  # None means no residual
    expected = f"residual must be a torch.Tensor, got {type(bad_residual).__name__}"
    with pytest.raises(TypeError, match=expected):
        cake(torch.randn(2, H), residual=bad_residual)


@pytest.mark.parametrize("bad", ["model", None, 3])
def test_swap_rmsnorm_names_a_non_module_model(bad):
    with pytest.raises(TypeError, match=f"model must be a torch.nn.Module, got {type(bad).__name__}"):
        swap_rmsnorm(bad)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_cpu_autocast_gives_torch_rmsnorm_dtype_and_bits(x_dtype, w_dtype):
    """On CPU rms_norm is in no autocast cast list: torch computes in the input's dtype."""
    ref, cake = _pair(w_dtype)
    x = torch.randn(4, H).to(x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "cannot dispatch to fused implementation"
        want, got = ref(x), cake(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_cuda_autocast_policy_computes_in_fp32(monkeypatch, residual, w_dtype):
    """torch's CUDA autocast lists rms_norm among its FP32 ops: inputs and weight cast to FP32, an FP32
    output. The same policy on CPU tensors (CUDA's autocast state patched in)."""
    monkeypatch.setattr(casts, "_cuda_autocast", lambda x: True)
    ref, cake = _pair(w_dtype)
    x, r = torch.randn(2, 3, H).bfloat16(), torch.randn(2, 3, H).bfloat16()
    out = cake(x, residual=r) if residual else cake(x)
    y = out[0] if residual else out
    h = x + r if residual else x
    assert y.dtype == torch.float32
    assert torch.equal(y, nn.functional.rms_norm(h.float(), (H,), ref.weight.float()))
    if residual:
        assert torch.equal(out[1], h)


# --- swapped Hugging Face norms keep their casts -----------------------------------------------------


def _hf_norm(cls, w_dtype, seed=0):
    torch.manual_seed(seed)
    if cls in (Llama4TextL2Norm, DoryL2Norm):
        return cls(1e-5)
    norm = cls(H, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(0.0 if cls is GemmaRMSNorm else 1.0, 0.5)
    return norm.to(w_dtype)


# (class, policy, whether a bf16/fp16 weight with the same input dtype rounds twice in the original:
# there the kernel rounds once and the last bit may differ)
HF_NORMS = [
    (LlamaRMSNorm, "round_then_scale", True),
    (Llama4TextRMSNorm, "round_then_scale", True),
    (Olmo2RMSNorm, "scale_then_round", False),
    (GemmaRMSNorm, "scale_then_round", False),
    (T5LayerNorm, "t5", True),
    (Llama4TextL2Norm, "scale_then_round", False),
]


@pytest.mark.parametrize("cls, policy, rounds_twice", HF_NORMS, ids=[c[0].__name__ for c in HF_NORMS])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_swapped_hf_norm_keeps_output_dtype_and_casts(cls, policy, rounds_twice, w_dtype, x_dtype):
    model = nn.Sequential(_hf_norm(cls, w_dtype))
    x = torch.randn(3, 5, H).to(x_dtype)
    want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weight_offset guess
        assert swap_rmsnorm(model) == 1
    assert isinstance(model[0], CakeRMSNorm) and model[0].cast_policy == policy
    got = model(x)
    assert got.dtype == want.dtype
    if rounds_twice and w_dtype == x_dtype != torch.float32:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        assert not torch.equal(got, want)  # the documented last-bit difference is real
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("cls", [LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm])
def test_hf_trainer_bf16_autocast_fp32_weights(cls):
    """HF Trainer bf16: fp32 master weights, forward under autocast; a bf16 activation and an fp32
    one (the residual stream). Output dtypes, values and gradients as the original module's."""
    original = _hf_norm(cls, torch.float32)
    swapped = nn.Sequential(copy.deepcopy(original))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swap_rmsnorm(swapped)
    for x_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 7, H).to(x_dtype)
        g = torch.randn(2, 7, H)
        results = []
        for norm in (original, swapped[0]):
            xl = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = norm(xl)
            grads = torch.autograd.grad(y, [xl, norm.weight], g.to(y.dtype))
            results.append((y, *grads))
        (want_y, want_dx, want_dw), (y, dx, dw) = results
        assert y.dtype == want_y.dtype and dx.dtype == want_dx.dtype and dw.dtype == torch.float32
        assert torch.equal(y, want_y)
        torch.testing.assert_close(dx, want_dx, rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(dw, want_dw, rtol=1e-4, atol=1e-3)


def test_weightless_l2_norm_is_swapped_for_any_hidden_size():
    model = nn.Sequential(Llama4TextL2Norm(1e-5))
    assert swap_rmsnorm(model) == 1
    norm = model[0]
    assert norm.weight is None and norm.normalized_shape is None and norm.eps == 1e-5
    assert dict(model.state_dict()) == {}
    for hidden in (16, 40):
        x = torch.randn(3, hidden).bfloat16()
        assert torch.equal(norm(x), Llama4TextL2Norm(1e-5)(x))


def test_a_swapped_norm_keeps_its_policy_through_save_and_load(tmp_path):
    model = nn.Sequential(_hf_norm(T5LayerNorm, torch.float32))
    swap_rmsnorm(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert loaded[0].cast_policy == "t5" and "cast_policy=t5" in repr(loaded[0])
    x = torch.randn(2, H).bfloat16()
    assert torch.equal(loaded(x), model(x))


@pytest.mark.skipif(DoryL2Norm is None, reason="this transformers has no DoryL2Norm")
def test_norms_that_are_not_rmsnorms_are_refused_with_the_reason():
    class GroupedRMSNorm(GemmaRMSNorm):
        def __init__(self, dim):
            super().__init__(dim)
            self.group_size = 8

    model = nn.Sequential(
        DoryL2Norm(1e-6), GroupedRMSNorm(H), nn.LayerNorm(H), nn.LayerNorm(H, elementwise_affine=False)
    )
    with pytest.warns(UserWarning, match="left these norms alone") as record:
        assert swap_rmsnorm(model, weight_offset=1.0) == 0
    message = str(record[0].message)
    assert "DoryL2Norm: it divides by the root of the sum of squares" in message
    assert "GroupedRMSNorm: it normalizes groups of group_size channels" in message


def test_a_tiny_t5_model_swaps_every_layer_norm_and_computes_the_same():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=32, d_model=H, d_kv=16, d_ff=96, num_layers=2, num_heads=4)
    model = T5EncoderModel(config).eval()
    ids = torch.randint(0, 32, (2, 9))
    want = model(input_ids=ids).last_hidden_state
    norms = sum(isinstance(m, T5LayerNorm) for m in model.modules())
    assert swap_rmsnorm(model) == norms == 5
    assert torch.equal(model(input_ids=ids).last_hidden_state, want)


# --- fake kernels describe the real outputs' strides ---------------------------------------------------


def _layouts(dtype, device="cpu"):
    """Every kind of layout the ops accept, [..., H]."""
    torch.manual_seed(0)

    def r(*shape):
        return torch.randn(*shape).to(device, dtype)

    return {
        "contiguous": r(3, H),
        "transposed_4d": r(2, 16, 4, H).transpose(1, 2),
        "sliced_rows": r(8, H + 16)[:, :H],
        "strided_rows": r(16, H)[::2],
        "expanded": r(1, H).expand(5, H),
        "3d": r(2, 3, H),
        "last_dim_strided": r(H, 6).t(),
    }


LAYOUT_NAMES = list(_layouts(torch.float32))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_opcheck_over_layouts(dtype, layout, device):
    x = _layouts(dtype, device)[layout]
    w = torch.randn(H).to(device, dtype)
    residual = torch.randn(x.shape).to(device, dtype)
    for res in (None, residual):
        opcheck(torch.ops.cake_cute.rmsnorm_fwd, (x, w, 1e-6, res, 0.0))
        _, rstd, h_new = torch.ops.cake_cute.rmsnorm_fwd(x, w, 1e-6, res, 0.0)
        saved = x if res is None else h_new
        # g in the same layout as x (an expanded g included), g_residual too
        opcheck(torch.ops.cake_cute.rmsnorm_bwd, (x, saved, w, rstd, None if res is None else x, 0.0))
        opcheck(torch.ops.cake_cute.rmsnorm_fp8_fwd, (x, w, 1e-6, res, "mxfp8", True, 0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("layout", [*LAYOUT_NAMES, "1d"])
def test_compiled_module_over_layouts_matches_eager(layout, residual, device):
    torch._dynamo.reset()
    x = torch.randn(H, device=device) if layout == "1d" else _layouts(torch.float32, device)[layout]
    r = torch.randn(x.shape, device=device)
    cake = CakeRMSNorm(H, device=device)
    nn.init.normal_(cake.weight)
    x = x.clone().requires_grad_() if layout != "expanded" else x.detach().requires_grad_()

    def step(norm, x):
        out = norm(x, residual=r) if residual else norm(x)
        y = out[0] if residual else out
        loss = (y * y).sum() + (out[1].sum() if residual else 0)
        return (out, *torch.autograd.grad(loss, [x, norm.weight]))

    compiled = torch.compile(cake, fullgraph=True, backend="aot_eager")
    got = step(compiled, x)
    want = step(cake, x)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)


def test_the_minimal_failing_case_compiles_with_inductor():
    torch._dynamo.reset()
    x = torch.randn(2, 16, 4, H).transpose(1, 2)
    cake = CakeRMSNorm(H)
    assert torch.equal(torch.compile(cake, fullgraph=True)(x), cake(x))


# --- on the GPU: torch's CUDA autocast policy and the HF casts with the CUDA kernels --------------------


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_cuda_autocast_output_dtype_is_torch_rmsnorms(w_dtype):
    ref, cake = _pair(w_dtype)
    ref, cake = ref.cuda(), cake.cuda()
    x = torch.randn(4, 7, H, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = ref(x), cake(x)
        want_residual = ref(x + x)
        got_residual, h = cake(x, residual=x)
    # FP32 where this torch's CUDA autocast lists rms_norm (2.13), the input's dtype where not (2.11).
    assert want.dtype == got.dtype == got_residual.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_residual, want_residual, rtol=1e-5, atol=1e-5)
    assert torch.equal(h, x + x)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm])
def test_cuda_hf_trainer_bf16_autocast_fp32_weights(cls):
    original = _hf_norm(cls, torch.float32).cuda()
    swapped = nn.Sequential(copy.deepcopy(original))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swap_rmsnorm(swapped)
    for x_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4, 7, H, device="cuda", dtype=x_dtype)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want, got = original(x), swapped(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)
