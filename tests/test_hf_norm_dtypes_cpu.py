"""The plain norm classes ``swap_rmsnorm`` replaces, under every dtype mix they take: each distinct
RMSNorm forward of the installed transformers (one class per distinct source) and ``torch.nn.RMSNorm``,
with the weight and the input each bf16, fp16 or fp32, without and under CPU bf16 autocast.

For each mix the class runs, the swapped module runs too (never refused), gives the class's output
dtype, and its y is bitwise the class's, except where docs/module.md states the one difference: a
class that rounds the normalized values to the input dtype before a weight of that same bf16 / fp16
dtype (``round_then_scale``, ``t5``), where the kernel rounds once, after the product: there y is
within one unit in the last place of the class's. The gradients of x and of the weight have the
class's dtypes and are within the dtype's tolerance of its autograd chain (FP32: rtol 1e-4).

The classes whose casts the kernels cannot reproduce are left alone with a warning naming the reason
(checked by name); classes the swap does not recognize as RMSNorms are not its business and not here.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import itertools
import pkgutil
import warnings

import pytest
import torch
from torch import nn

from cake_cute import CakeRMSNorm, swap_rmsnorm
from cake_cute.casts import ROUND_THEN_SCALE, T5
from cake_cute.reference import rel_error, tolerance

transformers = pytest.importorskip("transformers")

HIDDEN = 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Bits of precision below the leading one: one unit in the last place is |y| * 2**-bits at most.
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
# The classes the swap leaves alone, each for the reason its warning names.
LEFT_ALONE = {
    "MuseSparkTextCenteredRMSNorm": "adds 1 to the weight in the weight's dtype",
    "MuseSparkTextInputScaledRMSNorm": "scales its input before normalizing it",
}


def _norm_classes() -> list[type]:
    """One RMSNorm-named class per distinct forward source in the installed transformers (the first
    by module name), built with (hidden_size, eps)."""
    by_source = {}
    models = importlib.import_module("transformers.models")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda i: i.name):
            try:
                module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
            except Exception:  # a model whose optional dependency is missing
                continue
            for _, cls in sorted(vars(module).items()):
                if _is_rmsnorm_class(cls, module.__name__):
                    by_source.setdefault(inspect.getsource(cls.forward), cls)
    return list(by_source.values())


def _is_rmsnorm_class(cls, module_name: str) -> bool:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module_name):
        return False
    name = cls.__name__
    if not (name.endswith("RMSNorm") or name == "T5LayerNorm"):
        return False
    parameters = list(inspect.signature(cls.__init__).parameters)
    return parameters[1:2] == ["hidden_size"] and "eps" in parameters


def _is_swapped(cls: type) -> bool:
    holder = nn.Module()
    holder.norm = cls(HIDDEN, eps=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return swap_rmsnorm(holder) == 1


NAMED = _norm_classes()
CLASSES = [cls for cls in [*NAMED, nn.RMSNorm] if _is_swapped(cls)]


def _stock(cls: type, w_dtype: torch.dtype) -> nn.Module:
    norm = cls(HIDDEN, eps=1e-6).to(w_dtype)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    return norm


def _swapped(stock: nn.Module) -> CakeRMSNorm:
    """The CakeRMSNorm that replaces a copy of ``stock``."""
    holder = nn.Module()
    holder.norm = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swap_rmsnorm(holder)
    assert isinstance(holder.norm, CakeRMSNorm)
    return holder.norm


def _run(norm: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast: bool):
    """(y, dx, dw) of one forward and backward, or the exception the forward raised."""
    x = x.detach().clone().requires_grad_()
    norm.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with context:
            y = norm(x)
    except (RuntimeError, TypeError, ValueError) as error:
        return error
    y.backward(g.to(y.dtype))
    weight = next(norm.parameters(), None)
    return y.detach(), x.grad, None if weight is None else weight.grad


def _rounds_twice_in(swapped: CakeRMSNorm, x_dtype, w_dtype) -> bool:
    """docs/module.md's one difference: the class rounds xhat to a bf16 / fp16 input dtype before a
    weight of that dtype, the kernel once after the product."""
    return swapped.cast_policy in (ROUND_THEN_SCALE, T5) and x_dtype == w_dtype != torch.float32


def _assert_gradient_close(actual, expected, label: str) -> None:
    assert actual.dtype == expected.dtype, label
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6, msg=label)
    else:
        assert rel_error(actual.double(), expected.double()) <= tolerance(actual.dtype), label


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "cpu-autocast"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_dtype_mix_the_class_takes(cls, autocast):
    gen = torch.Generator().manual_seed(0)
    x32, g32 = torch.randn(3, 5, HIDDEN, generator=gen), torch.randn(3, 5, HIDDEN, generator=gen)
    mixes_run = 0
    for (w_name, w_dtype), (x_name, x_dtype) in itertools.product(DTYPES.items(), DTYPES.items()):
        label = f"{cls.__name__} weight {w_name}, x {x_name}"
        stock = _stock(cls, w_dtype)
        swapped = _swapped(stock)
        want = _run(stock, x32.to(x_dtype), g32, autocast)
        if isinstance(want, Exception):
            continue  # a mix the class itself does not take
        got = _run(swapped, x32.to(x_dtype), g32, autocast)
        assert not isinstance(got, Exception), f"{label}: refused where the class runs: {got}"
        assert got[0].dtype == want[0].dtype, label
        if _rounds_twice_in(swapped, x_dtype, w_dtype):
            unit = want[0].double().abs() * 2.0 ** -MANTISSA_BITS[x_dtype]
            assert ((got[0].double() - want[0].double()).abs() <= unit).all(), label
        else:
            assert torch.equal(got[0], want[0]), label
        _assert_gradient_close(got[1], want[1], f"{label}: dx")
        if want[2] is not None:
            _assert_gradient_close(got[2], want[2], f"{label}: dw")
        mixes_run += 1
    assert mixes_run >= 3  # at least the three same-dtype runs


def test_the_classes_left_alone_are_named_with_the_reason():
    """The swap leaves alone (with one warning naming the class and the reason) the classes whose
    casts the kernels cannot reproduce; each one listed is still in transformers or skipped."""
    by_name = {cls.__name__: cls for cls in NAMED}
    present = [name for name in LEFT_ALONE if name in by_name]
    if not present:
        pytest.skip(f"transformers {transformers.__version__} has none of {sorted(LEFT_ALONE)}")
    for name in present:
        holder = nn.Module()
        holder.norm = _stock(by_name[name], torch.bfloat16)
        with pytest.warns(UserWarning, match=f"{name}: it {LEFT_ALONE[name]}"):
            assert swap_rmsnorm(holder) == 0
