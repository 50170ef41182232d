"""The autograd modes of ``F.rms_norm`` on the GPU, through every eager path (the native C++ node once a
signature is registered, the Python Function, the custom op) and the compiled one, against FP64 torch:
second-order gradients (a gradient penalty), the ``torch.func`` transforms, FP64 and ``[H]`` inputs."""

from __future__ import annotations

import pytest
import torch

import cake_cute
from cake_cute import (
    CakeGatedRMSNorm,
    CakeRMSNorm,
    CakeRMSNormFunction,
    cake_rmsnorm,
    cake_rmsnorm_fp8,
)

from ._autograd_modes import (
    EPS,
    TRANSFORMS,
    gated_entry_and_reference,
    gated_reference,
    plain_reference,
    second_order_error,
    transform_error,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
FP32_BOUND = 2e-5


def _tensors(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=DEV).to(dtype) for shape in shapes]


ENTRIES = {
    "cake_rmsnorm": lambda x, w, r=None: cake_rmsnorm(x, w, EPS, residual=r),
    "Function.apply": lambda x, w, r=None: CakeRMSNormFunction.apply(x, w, EPS, r),
    "op": lambda x, w, r=None: torch.ops.cake_cute.rmsnorm_fwd(x, w, EPS, r)[0],
}


@pytest.fixture(autouse=True, scope="module")
def native_path():
    """The native host path loaded, so that repeated eager calls take the C++ autograd node."""
    cake_cute.prepare()


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("hidden", [16, 4096])
def test_double_backward_of_every_eager_path(entry, residual, hidden):
    x, w, r = _tensors((6, hidden), (hidden,), (6, hidden))
    inputs = [x, w, r] if residual and entry != "op" else [x, w]
    fn = ENTRIES[entry]
    for _ in range(2):  # the first call registers the signature; the second takes the native path
        assert second_order_error(fn, plain_reference, inputs) < FP32_BOUND


def test_double_backward_with_a_weight_offset_and_in_bf16():
    x, w = _tensors((6, 1024), (1024,), seed=1)

    def offset(x, w):
        return cake_rmsnorm(x, w, EPS, weight_offset=1.0)

    assert second_order_error(offset, lambda x, w: plain_reference(x, w, None, 1.0), [x, w]) < FP32_BOUND
    xb, wb = (t.bfloat16() for t in (x, w))
    for _ in range(2):
        assert second_order_error(ENTRIES["cake_rmsnorm"], plain_reference, [xb, wb]) < 5e-2


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate,group_size", [(True, None), (False, 256)])
def test_double_backward_of_the_gated_norm(norm_before_gate, group_size, activation):
    x, z, w = _tensors((6, 1024), (6, 1024), (1024,), seed=2)
    gated, reference = gated_entry_and_reference(
        group_size=group_size, norm_before_gate=norm_before_gate, activation=activation
    )

    assert second_order_error(gated, reference, [x, z, w]) < FP32_BOUND


def test_double_backward_through_the_fp8_forward_y():
    x, w = _tensors((6, 1024), (1024,), seed=3)
    for _ in range(2):
        error = second_order_error(
            lambda x, w: cake_rmsnorm_fp8(x, w, EPS, emit_y=True).y, plain_reference, [x, w]
        )
        assert error < FP32_BOUND


def test_double_backward_of_the_memory_efficient_mode_is_refused_by_name():
    x, w = (t.requires_grad_() for t in _tensors((6, 1024), (1024,), seed=4))
    y = cake_rmsnorm(x, w, EPS, memory_efficient=True)
    with pytest.raises(RuntimeError, match="double backward.*memory_efficient=True"):
        torch.autograd.grad((y * y).sum(), (x, w), create_graph=True)


def test_compiled_double_backward_is_refused_by_name():
    x, w = (t.requires_grad_() for t in _tensors((6, 1024), (1024,), seed=5))
    torch._dynamo.reset()
    y = torch.compile(lambda x, w: cake_rmsnorm(x, w, EPS), fullgraph=True)(x, w)
    first = torch.autograd.grad((y * y).sum(), (x, w), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(sum(g.pow(2).sum() for g in first), (x, w))
    torch._dynamo.reset()


@pytest.mark.parametrize("name", TRANSFORMS)
def test_torch_func_transforms(name):
    x, w = _tensors((3, 256), (256,), seed=6)
    assert transform_error(name, ENTRIES["cake_rmsnorm"], plain_reference, [x, w]) < FP32_BOUND
    norm = CakeRMSNorm(256, eps=EPS, device=DEV)

    def module_norm(x, w):
        return torch.func.functional_call(norm, {"weight": w}, (x,))

    assert transform_error(name, module_norm, plain_reference, [x, w]) < FP32_BOUND
    z = _tensors((3, 256), seed=7)[0]
    gated = CakeGatedRMSNorm(256, EPS, device=DEV)

    def gated_norm(x, z, w):
        return torch.func.functional_call(gated, {"weight": w}, (x, z))

    assert transform_error(name, gated_norm, gated_reference, [x, z, w]) < FP32_BOUND


def test_fp64_and_one_dimensional_inputs():
    x, w = _tensors((5, 256), (256,), dtype=torch.float64, seed=8)
    torch.testing.assert_close(cake_rmsnorm(x, w, EPS), plain_reference(x, w), rtol=1e-14, atol=1e-14)
    xs = [t.requires_grad_() for t in (x, w)]
    assert torch.autograd.gradgradcheck(lambda a, b: cake_rmsnorm(a, b, EPS), xs)
    one, w32 = _tensors((256,), (256,), seed=9)
    for _ in range(2):
        torch.testing.assert_close(
            cake_rmsnorm(one, w32, EPS), cake_rmsnorm(one[None], w32, EPS)[0], rtol=0, atol=0
        )
