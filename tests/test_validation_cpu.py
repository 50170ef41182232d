"""Bad inputs raise the exact error type with a message that names the argument, before anything is
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

import cake_cute
from cake_cute import (
    cake_rmsnorm,
    cake_rmsnorm_train_backward,
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_backward_workspace_bytes,
    cake_rmsnorm_train_forward,
)

from ._helpers import EPS, bits, fixed_seed, sentinel  # noqa: F401 (fixed_seed: autouse fixture)

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


def _rand(shape, dtype=F32, device="cpu"):
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    return torch.randint(1, 5, shape, device=device, dtype=dtype)


def fwd_call(device, dtype=F32, residual=False, shape=(T, H), w_dtype=None):
    rows = math.prod(shape[:-1])
    x = _rand(shape, dtype, device)
    w = _rand((shape[-1],), w_dtype or dtype, device)
    kwargs = dict(out=sentinel(shape, dtype, device), rstd=sentinel((rows,), F32, device))
    if residual:
        kwargs.update(residual=_rand(shape, dtype, device), residual_out=sentinel(shape, dtype, device))
    return Call("fwd", [x, w, EPS], kwargs)


def bwd_call(device, dtype=F32, residual=False, shape=(T, H)):
    rows = math.prod(shape[:-1])
    g = _rand(shape, dtype, device)
    x = _rand(shape, dtype, device)
    w = _rand((shape[-1],), dtype, device)
    rstd = torch.rand(rows, device=device) + 0.5
    kwargs = dict(dx=sentinel(shape, dtype, device), dw=sentinel((shape[-1],), F32, device))
    if residual:
        kwargs["g_residual"] = _rand(shape, dtype, device)
    return Call("bwd", [g, x, w, rstd], kwargs)


def ws_call(device, api="ws_bytes"):
    return Call(api, [T, H, device], {})


def autograd_call(device, dtype=F32, residual=False):
    x = _rand((T, H), dtype, device).requires_grad_(dtype.is_floating_point)
    w = _rand((H,), dtype, device).requires_grad_(dtype.is_floating_point)
    res = _rand((T, H), dtype, device) if residual else None
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


def _misaligned_workspace(call, device):
    ws = torch.zeros(1 << 16, dtype=torch.uint8, device=device)[1:]
    assert ws.data_ptr() % 16 != 0  # the precondition of the case
    return ws


# --------------------------------------------------------------------------------------------- the table

CPU_CASES = [
    # ---- forward: x
    Case("fwd-x-fp64", "fwd", arg(0, lambda c, d: c.args[0].double()), TypeError, r"^x must have dtype"),
    Case(
        "fwd-x-int32",
        "fwd",
        arg(0, lambda c, d: _rand((T, H), torch.int32, d)),
        TypeError,
        r"^x must have dtype",
    ),
    Case(
        "fwd-x-bool",
        "fwd",
        arg(0, lambda c, d: _rand((T, H), torch.bool, d)),
        TypeError,
        r"^x must have dtype",
    ),
    Case(
        "fwd-x-list", "fwd", arg(0, lambda c, d: c.args[0].tolist()), TypeError, r"^x must be a torch\.Tensor"
    ),
    Case("fwd-x-None", "fwd", arg(0, lambda c, d: None), TypeError, r"^x must be a torch\.Tensor"),
    Case(
        "fwd-x-0d",
        "fwd",
        arg(0, lambda c, d: torch.tensor(1.5, device=d)),
        ValueError,
        r"^x must have at least 2 dims",
    ),
    Case(
        "fwd-x-1d",
        "fwd",
        arg(0, lambda c, d: _rand((H,), F32, d)),
        ValueError,
        r"^x must have at least 2 dims",
    ),
    Case(
        "fwd-x-H0",
        "fwd",
        both(arg(0, lambda c, d: _rand((T, 0), F32, d)), arg(1, lambda c, d: _rand((0,), F32, d))),
        ValueError,
        r"^x's hidden size .*got 0",
    ),
    Case(
        "fwd-x-H-262145",
        "fwd",
        both(
            arg(0, lambda c, d: _rand((1, 262145), BF16, d)),
            arg(1, lambda c, d: _rand((262145,), BF16, d)),
            kw("out", lambda c, d: sentinel((1, 262145), BF16, d)),
            kw("rstd", lambda c, d: sentinel((1,), F32, d)),
        ),
        ValueError,
        r"^x's hidden size .*262144.*got 262145",
        build=dict(dtype=BF16),
    ),
    # ---- forward: w
    Case(
        "fwd-w-int32",
        "fwd",
        arg(1, lambda c, d: _rand((H,), torch.int32, d)),
        TypeError,
        r"^w must have dtype",
    ),
    Case(
        "fwd-w-fp64",
        "fwd",
        arg(1, lambda c, d: _rand((H,), torch.float64, d)),
        TypeError,
        r"^w must have dtype",
    ),
    Case(
        "fwd-w-fp16-with-bf16-x",
        "fwd",
        arg(1, lambda c, d: _rand((H,), F16, d)),
        TypeError,
        r"^w must have dtype bfloat16, float32",
        build=dict(dtype=BF16),
    ),
    Case(
        "fwd-w-wrong-length",
        "fwd",
        arg(1, lambda c, d: _rand((H - 1,), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case(
        "fwd-w-2d",
        "fwd",
        arg(1, lambda c, d: _rand((1, H), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case("fwd-w-list", "fwd", arg(1, lambda c, d: [1.0] * H), TypeError, r"^w must be a torch\.Tensor"),
    # ---- forward: eps
    Case(
        "fwd-eps-negative",
        "fwd",
        arg(2, lambda c, d: -1e-6),
        ValueError,
        r"^eps must be a finite number >= 0",
    ),
    Case(
        "fwd-eps-nan", "fwd", arg(2, lambda c, d: float("nan")), ValueError, r"^eps must be a finite number"
    ),
    Case(
        "fwd-eps-inf", "fwd", arg(2, lambda c, d: float("inf")), ValueError, r"^eps must be a finite number"
    ),
    Case(
        "fwd-eps-minus-inf",
        "fwd",
        arg(2, lambda c, d: float("-inf")),
        ValueError,
        r"^eps must be a finite number",
    ),
    Case("fwd-eps-str", "fwd", arg(2, lambda c, d: "1e-6"), TypeError, r"^eps must be a float"),
    Case("fwd-eps-bool", "fwd", arg(2, lambda c, d: True), TypeError, r"^eps must be a float"),
    Case("fwd-eps-None", "fwd", arg(2, lambda c, d: None), TypeError, r"^eps must be a float"),
    Case("fwd-eps-complex", "fwd", arg(2, lambda c, d: 1e-6 + 0j), TypeError, r"^eps must be a float"),
    # ---- forward: residual
    Case(
        "fwd-residual-shape",
        "fwd",
        kw("residual", lambda c, d: _rand((T, H + 1), F32, d)),
        ValueError,
        r"^residual must have shape \(4, 8\)",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual-transposed-shape",
        "fwd",
        kw("residual", lambda c, d: _rand((H, T), F32, d)),
        ValueError,
        r"^residual must have shape",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual-dtype",
        "fwd",
        kw("residual", lambda c, d: _rand((T, H), F16, d)),
        TypeError,
        r"^residual must have dtype float32",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual-list",
        "fwd",
        kw("residual", lambda c, d: [[0.5] * H] * T),
        TypeError,
        r"^residual must be a torch\.Tensor",
        build=dict(residual=True),
    ),
    # ---- forward: caller-owned outputs
    Case(
        "fwd-out-shape",
        "fwd",
        kw("out", lambda c, d: sentinel((T, H - 1), F32, d)),
        ValueError,
        r"^out must have shape \(4, 8\)",
    ),
    Case(
        "fwd-out-dtype",
        "fwd",
        kw("out", lambda c, d: sentinel((T, H), BF16, d)),
        TypeError,
        r"^out must have dtype float32",
    ),
    Case(
        "fwd-out-list", "fwd", kw("out", lambda c, d: [0.0] * H), TypeError, r"^out must be a torch\.Tensor"
    ),
    Case(
        "fwd-rstd-out-fp16",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), F16, d)),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "fwd-rstd-out-fp64",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), torch.float64, d)),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "fwd-rstd-out-bf16-x",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), BF16, d)),
        TypeError,
        r"^rstd must have dtype float32",
        build=dict(dtype=BF16),
    ),
    Case(
        "fwd-rstd-out-length",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T + 1,), F32, d)),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case(
        "fwd-rstd-out-2d",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T, 1), F32, d)),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case(
        "fwd-rstd-out-3d-x",
        "fwd",
        kw("rstd", lambda c, d: sentinel((2, 3), F32, d)),
        ValueError,
        r"^rstd must have shape \(6,\)",
        build=dict(shape=(2, 3, H)),
    ),
    Case(
        "fwd-residual_out-without-residual",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T, H), F32, d)),
        ValueError,
        r"^residual_out .*residual=",
    ),
    Case(
        "fwd-residual_out-shape",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T + 1, H), F32, d)),
        ValueError,
        r"^residual_out must have shape \(4, 8\)",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual_out-dtype",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T, H), F16, d)),
        TypeError,
        r"^residual_out must have dtype float32",
        build=dict(residual=True),
    ),
    # ---- forward: weight_offset (not validated yet)
    Case(
        "fwd-weight_offset-str", "fwd", kw("weight_offset", lambda c, d: "1.0"), TypeError, r"weight_offset"
    ),
    Case(
        "fwd-weight_offset-nan",
        "fwd",
        kw("weight_offset", lambda c, d: float("nan")),
        ValueError,
        r"weight_offset",
    ),
    Case(
        "fwd-weight_offset-inf",
        "fwd",
        kw("weight_offset", lambda c, d: float("inf")),
        ValueError,
        r"weight_offset",
    ),
    # ---- backward: g, x, w, rstd, g_residual
    Case("bwd-x-fp64", "bwd", arg(1, lambda c, d: c.args[1].double()), TypeError, r"^x must have dtype"),
    Case(
        "bwd-x-1d",
        "bwd",
        arg(1, lambda c, d: _rand((H,), F32, d)),
        ValueError,
        r"^x must have at least 2 dims",
    ),
    Case("bwd-x-list", "bwd", arg(1, lambda c, d: [[1.0] * H] * T), TypeError, r"^x must be a torch\.Tensor"),
    Case(
        "bwd-g-dtype",
        "bwd",
        arg(0, lambda c, d: _rand((T, H), BF16, d)),
        TypeError,
        r"^g must have dtype float32",
    ),
    Case(
        "bwd-g-fp32-with-bf16-x",
        "bwd",
        arg(0, lambda c, d: _rand((T, H), F32, d)),
        TypeError,
        r"^g must have dtype bfloat16",
        build=dict(dtype=BF16),
    ),
    Case(
        "bwd-g-shape",
        "bwd",
        arg(0, lambda c, d: _rand((T + 1, H), F32, d)),
        ValueError,
        r"^g must have shape \(4, 8\)",
    ),
    Case(
        "bwd-g-flattened-3d",
        "bwd",
        arg(0, lambda c, d: _rand((6, H), F32, d)),
        ValueError,
        r"^g must have shape \(2, 3, 8\)",
        build=dict(shape=(2, 3, H)),
    ),
    Case(
        "bwd-g-list",
        "bwd",
        arg(0, lambda c, d: [[1.0] * H] * T),
        TypeError,
        r"^g must be a tensor or a list / tuple of 1 to 3 tensors \(its summands\), got list of length 4",
    ),
    Case(
        "bwd-g-parts-lists",
        "bwd",
        arg(0, lambda c, d: [[1.0] * H] * 2),
        TypeError,
        r"^g\[0\] must be a torch\.Tensor",
    ),
    Case(
        "bwd-g-parts-shape",
        "bwd",
        arg(0, lambda c, d: (_rand((T, H), F32, d), _rand((T + 1, H), F32, d))),
        ValueError,
        r"^g\[1\] must have shape \(4, 8\)",
    ),
    Case(
        "bwd-w-int", "bwd", arg(2, lambda c, d: _rand((H,), torch.int64, d)), TypeError, r"^w must have dtype"
    ),
    Case(
        "bwd-w-wrong-length",
        "bwd",
        arg(2, lambda c, d: _rand((H + 1,), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case(
        "bwd-rstd-fp16",
        "bwd",
        arg(3, lambda c, d: c.args[3].half()),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "bwd-rstd-bf16",
        "bwd",
        arg(3, lambda c, d: c.args[3].bfloat16()),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "bwd-rstd-length",
        "bwd",
        arg(3, lambda c, d: c.args[3][:-1]),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case(
        "bwd-rstd-2d",
        "bwd",
        arg(3, lambda c, d: c.args[3][:, None]),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case("bwd-rstd-list", "bwd", arg(3, lambda c, d: [1.0] * T), TypeError, r"^rstd must be a torch\.Tensor"),
    Case(
        "bwd-g_residual-dtype",
        "bwd",
        kw("g_residual", lambda c, d: _rand((T, H), F16, d)),
        TypeError,
        r"^g_residual must have dtype float32",
    ),
    Case(
        "bwd-g_residual-shape",
        "bwd",
        kw("g_residual", lambda c, d: _rand((T, H + 2), F32, d)),
        ValueError,
        r"^g_residual must have shape \(4, 8\)",
    ),
    Case(
        "bwd-deterministic-int",
        "bwd",
        kw("deterministic", lambda c, d: 1),
        TypeError,
        r"^deterministic must be a bool",
    ),
    Case(
        "bwd-deterministic-None",
        "bwd",
        kw("deterministic", lambda c, d: None),
        TypeError,
        r"^deterministic must be a bool",
    ),
    Case(
        "bwd-deterministic-str",
        "bwd",
        kw("deterministic", lambda c, d: "yes"),
        TypeError,
        r"^deterministic must be a bool",
    ),
    # ---- backward: caller-owned outputs
    Case(
        "bwd-dx-dtype",
        "bwd",
        kw("dx", lambda c, d: sentinel((T, H), F16, d)),
        TypeError,
        r"^dx must have dtype float32",
    ),
    Case(
        "bwd-dx-shape",
        "bwd",
        kw("dx", lambda c, d: sentinel((T, H + 1), F32, d)),
        ValueError,
        r"^dx must have shape \(4, 8\)",
    ),
    Case("bwd-dx-list", "bwd", kw("dx", lambda c, d: [0.0]), TypeError, r"^dx must be a torch\.Tensor"),
    Case(
        "bwd-dw-shape",
        "bwd",
        kw("dw", lambda c, d: sentinel((H - 1,), F32, d)),
        ValueError,
        r"^dw must have shape \(8,\)",
    ),
    Case(
        "bwd-dw-2d",
        "bwd",
        kw("dw", lambda c, d: sentinel((1, H), F32, d)),
        ValueError,
        r"^dw must have shape \(8,\)",
    ),
    Case(
        "bwd-dw-dtype",
        "bwd",
        kw("dw", lambda c, d: sentinel((H,), BF16, d)),
        TypeError,
        r"^dw must have dtype float32",
    ),
    Case(
        "bwd-dw-fp32-when-dw_dtype-bf16",
        "bwd",
        both(kw("dw", lambda c, d: sentinel((H,), F32, d)), kw("dw_dtype", lambda c, d: BF16)),
        TypeError,
        r"^dw must have dtype bfloat16",
    ),
    # ---- backward: workspace
    Case(
        "bwd-workspace-fp32",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(4096, dtype=F32, device=d)),
        TypeError,
        r"^workspace must have dtype uint8",
    ),
    Case(
        "bwd-workspace-int8",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(4096, dtype=torch.int8, device=d)),
        TypeError,
        r"^workspace must have dtype uint8",
    ),
    Case(
        "bwd-workspace-list",
        "bwd",
        kw("workspace", lambda c, d: [0] * 64),
        TypeError,
        r"^workspace must be a torch\.Tensor",
    ),
    Case(
        "bwd-workspace-non-contiguous",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(1 << 16, dtype=torch.uint8, device=d)[::2]),
        ValueError,
        r"^workspace must be a contiguous",
    ),
    Case(
        "bwd-workspace-misaligned",
        "bwd",
        kw("workspace", _misaligned_workspace),
        ValueError,
        r"^workspace .*16-byte aligned",
    ),
    Case(
        "bwd-workspace-2d",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(256, 256, dtype=torch.uint8, device=d)),
        ValueError,
        r"^workspace must be a contiguous 1-D",
    ),
    # ---- backward: weight_offset / dw_dtype (not validated yet)
    Case(
        "bwd-weight_offset-nan",
        "bwd",
        kw("weight_offset", lambda c, d: float("nan")),
        ValueError,
        r"weight_offset",
    ),
    Case("bwd-dw_dtype-int32", "bwd", kw("dw_dtype", lambda c, d: torch.int32), TypeError, r"dw_dtype"),
    Case("bwd-dw_dtype-fp64", "bwd", kw("dw_dtype", lambda c, d: torch.float64), TypeError, r"dw_dtype"),
    # ---- workspace size helpers
    Case("ws-rows-negative", "ws_bytes", arg(0, lambda c, d: -1), ValueError, r"^rows must be an int >= 0"),
    Case("ws-rows-float", "ws_bytes", arg(0, lambda c, d: 4.0), TypeError, r"^rows must be an int"),
    Case("ws-rows-str", "ws_bytes", arg(0, lambda c, d: "4"), TypeError, r"^rows must be an int"),
    Case("ws-rows-bool", "ws_bytes", arg(0, lambda c, d: True), TypeError, r"^rows must be an int"),
    Case(
        "ws-hidden-0",
        "ws_bytes",
        arg(1, lambda c, d: 0),
        ValueError,
        r"^hidden must be an int in \[1, 262144\]",
    ),
    Case(
        "ws-hidden-262145",
        "ws_bytes",
        arg(1, lambda c, d: 262145),
        ValueError,
        r"^hidden must be an int in \[1, 262144\]",
    ),
    Case("ws-hidden-float", "ws_bytes", arg(1, lambda c, d: 4096.0), TypeError, r"^hidden must be an int"),
    Case(
        "ws-device-cpu", "ws_bytes", arg(2, lambda c, d: "cpu"), ValueError, r"^device must be a CUDA device"
    ),
    Case(
        "ws-device-cpu-object",
        "ws_bytes",
        arg(2, lambda c, d: torch.device("cpu")),
        ValueError,
        r"^device must be a CUDA device",
    ),
    Case(
        "ws-device-meta",
        "ws_bytes",
        arg(2, lambda c, d: "meta"),
        ValueError,
        r"^device must be a CUDA device",
    ),
    Case(
        "ws-alloc-device-cpu", "ws", arg(2, lambda c, d: "cpu"), ValueError, r"^device must be a CUDA device"
    ),
    Case(
        "ws-alloc-hidden-0",
        "ws",
        both(arg(1, lambda c, d: 0), arg(2, lambda c, d: "cpu")),
        ValueError,
        r"^hidden must be",
    ),
    # ---- autograd entry point
    Case("autograd-eps-str", "autograd", arg(2, lambda c, d: "1e-6"), TypeError, r"^eps must be a float"),
    Case(
        "autograd-x-int",
        "autograd",
        arg(0, lambda c, d: _rand((T, H), torch.int32, d)),
        TypeError,
        r"^x must have dtype",
    ),
    Case(
        "autograd-w-wrong-length",
        "autograd",
        arg(1, lambda c, d: _rand((H + 3,), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case(
        "autograd-residual-dtype",
        "autograd",
        arg(3, lambda c, d: _rand((T, H), BF16, d)),
        TypeError,
        r"^residual must have dtype float32",
    ),
]


GPU_CASES = [
    # ---- mixed devices
    Case(
        "gpu-fwd-w-on-cpu",
        "fwd",
        arg(1, lambda c, d: c.args[1].cpu()),
        ValueError,
        r"^w must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-fwd-x-on-cpu",
        "fwd",
        arg(0, lambda c, d: c.args[0].cpu()),
        ValueError,
        r"^w must be on the same device as x \(cpu\)",
    ),
    Case(
        "gpu-fwd-residual-on-cpu",
        "fwd",
        kw("residual", lambda c, d: c.kwargs["residual"].cpu()),
        ValueError,
        r"^residual must be on the same device as x \(cuda",
        build=dict(residual=True),
    ),
    Case(
        "gpu-fwd-out-on-cpu",
        "fwd",
        kw("out", lambda c, d: sentinel((T, H), F32, "cpu")),
        ValueError,
        r"^out must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-fwd-rstd-out-on-cpu",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), F32, "cpu")),
        ValueError,
        r"^rstd must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-fwd-residual_out-on-cpu",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T, H), F32, "cpu")),
        ValueError,
        r"^residual_out must be on the same device as x \(cuda",
        build=dict(residual=True),
    ),
    Case(
        "gpu-bwd-g-on-cpu",
        "bwd",
        arg(0, lambda c, d: c.args[0].cpu()),
        ValueError,
        r"^g must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-w-on-cpu",
        "bwd",
        arg(2, lambda c, d: c.args[2].cpu()),
        ValueError,
        r"^w must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-rstd-on-cpu",
        "bwd",
        arg(3, lambda c, d: c.args[3].cpu()),
        ValueError,
        r"^rstd must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-g_residual-on-cpu",
        "bwd",
        kw("g_residual", lambda c, d: c.kwargs["g_residual"].cpu()),
        ValueError,
        r"^g_residual must be on the same device as x \(cuda",
        build=dict(residual=True),
    ),
    Case(
        "gpu-bwd-dx-on-cpu",
        "bwd",
        kw("dx", lambda c, d: sentinel((T, H), F32, "cpu")),
        ValueError,
        r"^dx must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-dw-on-cpu",
        "bwd",
        kw("dw", lambda c, d: sentinel((H,), F32, "cpu")),
        ValueError,
        r"^dw must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-workspace-on-cpu",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(1 << 20, dtype=torch.uint8)),
        ValueError,
        r"^workspace must be on the same device as x \(cuda",
    ),
    # ---- workspace size and alignment
    Case(
        "gpu-bwd-workspace-too-small",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(16, dtype=torch.uint8, device=d)),
        ValueError,
        r"^workspace holds 16 bytes; this call needs at least \d+",
    ),
    Case(
        "gpu-bwd-workspace-misaligned",
        "bwd",
        kw("workspace", _misaligned_workspace),
        ValueError,
        r"^workspace .*16-byte aligned",
    ),
    Case(
        "gpu-bwd-workspace-non-contiguous",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(1 << 16, dtype=torch.uint8, device=d)[::2]),
        ValueError,
        r"^workspace must be a contiguous",
    ),
]


def _ids(cases):
    return [c.param() for c in cases]


def test_table_is_large_and_ids_unique():
    ids = [c.id for c in CPU_CASES + GPU_CASES]
    assert len(ids) == len(set(ids))
    assert len(CPU_CASES) >= 20


# ----------------------------------------------------------------------------------------------- CPU


def _check_raises(case, device):
    call = case.make(device)
    snapshot = call.snapshot()
    with pytest.raises(case.exc, match=case.match) as info:
        call.invoke()
    assert type(info.value) is case.exc, (
        f"expected exactly {case.exc.__name__}, got {type(info.value).__name__}"
    )
    assert_untouched(snapshot)


@pytest.mark.parametrize("case", _ids(CPU_CASES))
def test_bad_input_cpu(case):
    _check_raises(case, "cpu")


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


@pytest.mark.parametrize("name", list(AUTOGRAD_CONTROL_CALLS))
def test_control_valid_autograd_arguments_run_on_cpu(name):
    call = AUTOGRAD_CONTROL_CALLS[name]("cpu")
    out = call.invoke()
    y = out[0] if isinstance(out, tuple) else out
    assert y.shape == call.args[0].shape and torch.isfinite(y).all()


@pytest.mark.parametrize("name", list(CONTROL_CALLS))
def test_control_valid_arguments_fail_only_on_device_cpu(name):
    """The base calls the table mutates are valid: on the CPU they fail only on the device check,
    with the documented message, and leave every buffer untouched."""
    call = CONTROL_CALLS[name]("cpu")
    snapshot = call.snapshot()
    with pytest.raises(ValueError, match=r"^x must be a CUDA tensor") as info:
        call.invoke()
    assert type(info.value) is ValueError
    assert_untouched(snapshot)


def test_public_names():
    for name in (
        "cake_rmsnorm_train_forward",
        "cake_rmsnorm_train_backward",
        "cake_rmsnorm_train_backward_workspace_bytes",
        "cake_rmsnorm_train_backward_workspace",
        "CakeRMSNormFunction",
        "cake_rmsnorm",
        "is_cake_rmsnorm_train_supported",
    ):
        assert hasattr(cake_cute, name), name


def test_is_supported_never_raises_on_bad_input():
    f = cake_cute.is_cake_rmsnorm_train_supported
    assert f("cpu") is False
    assert f("not a device") is False
    assert f(torch.device("cpu"), 4096) is False
    if not torch.cuda.is_available():
        assert f("cuda") is False
    for hidden in (0, -1, 262145, 4096.0, True, "4096"):
        assert f("cuda", hidden) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks a torch without CUDA devices")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1), 0, 3])
def test_workspace_bytes_without_a_cuda_device(device):
    """A CUDA device (by name, object or index, as torch accepts it) where torch has none: a ValueError
    that says so, not torch's bare AssertionError."""
    with pytest.raises(ValueError, match=r"no CUDA device is available") as info:
        cake_rmsnorm_train_backward_workspace_bytes(T, H, device)
    assert type(info.value) is ValueError


