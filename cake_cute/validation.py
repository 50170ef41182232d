"""The one place that validates and normalizes inputs, before anything is launched or written.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong value, shape,
device or alignment) naming the argument and what was expected.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from functools import cache

import torch

from .kernels.config import MAX_HIDDEN

ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}


def dtype_name(dtype: torch.dtype) -> str:
    return ACT_DTYPES[dtype]


@dataclass(frozen=True, eq=False)  # one instance per device (cached): identity hashing is cheap
class DeviceFacts:
    index: int
    name: str
    capability: tuple[int, int]
    arch: str | None
    sm_count: int


@cache
def device_facts_of(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    return DeviceFacts(
        index, props.name, capability, ARCH_BY_CAPABILITY.get(capability), props.multi_processor_count
    )


def on_device(device: torch.device):
    """A context making ``device`` current for the launch; a no-op when it already is (the usual case)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def device_facts(device: torch.device) -> DeviceFacts:
    return device_facts_of(device.index if device.index is not None else torch.cuda.current_device())


def device_arch(device: torch.device) -> str:
    """The compile target of a CUDA device, or a ValueError for a CPU tensor or an unsupported GPU."""
    if device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor, got device {device}")
    facts = device_facts(device)
    arch, name = facts.arch, facts.name
    if arch is None:
        raise ValueError(
            f"device {device} ({name}) is not supported: cake_cute needs sm_90 (H100/H200) or "
            "sm_100/sm_103 (B200/B300)"
        )
    return arch


@dataclass(frozen=True, eq=False)  # one instance per validated signature: identity hashing is cheap
class Operands:
    """What validating (x, w) established, for everything after it: device, sizes, names, alignment."""

    device: torch.device
    hidden: int
    arch: str
    act: str
    w_name: str
    facts: DeviceFacts


_known_operands: dict[tuple, Operands] = {}


def _operands_key(x, w):
    """Every property of (x, w) that ``check_activation``, ``check_weight`` and ``device_arch`` read."""
    try:
        return (x.dtype, x.dim(), x.shape[-1], x.device, w.dtype, w.shape, w.device)
    except (AttributeError, IndexError, TypeError):
        return None


def known_operands(x, w) -> Operands | None:
    """The hot path: ``Operands`` for an (x, w) whose properties were validated before, else None
    (the caller then runs the full checks, which raise the precise error)."""
    key = _operands_key(x, w)
    return None if key is None else _known_operands.get(key)


def operands(x, w) -> Operands:
    """After ``check_activation`` and ``check_weight`` passed: the device check (the last one, so the
    argument errors come first and can be tested without a GPU), and the result remembered for
    ``known_operands``. Only CUDA devices are remembered."""
    device = x.device
    arch = device_arch(device)
    found = Operands(
        device, x.shape[-1], arch, dtype_name(x.dtype), dtype_name(w.dtype), device_facts(device)
    )
    if device.type == "cuda":
        _known_operands[_operands_key(x, w)] = found
    return found


def check_tensor(name: str, t, *, dtypes=None, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on the same device as x ({device}), got {t.device}")


def check_activation(x) -> None:
    """x: a tensor of bf16/fp16/fp32 with at least 2 dims and 1 <= H <= 262144.

    The device is checked last (``operands``), after every argument's dtype and shape, so the
    whole table of argument errors can be exercised on a machine without a GPU."""
    check_tensor("x", x, dtypes=ACT_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims [..., H], got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x's hidden size (last dim) must be in [1, {MAX_HIDDEN}], got {hidden}")


def check_weight(w, x) -> None:
    check_tensor("w", w, dtypes=(x.dtype, torch.float32), device=x.device)
    if w.dim() != 1 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"w must have shape ({x.shape[-1]},) to match x's last dim, got {tuple(w.shape)}")


def _check_real(name: str, value, rule: str = "a finite number", ok=math.isfinite) -> float:
    # A plain float skips the numbers.Real ABC check, which costs microseconds on every call.
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        value = float(value)
    if not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def check_eps(eps) -> float:
    return _check_real("eps", eps, "a finite number >= 0", lambda e: math.isfinite(e) and e >= 0)


def check_weight_offset(weight_offset) -> float:
    """A finite float (each distinct value is a compiled kernel variant)."""
    return _check_real("weight_offset", weight_offset)


def check_dw_dtype(dw_dtype) -> torch.dtype:
    if dw_dtype not in ACT_DTYPES:
        raise TypeError(f"dw_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dw_dtype}")
    return dw_dtype


def check_count(name: str, value, low: int, high: int | None = None) -> int:
    """An int (not a bool) in [low, high]: TypeError for the wrong kind, ValueError out of range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value}")
    return value


def check_output(name: str, t, shape, dtype, device) -> None:
    check_tensor(name, t, dtypes=(dtype,), device=device)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_like(name: str, t, x) -> None:
    """``t`` has x's dtype, device and shape."""
    check_output(name, t, x.shape, x.dtype, x.device)


def check_rstd(rstd, rows: int, device) -> None:
    check_tensor("rstd", rstd, dtypes=(torch.float32,), device=device)
    if rstd.dim() != 1 or rstd.shape[0] != rows:
        raise ValueError(f"rstd must have shape ({rows},) (one FP32 value per row), got {tuple(rstd.shape)}")


def kernel_view(t: torch.Tensor, vec: int) -> torch.Tensor:
    """A (rows, H) view the kernels can read in place, or a contiguous copy when the layout forbids it.

    In place: last dim contiguous, leading dims collapsible to one row stride (0 for an expanded
    tensor), base and row stride aligned to the vector width."""
    hidden = t.shape[-1]
    if t.is_contiguous() and t.data_ptr() % (vec * t.element_size()) == 0:
        return t if t.dim() == 2 else t.view(-1, hidden)
    try:
        view = t.view(-1, hidden) if t.dim() != 2 else t
    except RuntimeError:
        view = None
    if view is not None and _is_kernel_layout(view, vec):
        return view
    return t.reshape(-1, hidden).contiguous()


def _is_kernel_layout(view: torch.Tensor, vec: int) -> bool:
    if view.shape[1] > 1 and view.stride(1) != 1:
        return False
    row_stride = view.stride(0)
    if view.shape[0] > 1 and row_stride % vec != 0:
        return False
    return view.data_ptr() % (vec * view.element_size()) == 0


def is_direct_output(t: torch.Tensor, vec: int) -> bool:
    """A caller-owned output the kernel may write directly: contiguous and vector aligned."""
    return t.is_contiguous() and t.data_ptr() % (vec * t.element_size()) == 0


def vector_align_bytes(vec: int, element_size: int) -> int:
    """The base alignment the kernels assume for a vector of ``vec`` elements (capped at 16 bytes)."""
    return min(16, vec * element_size)


def aligned_vector(w: torch.Tensor, vec: int) -> torch.Tensor:
    """w as the kernels read it: contiguous with an aligned base (a copy only when it is not)."""
    if w.is_contiguous() and w.data_ptr() % vector_align_bytes(vec, w.element_size()) == 0:
        return w
    return w.clone(memory_format=torch.contiguous_format)
