"""Bad inputs of the workspace size helpers and the autograd entry point; the valid base calls
the tables mutate (controls); the public names; ``is_cake_rmsnorm_train_supported`` and the
workspace helpers' device argument."""

from __future__ import annotations

import pytest
import torch

import cake_cute
from cake_cute import cake_rmsnorm_train_backward_workspace_bytes

from ._helpers import fixed_seed  # noqa: F401 (autouse fixture)
from ._validation_cases import (
    AUTOGRAD_CONTROL_CALLS,
    BF16,
    CONTROL_CALLS,
    F32,
    Case,
    H,
    T,
    arg,
    assert_untouched,
    both,
    check_raises,
    ids,
    rand,
)
from .test_validation_backward_cpu import BACKWARD_CASES
from .test_validation_forward_cpu import FORWARD_CASES

ENTRY_CASES = [
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
        arg(0, lambda c, d: rand((T, H), torch.int32, d)),
        TypeError,
        r"^x must have dtype",
    ),
    Case(
        "autograd-w-wrong-length",
        "autograd",
        arg(1, lambda c, d: rand((H + 3,), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case(
        "autograd-residual-dtype",
        "autograd",
        arg(3, lambda c, d: rand((T, H), BF16, d)),
        TypeError,
        r"^residual must have dtype float32",
    ),
]


@pytest.mark.parametrize("case", ids(ENTRY_CASES))
def test_bad_entry_input_cpu(case):
    check_raises(case, "cpu")


def test_tables_are_large_and_ids_unique():
    from .test_gpu_validation import GPU_CASES

    cpu_cases = FORWARD_CASES + BACKWARD_CASES + ENTRY_CASES
    ids_ = [c.id for c in cpu_cases + GPU_CASES]
    assert len(ids_) == len(set(ids_))
    assert len(cpu_cases) >= 20


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


ALL_CASES = FORWARD_CASES + BACKWARD_CASES + ENTRY_CASES


@pytest.mark.parametrize("case", ids(ALL_CASES))
def test_each_error_is_caught_as_flashinfer_and_as_cake_cute_raise_it(case):
    """FlashInfer's contract: a wrong dtype, shape or device is caught by ``except ValueError``; where
    cake_cute raised TypeError (a wrong dtype), ``except TypeError`` still catches it; a non-tensor
    argument stays a plain TypeError."""
    call = case.make("cpu")
    try:
        call.invoke()
    except (ValueError, TypeError) as error:
        caught = error
    else:
        pytest.fail("no error")
    if "must be a torch.Tensor" in str(caught):
        assert type(caught) is TypeError
    if type(caught) is cake_cute.ArgumentError or "must have dtype" in str(caught):
        for clause in (ValueError, TypeError):
            with pytest.raises(clause):
                case.make("cpu").invoke()


def test_a_dtype_message_names_each_allowed_dtype_once():
    x = torch.zeros(T, H, dtype=F32)
    with pytest.raises(cake_cute.ArgumentError) as info:
        cake_cute.cake_rmsnorm(x, torch.zeros(H, dtype=BF16))
    assert str(info.value) == "w must have dtype float32; got bfloat16"
    assert str(info.value).count("w ") == 1
