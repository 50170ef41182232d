"""The cast policies: the roundings and output dtype of the module a norm replaces, around the kernels.

A module's entry checks its tensors once (``calls.module_call``) and hands the checked call here. Every
policy is one kernel call (or its PyTorch math) on tensors derived from the checked ones, then the
replaced module's own rounding and scale in torch operations.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .autograd import run
from .calls import NormCall
from .routing import MATH, route
from .runtime.views import kernel_weight

# The cast policies: which roundings the replaced module does around its scale (``CakeRMSNorm.cast_policy``).
TORCH = "torch"  # torch.nn.RMSNorm: output in the input's dtype; FP32 where CUDA autocast lists rms_norm
ROUND_THEN_SCALE = "round_then_scale"  # HF Llama family: weight * xhat.to(input dtype)
SCALE_THEN_ROUND = "scale_then_round"  # HF Gemma family, L2 norms: (xhat * (offset + weight)).to(input dtype)
T5 = "t5"  # HF T5LayerNorm: weight * xhat.to(weight dtype if fp16/bf16 else FP32)
CAST_POLICIES = (TORCH, ROUND_THEN_SCALE, SCALE_THEN_ROUND, T5)
_HALF = (torch.float16, torch.bfloat16)

# What a compiled graph runs for a norm (``CakeRMSNorm.compiled_as``): the kernels' custom op, or the
# norm's PyTorch math, which inductor fuses with its neighbours (a custom op cannot join that fusion).
KERNEL = "kernel"
TORCH_MATH = "torch"
COMPILED_AS = (KERNEL, TORCH_MATH)


def check_cast_policy(cast_policy) -> str:
    """``cast_policy`` if it is one of ``CAST_POLICIES``, else a ValueError."""
    if cast_policy not in CAST_POLICIES:
        raise ValueError(f"cast_policy must be one of {', '.join(CAST_POLICIES)}; got {cast_policy!r}")
    return cast_policy


class NormForm(NamedTuple):
    """What a norm computes besides its tensors: ``CakeRMSNorm``'s settings or a Hugging Face norm's."""

    eps: float
    weight_offset: float = 0.0
    cast_policy: str = TORCH
    compiled_as: str = KERNEL
    memory_efficient: bool = False


class Roundings(NamedTuple):
    """What a module does around its kernel call, in torch operations."""

    round_to: torch.dtype | None = None  # the kernel's output rounded to this dtype
    scale: torch.Tensor | None = None  # then multiplied by this scale (torch's promoted dtype)
    h: torch.Tensor | None = None  # the residual sum the module returns beside y, where it added it
    done: torch.Tensor | None = None  # y computed without a kernel call


def rmsnorm_with_casts(call: NormCall, form: NormForm):
    """The RMSNorm of a checked module call with the roundings and output dtype of the module
    ``form.cast_policy`` names: y, or ``(y, x + residual)``; ``form`` is trusted (checked when set).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        y, or ``(y, h)``, shaped like ``call.x``.
    """
    one_row = call.x.dim() == 1  # [H]: one row for the kernels, the outputs back in x's shape
    if one_row:
        residual = call.residual
        call = call._replace(
            x=call.x.unsqueeze(0), residual=None if residual is None else residual.unsqueeze(0)
        )
    kernel, around = _cast_plan(call, form)
    if kernel is None:
        out = around.done
    else:
        # The kernel or, traced as torch math, its PyTorch math: either runs under the same casts, so
        # the output dtypes and roundings are the same.
        as_math = form.compiled_as == TORCH_MATH and torch.compiler.is_compiling()
        path = MATH if as_math else route(kernel.x, kernel.w)
        out = run(kernel, path)
    if around is not None:
        if around.round_to is not None:
            out = out.to(around.round_to)
        if around.scale is not None:
            out = around.scale * out
        if around.h is not None:
            out = (out, around.h)
    if not one_row:
        return out
    if isinstance(out, torch.Tensor):
        return out.squeeze(0)
    y, h = out
    return y.squeeze(0), h.squeeze(0)


def _cast_plan(call: NormCall, form: NormForm) -> tuple[NormCall | None, Roundings | None]:
    """How the module ``form.cast_policy`` names computes ``call``: ``(kernel call, what it does around
    it)``; nothing around it where the module's roundings are the kernels'."""
    x, residual = call.x, call.residual
    w = x.new_ones(x.shape[-1]) if call.w is None else call.w
    if x.dtype == torch.float64 and form.cast_policy != TORCH:
        return _float64_under_hf_casts(call._replace(w=w), form.cast_policy)
    rounding = _rounding_dtype(form.cast_policy, x, w)
    if rounding is None or w.dtype == rounding == x.dtype:
        # The kernels' own math: the scale, then one rounding to x's dtype (where the replaced module
        # rounds before and after a bf16/fp16 scale, the last bit may differ). A weight in neither
        # x's dtype nor FP32 joins the FP32 compute exactly.
        kernel_w = kernel_weight(w, x)
        return (call if kernel_w is call.w else call._replace(w=kernel_w)), None
    # The replaced module rounds the normalized values to `rounding`, then scales in torch's
    # promoted dtype: torch's add, then the kernel, then (below FP32) torch's multiply. In the
    # memory-efficient mode the kernel saves its own output: in the FP32 branch that is the
    # module's y, below FP32 the unit-scale xhat before the multiply (docs/memory.md).
    h = x if residual is None else x + residual
    if rounding == torch.float32:
        # FP32 normalized values times the scale, rounded to FP32 once: the kernel's FP32 math.
        kernel = call._replace(x=h.float(), w=w.float(), residual=None)
        return kernel, Roundings(h=_returned(h, residual))
    source = h if rounding == h.dtype else h.float()
    return _round_then_scale(call, source, rounding, w, h)


def _float64_under_hf_casts(call: NormCall, cast_policy: str) -> tuple[NormCall | None, Roundings]:
    """FP64 activations under a Hugging Face class's casts, which compute the statistics from an FP32
    cast: FP32 math, as the stock norm's."""
    residual = call.residual
    h = call.x if residual is None else call.x + residual
    w, source = call.w, h.float()
    if cast_policy == T5:  # the FP32 rstd times the FP64 input, then the weight
        y = w * (h * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + call.eps))
        return None, Roundings(h=_returned(h, residual), done=y)
    if cast_policy == SCALE_THEN_ROUND:  # all in FP32, cast back once
        kernel = call._replace(x=source, w=w.float(), residual=None)
        return kernel, Roundings(round_to=h.dtype, h=_returned(h, residual))
    # ROUND_THEN_SCALE: the FP32 normalized values cast back, then the FP64 weight
    return _round_then_scale(call, source, h.dtype, w, h)


