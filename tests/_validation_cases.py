"""The call model of the bad-input tables (``test_validation_*_cpu.py``, ``test_gpu_validation.py``).

Bad inputs raise the exact error type with a message that names the argument, before anything is
launched or written (SPEC: "Bad input never corrupts memory").

validation.py checks every argument's dtype and shape before the device, so the table below runs with
CPU tensors (no GPU needed): a call whose arguments are all fine fails last with "x must be a CUDA
tensor" (the control tests check exactly that, so every case's error is due to its one mutation). A
second, GPU-marked table covers what needs CUDA tensors: mixed devices, a too-small or misaligned
workspace. Unsupported architectures cannot be exercised on an H200 and are not tested here.

Every case passes caller-owned output buffers filled with a sentinel and checks afterwards that they,
and every input, are bit-for-bit unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from cake_cute import (
    ArgumentError,
    cake_rmsnorm,
    cake_rmsnorm_train_backward,
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_backward_workspace_bytes,
    cake_rmsnorm_train_forward,
)

from ._helpers import EPS, bits, sentinel

T, H = 4, 8
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
OUTPUT_NAMES = {"fwd": ("out", "rstd", "residual_out"), "bwd": ("dx", "dw")}


# ------------------------------------------------------------------------------------------ call model


@dataclass
class Call:
    api: str  # "fwd", "bwd", "ws_bytes", "ws", "autograd"
    args: list
    kwargs: dict = field(default_factory=dict)

    def invoke(self):
        fn = {
            "fwd": cake_rmsnorm_train_forward,
            "bwd": cake_rmsnorm_train_backward,
            "ws_bytes": cake_rmsnorm_train_backward_workspace_bytes,
            "ws": cake_rmsnorm_train_backward_workspace,
            "autograd": cake_rmsnorm,
        }[self.api]
        return fn(*self.args, **self.kwargs)

    def tensors(self):
        """(label, tensor) for every tensor argument, inputs and caller-owned outputs alike."""
        found = [(f"arg{i}", a) for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        found += [(k, v) for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)]
        return found

    def snapshot(self):
        return [(label, t, bits(t).clone()) for label, t in self.tensors()]


def assert_untouched(snapshot):
    for label, t, before in snapshot:
        assert torch.equal(bits(t), before), f"{label} was modified by a call that raised"


def rand(shape, dtype=F32, device="cpu"):
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    return torch.randint(1, 5, shape, device=device, dtype=dtype)


def fwd_call(device, dtype=F32, residual=False, shape=(T, H), w_dtype=None):
    rows = math.prod(shape[:-1])
    x = rand(shape, dtype, device)
    w = rand((shape[-1],), w_dtype or dtype, device)
    kwargs = dict(out=sentinel(shape, dtype, device), rstd=sentinel((rows,), F32, device))
    if residual:
        kwargs.update(residual=rand(shape, dtype, device), residual_out=sentinel(shape, dtype, device))
    return Call("fwd", [x, w, EPS], kwargs)


def bwd_call(device, dtype=F32, residual=False, shape=(T, H)):
    rows = math.prod(shape[:-1])
    g = rand(shape, dtype, device)
    x = rand(shape, dtype, device)
    w = rand((shape[-1],), dtype, device)
    rstd = torch.rand(rows, device=device) + 0.5
    kwargs = dict(dx=sentinel(shape, dtype, device), dw=sentinel((shape[-1],), F32, device))
    if residual:
        kwargs["g_residual"] = rand(shape, dtype, device)
    return Call("bwd", [g, x, w, rstd], kwargs)


def ws_call(device, api="ws_bytes"):
    return Call(api, [T, H, device], {})


def autograd_call(device, dtype=F32, residual=False):
    x = rand((T, H), dtype, device).requires_grad_(dtype.is_floating_point)
    w = rand((H,), dtype, device).requires_grad_(dtype.is_floating_point)
    res = rand((T, H), dtype, device) if residual else None
    return Call("autograd", [x, w, EPS, res], {})


BUILDERS = {"fwd": fwd_call, "bwd": bwd_call, "ws_bytes": ws_call, "autograd": autograd_call}


@dataclass
class Case:
    id: str
    api: str
    mutate: Callable  # (call, device) -> None
    exc: type
    match: str
    build: dict = field(default_factory=dict)  # extra builder arguments (dtype, residual, shape)

    def make(self, device):
        if self.api == "ws":
            call = ws_call(device, "ws")
        else:
            call = BUILDERS[self.api](device, **self.build)
        self.mutate(call, device)
        return call

    def param(self):
        return pytest.param(self, id=self.id)


def arg(i, make):
    def mutate(call, device):
        call.args[i] = make(call, device)

    return mutate


def kw(name, make):
    def mutate(call, device):
        call.kwargs[name] = make(call, device)

    return mutate


def both(*mutations):
    def mutate(call, device):
        for m in mutations:
            m(call, device)

    return mutate


def misaligned_workspace(call, device):
    ws = torch.zeros(1 << 16, dtype=torch.uint8, device=device)[1:]
    assert ws.data_ptr() % 16 != 0  # the precondition of the case
    return ws


def ids(cases):
    return [c.param() for c in cases]


def check_raises(case, device):
    call = case.make(device)
    snapshot = call.snapshot()
    with pytest.raises(case.exc, match=case.match) as info:
        call.invoke()
    assert_error_class(info.value, case.exc)
    assert_untouched(snapshot)


def assert_error_class(error, expected: type) -> None:
    """``error`` is exactly ``expected``, or an ``ArgumentError`` (a wrong dtype, shape or device),
    which ``except ValueError`` and ``except TypeError`` both catch (FlashInfer raises ValueError where
    cake_cute raised TypeError for a wrong dtype): the one error class the table does not name exactly,
    where it used to require TypeError-not-ValueError (or the reverse)."""
    if type(error) is ArgumentError:
        assert isinstance(error, ValueError) and isinstance(error, TypeError)
        return
    assert type(error) is expected, f"expected exactly {expected.__name__}, got {type(error).__name__}"


def _with(call, name, value):
    call.kwargs[name] = value
    return call


CONTROL_CALLS = {
    "fwd": lambda d: fwd_call(d),
    "fwd-residual": lambda d: fwd_call(d, residual=True),
    "fwd-bf16-fp32w-3d": lambda d: fwd_call(d, dtype=BF16, w_dtype=F32, shape=(2, 3, H)),
    "bwd": lambda d: bwd_call(d),
    "bwd-residual": lambda d: bwd_call(d, residual=True),
    "bwd-workspace": lambda d: _with(
        bwd_call(d), "workspace", torch.zeros(1 << 16, dtype=torch.uint8, device=d)
    ),
    "bwd-fp16-3d": lambda d: bwd_call(d, dtype=F16, shape=(2, 3, H)),
}

# The autograd layer runs on CPU tensors (the custom ops' CPU kernels), so its valid base calls succeed.
AUTOGRAD_CONTROL_CALLS = {
    "autograd": lambda d: autograd_call(d),
    "autograd-residual": lambda d: autograd_call(d, residual=True),
}
