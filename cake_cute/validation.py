"""The one place that validates and normalizes inputs, before anything is launched or written.

Every check names the argument and what was expected. A tensor of the wrong dtype, shape or device
raises ``ArgumentError`` (both a ``ValueError``, FlashInfer's contract, and a ``TypeError``); an
argument of the wrong kind raises ``TypeError``; a scalar out of range, an unusable alignment or an
unsupported device ``ValueError``. The public entries turn their arguments into one call value
(``calls``), which the layers below trust.
"""

from __future__ import annotations

import math
import numbers

import torch

from .kernels.config import MAX_G_PARTS as MAX_GRADIENT_PARTS
from .kernels.gated_config import MAX_SEGMENT
from .kernels.quant_config import QUANT_RECIPES
from .kernels.tiling import MAX_HIDDEN, VECTOR_BYTES
from .runtime.device import device_facts
from .vocab import DTYPE_BY_TORCH, GATE_ACTIVATIONS, MATH_ONLY_DTYPES

# The FP8 scale layouts (``fp8_numerics``) and the recipes each one holds.
SCALE_LAYOUTS = {"compact": tuple(QUANT_RECIPES), "cublas": ("mxfp8",), "deepgemm": ("1x128",)}


class ArgumentError(ValueError, TypeError):
    """A tensor argument of the wrong dtype, shape or device: both a ValueError and a TypeError."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, *, dtypes=None, device: torch.device | None = None) -> None:
    """``t`` is a tensor (else ``TypeError``) of one of ``dtypes`` on ``device`` (else ``ArgumentError``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(dict.fromkeys(map(_dtype_name, dtypes)))  # w's (x.dtype, fp32) may repeat
        raise ArgumentError(f"{name} must have dtype {allowed}; got {_dtype_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ArgumentError(f"{name} must be on the same device as x ({device}), got {t.device}")


_ALL_DTYPES = (*DTYPE_BY_TORCH, *MATH_ONLY_DTYPES)


# The exact types of plain tensors: one set lookup each on the hot path, where the isinstance check
# runs only for other types (a DTensor, or not a tensor at all).
PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def check_tensor_kinds(x, w, residual=None) -> None:
    """x and w are tensors and residual is None or one, else a TypeError naming the argument: the first
    fact an entry checks, before routing reads the tensors."""
    if type(x) not in PLAIN_TENSOR_TYPES:
        check_tensor("x", x)
    if type(w) not in PLAIN_TENSOR_TYPES:
        check_tensor("w", w)
    if residual is not None and type(residual) not in PLAIN_TENSOR_TYPES:
        check_tensor("residual", residual)


def check_activation(x, *, torch_math: bool = False, name: str = "x") -> None:
    """x (named ``name``): bf16/fp16/fp32 (FP64 with ``torch_math``), at least 1-D, 1 <= H <= 262144.
    The device is checked later, so the argument errors can be exercised without a GPU."""
    check_tensor(name, x, dtypes=_ALL_DTYPES if torch_math else DTYPE_BY_TORCH)
    if x.dim() < 1:
        raise ArgumentError(f"{name} must have at least 1 dim [..., H], got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ArgumentError(f"{name}'s hidden size (last dim) must be in [1, {MAX_HIDDEN}], got {hidden}")


def check_weight(w, x, name: str = "w", *, any_dtype: bool = False) -> None:
    """The weight (named ``name``): ``[H]`` in x's dtype or fp32 (``any_dtype``: any floating dtype the
    math takes, as a module's casts do), on x's device."""
    check_tensor(name, w, dtypes=_ALL_DTYPES if any_dtype else (x.dtype, torch.float32), device=x.device)
    if w.dim() != 1 or w.shape[0] != x.shape[-1]:
        raise ArgumentError(
            f"{name} must have shape ({x.shape[-1]},) to match x's last dim, got {tuple(w.shape)}"
        )


def _check_real(name: str, value, rule: str = "a finite number", ok=math.isfinite) -> float:
    if torch.compiler.is_compiling():
        # While dynamo traces, a float may be a symbol (dynamic=True) that cannot be tested without
        # breaking the graph: the op's fake kernel tests the value the graph runs with.
        return value
    # A plain float skips the numbers.Real ABC check, which is slow on the hot path.
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
    if dw_dtype not in DTYPE_BY_TORCH:
        raise TypeError(f"dw_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dw_dtype}")
    return dw_dtype


def check_count(name: str, value, low: int | None, high: int | None = None) -> int:
    """An int (not a bool) in [low, high] (None: unbounded below)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if low is None:
        return value
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value}")
    return value


def check_output(name: str, t, shape, dtype, device) -> None:
    check_tensor(name, t, dtypes=(dtype,), device=device)
    if tuple(t.shape) != tuple(shape):
        raise ArgumentError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_like(name: str, t, x) -> None:
    """t is a tensor of x's shape, dtype and device."""
    if type(t) in PLAIN_TENSOR_TYPES and t.shape == x.shape and t.dtype == x.dtype and t.device == x.device:
        return  # the hot path: a plain tensor laid out like x, tested without building the expected values
    check_output(name, t, x.shape, x.dtype, x.device)


def check_gradient_parts(g, x) -> tuple:
    """``g`` as the tuple of its summands: one tensor, or 1 to ``MAX_GRADIENT_PARTS`` tensors like x."""
    if isinstance(g, torch.Tensor):
        check_like("g", g, x)
        return (g,)
    if not isinstance(g, (list, tuple)) or not 1 <= len(g) <= MAX_GRADIENT_PARTS:
        raise TypeError(
            f"g must be a tensor or a list / tuple of 1 to {MAX_GRADIENT_PARTS} tensors (its summands), "
            f"got {type(g).__name__}" + (f" of length {len(g)}" if isinstance(g, (list, tuple)) else "")
        )
    for i, part in enumerate(g):
        check_like(f"g[{i}]", part, x)
    return tuple(g)


def check_forward_outputs(x, rows: int, residual, out, rstd, residual_out) -> None:
    """The forward's caller-owned outputs (each may be None): y and h_new like x, FP32 rstd per row."""
    if residual is None and residual_out is not None:
        raise ValueError("residual_out is only written in residual mode: pass residual= as well")
    for name, given, shape, dtype in (
        ("out", out, x.shape, x.dtype),
        ("rstd", rstd, (rows,), torch.float32),
        ("residual_out", residual_out, x.shape, x.dtype),
    ):
        if given is not None:
            check_output(name, given, shape, dtype, x.device)


def check_backward_outputs(x, dx, dw, dw_dtype: torch.dtype) -> None:
    """The backward's caller-owned outputs (each may be None): dx like x, dw ``[H]`` of ``dw_dtype``."""
    if dx is not None:
        check_like("dx", dx, x)
    if dw is not None:
        check_output("dw", dw, (x.shape[-1],), dw_dtype, x.device)


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool (an int, None or a string is refused), else a TypeError naming ``name``."""
    if value is not True and value is not False:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_module(name: str, value) -> None:
    """``value`` is a ``torch.nn.Module``, else a TypeError naming ``name``."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def check_factory_arguments(device, dtype) -> None:
    """A module constructor's ``device`` and ``dtype``, as torch's modules take them."""
    if device is not None and not isinstance(device, torch.device):
        if isinstance(device, bool) or not isinstance(device, (str, int)):
            raise TypeError(f"device must be a torch.device, str or int, got {type(device).__name__}")
        try:
            torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device must name a device, got {device!r}") from err
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype (of a learned weight), got {dtype}")


def check_memory_efficient(memory_efficient) -> bool:
    """The memory-efficient mode's switch: a bool, else a TypeError."""
    check_bool("memory_efficient", memory_efficient)
    return memory_efficient


def refuse_memory_efficient_fp8(memory_efficient) -> None:
    """The forward to FP8 has no memory-efficient mode (xhat cannot be recomputed from e4m3 data):
    TypeError for a non-bool, ValueError for True."""
    if check_memory_efficient(memory_efficient):
        raise ValueError(
            "memory_efficient=True is not available for cake_rmsnorm_fp8: the mode recomputes xhat from the "
            "saved output, and an e4m3 output would lose its error bound; the FP8 forward saves x (or h_new)"
        )


def check_rstd(rstd, rows: int, device) -> None:
    check_tensor("rstd", rstd, dtypes=(torch.float32,), device=device)
    if rstd.dim() != 1 or rstd.shape[0] != rows:
        raise ArgumentError(
            f"rstd must have shape ({rows},) (one FP32 value per row), got {tuple(rstd.shape)}"
        )


def check_workspace(workspace, device) -> None:
    """A backward workspace: contiguous 1-D uint8 on x's device, 16-byte aligned."""
    check_tensor("workspace", workspace, dtypes=(torch.uint8,), device=device)
    if workspace.dim() != 1 or not workspace.is_contiguous() or workspace.data_ptr() % VECTOR_BYTES != 0:
        raise ValueError(
            f"workspace must be a contiguous 1-D uint8 tensor with a {VECTOR_BYTES}-byte aligned base"
        )


def check_workspace_size(workspace, needed: int) -> None:
    """The workspace holds the ``needed`` bytes of partial rows the launch plan writes."""
    if workspace.numel() < needed:
        raise ValueError(f"workspace holds {workspace.numel()} bytes; this call needs at least {needed}")


def check_recipe(recipe) -> str:
    """An FP8 recipe: a key of ``kernels.quant_config.QUANT_RECIPES``."""
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a str, one of {tuple(QUANT_RECIPES)}; got {type(recipe).__name__}")
    if recipe not in QUANT_RECIPES:
        raise ValueError(f"recipe must be one of {tuple(QUANT_RECIPES)}, got {recipe!r}")
    return recipe


def check_scale_layout(scale_layout, recipe: str) -> str:
    """A scale layout of ``cake_rmsnorm_fp8`` that ``recipe`` (already checked) can be written in."""
    if not isinstance(scale_layout, str):
        raise TypeError(
            f"scale_layout must be a str, one of {tuple(SCALE_LAYOUTS)}; got {type(scale_layout).__name__}"
        )
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {tuple(SCALE_LAYOUTS)}, got {scale_layout!r}")
    if recipe not in SCALE_LAYOUTS[scale_layout]:
        raise ValueError(
            f"scale_layout={scale_layout!r} is for recipe {SCALE_LAYOUTS[scale_layout][0]!r}, not {recipe!r}"
        )
    return scale_layout


def check_cuda_device(device) -> torch.device:
    """``device`` as a ``torch.device`` naming an existing CUDA device."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device must name a CUDA device, got {device!r}")
        device = torch.device("cuda", device)
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device must name a CUDA device, got {device!r}") from err
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device is available to this torch")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {device} does not exist: {count} CUDA device(s) are visible")
    return device


def is_cake_rmsnorm_train_supported(device, hidden=None) -> bool:
    """Whether cake_cute can run on ``device`` (and, when given, at this hidden size). Never raises.

    Parameters
    ----------
    device : torch.device, str or int
        The device to ask about (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)``, ``1``).
    hidden : int, optional
        A hidden size (the last dim of x); supported when 1 <= hidden <= 262144.

    Returns
    -------
    bool
        True for an existing sm_90 / sm_100 / sm_103 CUDA device (and a supported ``hidden``); False
        for anything else, including arguments that name no device.
    """
    try:
        device = check_cuda_device(device)
        if hidden is not None:
            check_count("hidden", hidden, 1, MAX_HIDDEN)
    except (TypeError, ValueError):
        return False
    return device_facts(device).arch is not None


def check_gate_activation(activation) -> str:
    """A gated norm's gate activation: one of ``vocab.GATE_ACTIVATIONS``, else a ValueError."""
    if not isinstance(activation, str) or activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    return activation


def check_group_size(group_size, hidden: int) -> int:
    """``group_size`` (None: H, one group per row) as an int dividing H, at most ``MAX_SEGMENT``."""
    if group_size is None:
        group_size = hidden
    check_count("group_size", group_size, 1, MAX_SEGMENT)
    if hidden % group_size:
        raise ValueError(f"group_size must divide x's hidden size {hidden}, got {group_size}")
    return group_size
