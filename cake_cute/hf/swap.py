"""``swap_rmsnorm``: ``CakeRMSNorm`` in place of the RMSNorm modules of an existing model (PyTorch's and
Hugging Face's), their eps, weight offset and cast policy read from their forward's source, with a
warning for the norm-shaped modules left alone.

Swap before parallelizing: the parallel styles and FSDP replace parameters and hook the modules they
see, so a module swapped in afterwards would bypass them; a model whose norm weights are already
DTensors is refused. Per-head q / k norms are marked to run as their PyTorch math inside compiled
graphs, where inductor fuses them with the reshape, transpose and RoPE around them.
"""

from __future__ import annotations

import functools
import itertools
import re
import warnings

import torch
from torch import nn

from .. import validation as v
from ..casts import ROUND_THEN_SCALE, SCALE_THEN_ROUND, T5, TORCH, TORCH_MATH, NormForm
from ..module import CakeRMSNorm, check_compiled_as
from .norm_reading import SQUARES as _SQUARES
from .norm_reading import NormNotServed
from .norm_reading import averages_squares as _averages_squares
from .norm_reading import forward_source as _forward_source
from .norm_reading import hf_eps as _hf_eps
from .norm_reading import hf_weight as _hf_weight

# "(1.0 + self.weight" or "self.weight.float() + 1": the Gemma-style scale (1 + w).
_ONE_PLUS_WEIGHT = re.compile(
    r"(?<![\w.])1(\.0*)?\s*\+\s*self\.weight\b|\bself\.weight(\.\w+\(\))?\s*\+\s*1(\.0*)?\b"
)


def _is_hf_norm_shaped(module: nn.Module) -> bool:
    """A Hugging Face-style norm: a class name ending in "Norm", a float ``variance_epsilon`` or ``eps``,
    no submodules, one 1-D ``weight`` or nothing learnable."""
    return (
        type(module).__name__.endswith("Norm")
        and _hf_eps(module) is not None
        and next(module.children(), None) is None
        and (_hf_weight(module) is not None or next(module.parameters(recurse=False), None) is None)
    )


# A forward's source is an RMSNorm's when it shows a reciprocal square root of the squares averaged over
# the last dimension (``_averages_squares``); these tell the recognized forms apart.
_SUM_OF_SQUARES = re.compile(_SQUARES + r"\.sum\((dim=)?-1")
_MEAN_SUBTRACTED = re.compile(r"- mean\b|\.var\(")
_RSTD_ROUNDED = re.compile(r"rsqrt\(.*?keepdim=True\) \+ self\.\w+\)\.(to|type_as)\(")
# "(1.0 + self.weight).float()": 1 + w rounded to a bf16 / fp16 weight's dtype before it is widened.
_OFFSET_IN_WEIGHT_DTYPE = re.compile(r"\(1(\.0*)?\s*\+\s*self\.weight\)\.(float\(\)|to\()")
_NORM_OF_INPUT = re.compile(r"self\._norm\((x|hidden_states)(\.float\(\)|\.to\(torch\.float32\))?\)")
_T5_CAST = re.compile(r"if self\.weight\.dtype in")
_ROUND_THEN_SCALE = re.compile(
    r"self\.weight \* \w+\.to\(\w+\)$|\.(to|type_as)\(\w+\) \* self\.weight\b"
    r"|\.type_as\((\w+)\) return \w+ \* self\.weight$"
)


def _hf_form(module: nn.Module) -> str | None:
    """The cast policy of a norm-shaped module, or None when its forward is not an RMSNorm."""
    return _class_form(type(module), _hf_weight(module) is not None, _is_grouped(module))


def _is_grouped(module: nn.Module) -> bool:
    return getattr(module, "group_size", None) is not None


def _class_form(cls: type, weighted: bool, grouped: bool) -> str | None:
    """``_hf_form`` of an instance of ``cls``; without readable source a weighted "...RMSNorm" class is
    taken as one, with Gemma's casts when its name says Gemma."""
    source = _forward_source(cls)
    if source is None:
        if not (weighted and cls.__name__.endswith("RMSNorm")):
            return None
        return SCALE_THEN_ROUND if "Gemma" in cls.__name__ else ROUND_THEN_SCALE
    if not _computes_an_rms(source) or _hf_refusal(source, grouped) is not None:
        return None
    if not weighted:
        return SCALE_THEN_ROUND  # a unit scale: computed in FP32, rounded once
    if _T5_CAST.search(source):
        return T5
    return ROUND_THEN_SCALE if _ROUND_THEN_SCALE.search(source) else SCALE_THEN_ROUND