@pytest.mark.parametrize("device", [-1, True, 1.0, None, "cuda:x"])
def test_workspace_bytes_device_that_names_nothing(device):
    with pytest.raises(ValueError, match=r"^device must name a CUDA device") as info:
        cake_rmsnorm_train_backward_workspace_bytes(T, H, device)
    assert type(info.value) is ValueError


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", _ids(GPU_CASES + [c for c in CPU_CASES if not c.api.startswith("ws")]))
def test_bad_input_gpu(case):
    """The whole table again with CUDA tensors (where the device check would pass), plus the cases
    that need CUDA. Caller-owned CUDA outputs must stay untouched: nothing may be launched."""
    _check_raises(case, "cuda")
    torch.cuda.synchronize()  # an asynchronous fault from a stray launch would surface here


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in CONTROL_CALLS])
def test_control_valid_arguments_run_on_gpu(name):
    """The same base calls succeed on the GPU and overwrite the sentinels of their outputs."""
    call = CONTROL_CALLS[name]("cuda")
    outputs = {k: v for k, v in call.kwargs.items() if k in OUTPUT_NAMES.get(call.api, ())}
    result = call.invoke()
    torch.cuda.synchronize()
    assert result is not None
    for label, t in outputs.items():
        assert not torch.any(t == -7.0), f"{label} still holds the sentinel"
        assert torch.isfinite(t).all(), f"{label} is not finite"