def _round_then_scale(call: NormCall, source, rounding: torch.dtype, w, h) -> tuple[NormCall, Roundings]:
    """``source`` normalized with a unit scale, rounded to ``rounding``, then times the module's scale."""
    unit = call._replace(x=source, w=source.new_ones(source.shape[-1]), residual=None, weight_offset=0.0)
    offset = call.weight_offset
    scale = w if offset == 0.0 else w + offset
    return unit, Roundings(round_to=rounding, scale=scale, h=_returned(h, call.residual))


def _returned(h: torch.Tensor, residual) -> torch.Tensor | None:
    """The h a module returns beside y: the residual sum in residual mode, else nothing."""
    return None if residual is None else h


@functools.cache
def _cuda_autocast_lists_rms_norm() -> bool:
    """Whether this torch's CUDA autocast runs rms_norm in FP32 (2.13's does, 2.11's does not)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")


def _cuda_autocast(x: torch.Tensor) -> bool:
    """Whether torch's CUDA autocast would run ``torch.nn.RMSNorm`` on x in FP32."""
    return x.is_cuda and torch.is_autocast_enabled("cuda") and _cuda_autocast_lists_rms_norm()


def _rounding_dtype(cast_policy: str, x, w) -> torch.dtype | None:
    """The dtype the replaced module rounds to before scaling, or None when it scales first."""
    if cast_policy == TORCH:
        # Where CUDA autocast lists rms_norm, torch runs it on FP32 casts of its inputs: an FP32 output.
        return torch.float32 if _cuda_autocast(x) else None
    if cast_policy == ROUND_THEN_SCALE:
        return x.dtype
    if cast_policy == T5:
        return w.dtype if w.dtype in _HALF else torch.float32
    return None