def hf_rmsnorm_reading(module: nn.Module) -> NormForm:
    """The eps, weight offset and cast policy of a Hugging Face RMSNorm, read as ``swap_rmsnorm`` reads
    them, for a kernel-route layer computing in place of its class. Where ``swap_rmsnorm`` would guess
    the offset, this raises ``NormNotServed`` (as for a module that is no RMSNorm), naming the class and
    the reason."""
    cls = type(module)
    if not _is_hf_norm_shaped(module):
        raise NormNotServed(
            f"{cls.__name__}: it is not shaped as a Hugging Face RMSNorm (a class named ...Norm holding a "
            "float variance_epsilon or eps, no submodules, and one 1-D weight or no parameter)"
        )
    cast_policy, weight_offset = _route_reading(cls, _hf_weight(module) is not None, _is_grouped(module))
    return NormForm(v.check_eps(_hf_eps(module)), weight_offset, cast_policy)


@torch.compiler.assume_constant_result
def _route_reading(cls: type, weighted: bool, grouped: bool) -> tuple[str, float]:
    """``hf_rmsnorm_reading``'s reading of the class, a constant to torch.compile."""
    return _cached_route_reading(cls, weighted, grouped)


@functools.cache
def _cached_route_reading(cls: type, weighted: bool, grouped: bool) -> tuple[str, float]:
    policy = _class_form(cls, weighted, grouped)
    if policy is None:
        reason = _hf_refusal(_forward_source(cls), grouped)
        raise NormNotServed(f"{cls.__name__}: {reason or 'its forward is not an RMSNorm'}")
    offset, guessed = _hf_weight_offset(cls) if weighted else (0.0, False)
    if guessed:
        raise NormNotServed(
            f"{cls.__name__}: its forward does not show whether it scales by weight or by 1 + weight"
        )
    return policy, offset


def _computes_an_rms(source: str) -> bool:
    return "rsqrt" in source and _averages_squares(source) and not _MEAN_SUBTRACTED.search(source)


def _hf_refusal(source: str | None, grouped: bool) -> str | None:
    """Why a norm-shaped module computing an rsqrt is not swapped, or None."""
    if source is None or "rsqrt" not in source or _MEAN_SUBTRACTED.search(source):
        return None
    if not _averages_squares(source):
        if _SUM_OF_SQUARES.search(source):
            return "it divides by the root of the sum of squares (an L2 norm), not of their mean"
        return "its forward does not average the squares over the last dimension"
    if grouped:
        return "it normalizes groups of group_size channels, not the whole last dimension"
    if "return torch.rsqrt" in source:
        return "it returns the reciprocal RMS, not the normalized input"
    if _RSTD_ROUNDED.search(source):
        return "it rounds the reciprocal RMS to the input dtype before scaling by it"
    if "self._norm(" in source and not _NORM_OF_INPUT.search(source):
        return "it scales its input before normalizing it"
    if _OFFSET_IN_WEIGHT_DTYPE.search(source):
        return "it adds 1 to the weight in the weight's dtype, rounding the scale of a bf16 / fp16 weight"
    return None


# The weight read as a value (not its dtype or device), and the reads that multiply by it directly:
# "self.weight * x", "x * self.weight", "(self.weight.to(torch.float32) * x".
_WEIGHT_VALUE = re.compile(r"\bself\.weight\b(?!\.(dtype|device|shape)\b)")
_TIMES_WEIGHT = re.compile(r"\* \(?self\.weight\b|\bself\.weight(\.\w+\([\w.]*\))* \*")


def _hf_weight_offset(cls: type) -> tuple[float, bool]:
    """``(offset, guessed)``: 1.0 when ``cls`` scales by ``1 + weight``, else 0.0; ``guessed`` when the
    source does not show which.

    The source decides, because class names mislead both ways (Gemma3n's scales by plain ``weight``,
    Qwen3-Next's by ``1 + weight``). Without readable source the guess follows the class name, "Gemma"
    meaning ``1 + weight``."""
    source = _forward_source(cls)
    if source is None:
        return (1.0 if "Gemma" in cls.__name__ else 0.0), True
    if _ONE_PLUS_WEIGHT.search(source):
        return 1.0, False
    reads = len(_WEIGHT_VALUE.findall(source))
    return 0.0, reads == 0 or reads != len(_TIMES_WEIGHT.findall(source))


