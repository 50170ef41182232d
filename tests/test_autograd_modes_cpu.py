"""Every autograd mode ``F.rms_norm`` supports, through every differentiable entry, against FP64 torch
on the CPU: second-order gradients (eager; compiled graphs refuse double backward by name, as they do
for ``F.rms_norm``), the ``torch.func`` transforms, FP64 inputs and ``[H]`` inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cake_cute
from cake_cute import (
    CakeGatedRMSNorm,
    CakeRMSNorm,
    CakeRMSNormFunction,
    cake_gated_rmsnorm,
    cake_rmsnorm,
    cake_rmsnorm_fp8,
)
from tests._autograd_modes import (
    EPS,
    TRANSFORMS,
    gated_entry_and_reference,
    gated_reference,
    plain_reference,
    second_order_error,
    transform,
    transform_error,
)

FP32_BOUND = 2e-5  # FP32 rounding of a few chained reductions, relative to the FP64 result


def _tensors(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


def _module(hidden, weight, **options):
    norm = CakeRMSNorm(hidden, eps=EPS, dtype=weight.dtype, **options)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


PLAIN_ENTRIES = {
    "cake_rmsnorm": lambda x, w, r=None: cake_rmsnorm(x, w, EPS, residual=r),
    "Function.apply": lambda x, w, r=None: CakeRMSNormFunction.apply(x, w, EPS, r),
    "offset": lambda x, w, r=None: cake_rmsnorm(x, w, EPS, residual=r, weight_offset=1.0),
}


def _reference_of(entry):
    offset = 1.0 if entry == "offset" else 0.0
    return lambda x, w, r=None: plain_reference(x, w, r, offset)


# --- second-order gradients ----------------------------------------------------------------------


@pytest.mark.parametrize("entry", sorted(PLAIN_ENTRIES))
@pytest.mark.parametrize("residual", [False, True])
def test_double_backward_of_the_functions_is_fp64_torch(entry, residual):
    x, w, r = _tensors((3, 5, 16), (16,), (3, 5, 16))
    inputs = [x, w, r] if residual else [x, w]
    error = second_order_error(PLAIN_ENTRIES[entry], _reference_of(entry), inputs)
    assert error < FP32_BOUND, error


@pytest.mark.parametrize("residual", [False, True])
def test_double_backward_of_the_module_is_fp64_torch(residual):
    x, w, r = _tensors((4, 16), (16,), (4, 16), seed=1)

    def module_norm(x, w, r=None):
        # The weight as an input, so its second-order gradient is compared too.
        return torch.func.functional_call(_module(16, w), {"weight": w}, (x,), {"residual": r})

    inputs = [x, w, r] if residual else [x, w]
    assert second_order_error(module_norm, plain_reference, inputs) < FP32_BOUND


def test_double_backward_in_bf16_is_within_its_rounding():
    x, w = _tensors((8, 64), (64,), dtype=torch.bfloat16, seed=2)
    assert second_order_error(PLAIN_ENTRIES["cake_rmsnorm"], plain_reference, [x, w]) < 5e-2


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate,group_size", [(True, None), (False, None), (False, 4), (True, 8)])
def test_double_backward_of_the_gated_norm_is_fp64_torch(norm_before_gate, group_size, activation):
    x, z, w = _tensors((6, 16), (6, 16), (16,), seed=3)
    gated, reference = gated_entry_and_reference(
        group_size=group_size, norm_before_gate=norm_before_gate, activation=activation
    )

    assert second_order_error(gated, reference, [x, z, w]) < FP32_BOUND


def test_double_backward_through_the_fp8_forward_y():
    x, w = _tensors((4, 64), (64,), seed=4)

    def fp8_y(x, w):
        return cake_rmsnorm_fp8(x, w, EPS, emit_y=True).y

    assert second_order_error(fp8_y, plain_reference, [x, w]) < FP32_BOUND


def test_double_backward_of_the_memory_efficient_mode_is_refused_by_name():
    x, w = (t.requires_grad_() for t in _tensors((4, 16), (16,), seed=5))
    y = cake_rmsnorm(x, w, EPS, memory_efficient=True)
    with pytest.raises(RuntimeError, match="double backward.*memory_efficient=True"):
        torch.autograd.grad((y * y).sum(), (x, w), create_graph=True)
    # Its first-order gradients are unaffected.
    assert all(g is not None for g in torch.autograd.grad((y * y).sum(), (x, w)))


def test_first_order_gradients_under_create_graph_without_a_graph_to_record_use_the_kernels_formula():
    """create_graph=True with nothing that requires grad beyond the inputs' first order: the values
    are the ordinary backward's."""
    x, w = (t.requires_grad_() for t in _tensors((4, 16), (16,), seed=6))
    y = cake_rmsnorm(x, w, EPS)
    plain = torch.autograd.grad(y.sum() * 2, (x, w), retain_graph=True)
    recorded = torch.autograd.grad(y.sum() * 2, (x, w), create_graph=True)
    for a, b in zip(plain, recorded):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_double_backward_is_refused_by_name_as_for_torch():
    x, w = (t.requires_grad_() for t in _tensors((4, 16), (16,), seed=7))
    torch._dynamo.reset()
    for fn in (lambda x, w: F.rms_norm(x, (16,), w, EPS), lambda x, w: cake_rmsnorm(x, w, EPS)):
        compiled = torch.compile(fn, fullgraph=True)
        y = compiled(x, w)
        first = torch.autograd.grad((y * y).sum(), (x, w), create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(sum(g.pow(2).sum() for g in first), (x, w))
    torch._dynamo.reset()


# --- torch.func ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("entry", sorted(PLAIN_ENTRIES))
def test_torch_func_transforms_of_the_functions(name, entry):
    x, w = _tensors((3, 8), (8,), seed=8)
    assert transform_error(name, PLAIN_ENTRIES[entry], _reference_of(entry), [x, w]) < FP32_BOUND


@pytest.mark.parametrize("name", TRANSFORMS)
def test_torch_func_transforms_in_residual_mode(name):
    x, w, r = _tensors((3, 8), (8,), (3, 8), seed=9)
    assert transform_error(name, PLAIN_ENTRIES["cake_rmsnorm"], plain_reference, [x, w, r]) < FP32_BOUND


@pytest.mark.parametrize("name", TRANSFORMS)
def test_torch_func_transforms_of_the_module(name):
    x, w = _tensors((3, 8), (8,), seed=10)

    def module_norm(x, w):
        return torch.func.functional_call(_module(8, w), {"weight": w}, (x,))

    assert transform_error(name, module_norm, plain_reference, [x, w]) < FP32_BOUND


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("norm_before_gate,group_size", [(True, None), (False, 4)])
def test_torch_func_transforms_of_the_gated_norm(name, norm_before_gate, group_size, activation):
    x, z, w = _tensors((3, 8), (3, 8), (8,), seed=11)
    gated, reference = gated_entry_and_reference(
        group_size=group_size, norm_before_gate=norm_before_gate, activation=activation
    )

    assert transform_error(name, gated, reference, [x, z, w]) < FP32_BOUND


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("name", ["grad", "vmap"])
def test_torch_func_transforms_of_the_gated_module(name, activation):
    x, z, w = _tensors((3, 8), (3, 8), (8,), seed=12)
    norm = CakeGatedRMSNorm(8, EPS, activation=activation)

    def module_norm(x, z, w):
        return torch.func.functional_call(norm, {"weight": w}, (x, z))

    def reference(x, z, w):
        return gated_reference(x, z, w, activation=activation)

    assert transform_error(name, module_norm, reference, [x, z, w]) < FP32_BOUND


def test_the_fp8_forward_refuses_torch_func_by_name():
    x, w = _tensors((3, 64), (64,), seed=13)
    with pytest.raises(RuntimeError, match="cake_rmsnorm_fp8 does not support torch.func"):
        transform("vmap", lambda x, w: cake_rmsnorm_fp8(x, w, EPS, emit_y=True).y, [x, w])


# --- FP64 and [H] ----------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True])
def test_fp64_inputs_are_computed_in_fp64(residual):
    x, w, r = _tensors((3, 5, 16), (16,), (3, 5, 16), dtype=torch.float64, seed=14)
    r = r if residual else None
    y = cake_rmsnorm(x, w, EPS, residual=r)
    expected = plain_reference(x, w, r)
    for got, want in zip(y if residual else (y,), expected if residual else (expected,)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    inputs = tuple(t.requires_grad_() for t in ((x, w, r) if residual else (x, w)))

    def summed(*a):
        out = cake_rmsnorm(a[0], a[1], EPS, residual=a[2] if residual else None)
        return out[0] + out[1] if residual else out

    assert torch.autograd.gradcheck(summed, inputs)
    assert torch.autograd.gradgradcheck(summed, inputs)


def test_fp64_modules_and_gated_norms_run():
    x, z = _tensors((4, 16), (4, 16), dtype=torch.float64, seed=15)
    norm = CakeRMSNorm(16, eps=EPS, dtype=torch.float64)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, EPS), rtol=1e-14, atol=1e-14)
    # The gated module follows the Hugging Face gated classes, which compute in FP32 for an FP64 model;
    # the functional entry computes in FP64.
    gated = CakeGatedRMSNorm(16, EPS, dtype=torch.float64)
    y = gated(x, z)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, gated_reference(x, z, gated.weight), rtol=1e-6, atol=1e-6)
    y64 = cake_gated_rmsnorm(x, z, gated.weight, EPS)
    torch.testing.assert_close(y64, gated_reference(x, z, gated.weight), rtol=1e-14, atol=1e-14)