@pytest.mark.gpu
def test_workspace_helpers_on_gpu():
    nbytes = cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, "cuda")
    assert isinstance(nbytes, int) and nbytes > 0 and nbytes % 16 == 0
    assert (
        cake_rmsnorm_train_backward_workspace_bytes(0, 4096, "cuda") > 0
    )  # T = 0 still needs a valid buffer
    assert cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, "cuda", residual=True) > 0
    # A device index is a device, as for torch.
    assert cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, 0) == nbytes
    # Monotone in rows: a workspace for more rows serves fewer.
    sizes = [cake_rmsnorm_train_backward_workspace_bytes(t, 4096, "cuda") for t in (1, 129, 4096, 16231)]
    assert sizes == sorted(sizes)
    ws = cake_rmsnorm_train_backward_workspace(4096, 4096, "cuda")
    assert ws.dtype == torch.uint8 and ws.is_cuda and ws.numel() == nbytes and ws.is_contiguous()
    assert ws.data_ptr() % 16 == 0
    assert int(ws.count_nonzero().item()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_workspace_size_threshold_on_gpu(residual):
    """The error states the exact size a call needs: one byte less is refused (outputs untouched),
    exactly that many bytes works, and the size helper never asks for less."""
    rows, hidden = 129, 4096
    call = bwd_call("cuda", dtype=BF16, residual=residual, shape=(rows, hidden))
    call.kwargs["workspace"] = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"needs at least (\d+)") as info:
        call.invoke()
    import re

    needed = int(re.search(r"needs at least (\d+)", str(info.value)).group(1))
    assert needed > 16
    assert cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, "cuda", residual=residual) >= needed

    call.kwargs["workspace"] = torch.zeros(needed - 1, dtype=torch.uint8, device="cuda")
    snapshot = call.snapshot()
    with pytest.raises(ValueError, match=r"^workspace holds"):
        call.invoke()
    assert_untouched(snapshot)

    call.kwargs["workspace"] = torch.zeros(needed, dtype=torch.uint8, device="cuda")
    dx, dw = call.invoke()
    torch.cuda.synchronize()
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