def _wrapping(weight: nn.Parameter, eps, weight_offset: float, cast_policy: str) -> CakeRMSNorm:
    """A CakeRMSNorm that holds ``weight`` itself (optimizer state and weight tying stay valid)."""
    new = CakeRMSNorm(
        weight.shape[0], eps=eps, weight_offset=weight_offset, device="meta", cast_policy=cast_policy
    )
    new.weight = weight
    return new


def _is_swappable(module: nn.Module) -> bool:
    if isinstance(module, CakeRMSNorm):
        return False
    if isinstance(module, nn.RMSNorm):
        return len(module.normalized_shape) == 1
    return _is_hf_norm_shaped(module) and _hf_form(module) is not None


def _replacement(module: nn.Module, buffer_device: torch.device, weight_offset) -> CakeRMSNorm:
    """The CakeRMSNorm to put in place of a swappable ``module``; ``weight_offset`` was decided."""
    if not isinstance(module, nn.RMSNorm):
        policy, eps = _hf_form(module), _hf_eps(module)
        if _hf_weight(module) is None:  # weightless (Llama4TextL2Norm): a unit scale for any H
            new = CakeRMSNorm(None, eps=eps, elementwise_affine=False, cast_policy=policy)
        else:
            new = _wrapping(module.weight, eps, weight_offset, policy)
    elif module.weight is None:
        new = CakeRMSNorm(
            module.normalized_shape, eps=module.eps, elementwise_affine=False, device=buffer_device
        )
    else:
        new = _wrapping(module.weight, module.eps, weight_offset, TORCH)
    return new.train(module.training)


def _warn_refused(model: nn.Module, entry: str) -> None:
    """One warning naming the norm-shaped classes left alone and why, at the line that called ``entry``."""
    refused = {}
    for module in model.modules():
        if not isinstance(module, CakeRMSNorm) and _is_hf_norm_shaped(module):
            reason = _hf_refusal(_forward_source(type(module)), _is_grouped(module))
            if reason is not None:
                refused[type(module).__name__] = reason
    if refused:
        listed = "; ".join(f"{name}: {reason}" for name, reason in sorted(refused.items()))
        warnings.warn(f"{entry} left these norms alone ({listed})", UserWarning, stacklevel=_CALLER)


def _refuse_parallelized(name: str, module: nn.Module) -> None:
    """A weight that is already a DTensor means parallelize_module / fully_shard ran first."""
    from torch.distributed.tensor import DTensor

    if isinstance(getattr(module, "weight", None), DTensor):
        raise ValueError(
            f"{name} ({type(module).__name__}) has a DTensor weight: swap_rmsnorm must run before "
            "parallelize_module / fully_shard, which replace parameters and hook the modules they see"
        )


def _decided_offsets(swappable, weight_offset, entry: str) -> dict[nn.Module, float]:
    """Each swappable module's weight_offset, with one warning naming the classes guessed."""
    if weight_offset is not None:
        offset = v.check_weight_offset(weight_offset)
        return dict.fromkeys(swappable, offset)
    decided, guessed = {}, set()
    for m in swappable:
        if isinstance(m, nn.RMSNorm) or _hf_weight(m) is None:  # no offset to read: 0.0, exactly
            decided[m] = 0.0
            continue
        decided[m], is_guess = _hf_weight_offset(type(m))
        if is_guess:
            guessed.add(f"{type(m).__name__}: {decided[m]}")
    if guessed:
        warnings.warn(
            f"{entry} guessed weight_offset from the forward source or class name of "
            f"{', '.join(sorted(guessed))}; "
            "pass weight_offset= (1.0 for a 1 + weight scale, else 0.0) to decide it explicitly",
            UserWarning,
            stacklevel=_CALLER,
        )
    return decided


# The stack level of the line that called swap_rmsnorm or fuse_residual_rmsnorm, seen from a warning
# raised in a helper of _swap_norms: the helper, _swap_norms, the entry point, its caller.
_CALLER = 4


# The name of a weightless norm (which has no size to compare with head_dim) over the heads of q, k or v.
_HEAD_NORM_NAME = re.compile(r"(q|k|v|qk|kv|query|key|value)_?(layer_?)?norm")