def test_fp64_stays_refused_where_only_kernels_run():
    x, w = _tensors((4, 64), (64,), dtype=torch.float64, seed=16)
    with pytest.raises(TypeError, match="x must have dtype bfloat16, float16, float32; got float64"):
        cake_rmsnorm_fp8(x, w, EPS)


def test_a_swapped_fp64_model_runs_and_matches_stock():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).double()
    swapped = transformers.LlamaForCausalLM(config).double()
    swapped.load_state_dict(stock.state_dict())
    assert cake_cute.swap_rmsnorm(swapped)
    ids = torch.randint(0, 64, (2, 7))
    expected, got = stock(ids).logits, swapped(ids).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    got.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("residual", [False, True])
def test_one_dimensional_inputs_are_one_row(dtype, residual):
    x, w, r = _tensors((16,), (16,), (16,), dtype=dtype, seed=17)
    r = r if residual else None
    one = cake_rmsnorm(x, w, EPS, residual=r)
    row = cake_rmsnorm(x[None], w, EPS, residual=None if r is None else r[None])
    for a, b in zip(one if residual else (one,), row if residual else (row,)):
        assert a.shape == (16,)
        torch.testing.assert_close(a, b[0], rtol=0, atol=0)
    norm = _module(16, w)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), w, EPS), rtol=1e-2, atol=1e-2)


def test_a_one_dimensional_gated_input_is_one_row():
    x, z, w = _tensors((16,), (16,), (16,), seed=18)
    torch.testing.assert_close(
        cake_gated_rmsnorm(x, z, w, EPS), cake_gated_rmsnorm(x[None], z[None], w, EPS)[0], rtol=0, atol=0
    )