def _head_dim(module: nn.Module) -> int | None:
    """The head_dim of an attention module (its own attribute, else its config's), or None."""
    for owner in (module, getattr(module, "config", None)):
        value = getattr(owner, "head_dim", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _normalized_size(module: nn.Module) -> int | None:
    """The H a swappable module normalizes, or None for a weightless Hugging Face norm (any H)."""
    if isinstance(module, nn.RMSNorm):
        return module.normalized_shape[0]
    weight = _hf_weight(module)
    return None if weight is None else weight.shape[0]


def _is_per_head(parent: nn.Module, name: str, norm: nn.Module) -> bool:
    """Whether ``parent.<name>`` normalizes each head: its size is the holding module's head_dim, or,
    weightless, it is named as a q / k / v norm."""
    head_dim = _head_dim(parent)
    if head_dim is None:
        return False
    size = _normalized_size(norm)
    return size == head_dim if size is not None else _HEAD_NORM_NAME.fullmatch(name) is not None


def _model_device(model: nn.Module) -> torch.device:
    """Where a swapped module without weights keeps its ones buffer: with the model's first tensor."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def swap_rmsnorm(
    model: nn.Module,
    weight_offset: float | None = None,
    *,
    compiled_head_norms: str = TORCH_MATH,
    memory_efficient: bool = False,
) -> int:
    """Replace, in place, every ``torch.nn.RMSNorm`` over one dimension and every Hugging Face-style
    RMSNorm-shaped module of ``model`` with a ``CakeRMSNorm`` keeping its weight Parameter, eps, offset,
    casts and training mode.

    Per-head q / k norms get ``compiled_as=compiled_head_norms``. A module used in several places is
    replaced by one CakeRMSNorm everywhere; hooks do not carry over. Norm-shaped modules that are not
    RMSNorms are left alone, with one ``UserWarning`` naming each class and the reason.

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place.
    weight_offset : float, optional
        The scale of every swapped module is ``weight + weight_offset``. None: 0.0 for
        ``torch.nn.RMSNorm``, else what the forward's source shows, or a guess named in a ``UserWarning``.
    compiled_head_norms : str
        What a compiled graph runs for per-head norms: ``"torch"`` (default: their PyTorch math, left to
        inductor) or ``"kernel"``.
    memory_efficient : bool
        Every swapped norm saves its output instead of its input.

    Returns
    -------
    int
        How many modules were replaced.

    Raises
    ------
    ValueError
        ``model`` is itself an RMSNorm; a norm weight is already a DTensor; weight_offset is not
        finite; compiled_head_norms is neither ``"torch"`` nor ``"kernel"``.
    TypeError
        model is not a torch.nn.Module; weight_offset is not a number; memory_efficient is not a bool.
    """
    check_swap_arguments(model, weight_offset, compiled_head_norms, memory_efficient)
    return _swap_norms(model, weight_offset, compiled_head_norms, "swap_rmsnorm", memory_efficient)


def check_swap_arguments(model, weight_offset, compiled_head_norms, memory_efficient) -> None:
    """The arguments of ``swap_rmsnorm`` and ``fuse_residual_rmsnorm``, before the model is read."""
    v.check_module("model", model)
    if weight_offset is not None:
        v.check_weight_offset(weight_offset)
    check_compiled_as("compiled_head_norms", compiled_head_norms)
    v.check_memory_efficient(memory_efficient)


def _swap_norms(
    model: nn.Module, weight_offset, compiled_head_norms: str, entry: str, memory_efficient: bool
) -> int:
    """``swap_rmsnorm``'s work, called straight from the public entry ``entry`` so the warnings point at
    its caller."""
    if _is_swappable(model):
        raise ValueError("model is itself an RMSNorm; construct a CakeRMSNorm instead of swapping in place")
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent._modules.items()
        if child is not None and _is_swappable(child)
    ]
    if torch.distributed.is_available():
        for _, name, child in found:
            _refuse_parallelized(name, child)
    offsets = _decided_offsets(list(dict.fromkeys(child for _, _, child in found)), weight_offset, entry)
    device = _model_device(model)
    replaced: dict[nn.Module, CakeRMSNorm] = {}
    for parent, name, child in found:
        if child not in replaced:
            replaced[child] = _replacement(child, device, offsets[child])
            replaced[child].memory_efficient = memory_efficient
        if _is_per_head(parent, name, child):
            replaced[child].compiled_as = compiled_head_norms
        setattr(parent, name, replaced[child])
    _warn_refused(model, entry)
    return len(replaced)
