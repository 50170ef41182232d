"""``CakeRMSNorm``, a drop-in for ``torch.nn.RMSNorm``, and its cast policies: the roundings of the
module it replaces. Under torch.compile a norm traces to the kernels' custom op, or, where
``compiled_as`` says so, to its PyTorch math, which inductor can fuse with its neighbours.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from . import validation as v
from .autograd import cake_rmsnorm, rmsnorm_math
from .dispatch import prepare
from .forward_names import INPUT_NAME, with_input_named
from .runtime.views import kernel_weight

# torch.nn.RMSNorm's eps=None: the epsilon of ATen's compute type (opmath), FP32 for bf16, fp16 and fp32.
_DEFAULT_EPS = torch.finfo(torch.float32).eps

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


def _hidden_size(normalized_shape, elementwise_affine: bool) -> int | None:
    """The H of an int or 1-tuple ``normalized_shape``; None (any H) without a weight."""
    if normalized_shape is None and not elementwise_affine:
        return None
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    try:
        shape = tuple(shape)
    except TypeError:
        shape = ()
    if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int) or shape[0] < 1:
        raise ValueError(
            "normalized_shape must be a positive int or a 1-tuple (CakeRMSNorm normalizes over the last "
            f"dimension only; None only with elementwise_affine=False), got {normalized_shape!r}"
        )
    return shape[0]


def check_compiled_as(name: str, value) -> str:
    """``value`` if it is one of ``COMPILED_AS``; else a ValueError naming the argument ``name``."""
    if not (isinstance(value, str) and value in COMPILED_AS):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, COMPILED_AS))}; got {value!r}")
    return value


def _check_cast_policy(cast_policy) -> str:
    if cast_policy not in CAST_POLICIES:
        raise ValueError(f"cast_policy must be one of {', '.join(CAST_POLICIES)}; got {cast_policy!r}")
    return cast_policy


@functools.cache
def _cuda_autocast_lists_rms_norm() -> bool:
    """Whether this torch's CUDA autocast runs rms_norm in FP32 (2.13's does, 2.11's does not)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")


def _cuda_autocast(x: torch.Tensor) -> bool:
    """Whether torch's CUDA autocast would run ``torch.nn.RMSNorm`` on x in FP32."""
    return x.is_cuda and torch.is_autocast_enabled("cuda") and _cuda_autocast_lists_rms_norm()


class NormForm(NamedTuple):
    """What a norm computes besides its tensors: ``CakeRMSNorm``'s settings or a Hugging Face norm's."""

    eps: float
    weight_offset: float = 0.0
    cast_policy: str = TORCH
    compiled_as: str = KERNEL
    memory_efficient: bool = False


def rmsnorm_with_casts(
    x: torch.Tensor, w: torch.Tensor | None, form: NormForm, residual: torch.Tensor | None = None
):
    """The RMSNorm of ``x`` with the roundings and output dtype of the module ``form.cast_policy`` names:
    y, or ``(y, x + residual)``; ``cake_rmsnorm``'s errors."""
    if x.dim() != 1:
        return _rows_with_casts(x, w, form, residual)
    # [H]: one row for the kernels, and the outputs back in x's shape.
    out = _rows_with_casts(x.unsqueeze(0), w, form, None if residual is None else residual.unsqueeze(0))
    return out.squeeze(0) if residual is None else tuple(t.squeeze(0) for t in out)


def _rows_with_casts(x, w, form: NormForm, residual):
    """``rmsnorm_with_casts`` of ``[..., H]`` rows."""
    w = x.new_ones(x.shape[-1]) if w is None else w
    # The kernel or its PyTorch math: either runs under the same casts below, so the output dtypes
    # and roundings are the same.
    traced_as_math = form.compiled_as == TORCH_MATH and torch.compiler.is_compiling()
    if x.dtype == torch.float64 and form.cast_policy != TORCH:
        return _float64_under_hf_casts(traced_as_math, x, w, form, residual)
    rounding = _rounding_dtype(form.cast_policy, x, w)
    if rounding is None or w.dtype == rounding == x.dtype:
        # The kernels' own math: the scale, then one rounding to x's dtype (where the replaced module
        # rounds before and after a bf16/fp16 scale, the last bit may differ). A weight in neither
        # x's dtype nor FP32 joins the FP32 compute exactly.
        return _normalize(traced_as_math, x, kernel_weight(w, x), form, residual, form.weight_offset)
    # The replaced module rounds the normalized values to `rounding`, then scales in torch's
    # promoted dtype: torch's add, then the kernel, then (below FP32) torch's multiply. In the
    # memory-efficient mode the kernel saves its own output: in the FP32 branch that is the
    # module's y, below FP32 the unit-scale xhat before the multiply (docs/memory.md).
    h = x if residual is None else x + residual
    if rounding == torch.float32:
        # FP32 normalized values times the scale, rounded to FP32 once: the kernel's FP32 math.
        y = _normalize(traced_as_math, h.float(), w.float(), form, None, form.weight_offset)
    else:
        source = h if rounding == h.dtype else h.float()
        ones = source.new_ones(h.shape[-1])
        xhat = _normalize(traced_as_math, source, ones, form, None, 0.0).to(rounding)
        y = (w if form.weight_offset == 0.0 else w + form.weight_offset) * xhat
    return y if residual is None else (y, h)


def _float64_under_hf_casts(traced_as_math: bool, x, w, form: NormForm, residual):
    """FP64 activations under a Hugging Face class's casts, which compute the statistics from an FP32
    cast: FP32 math, as the stock norm's."""
    h = x if residual is None else x + residual
    source = h.float()
    offset = form.weight_offset
    if form.cast_policy == T5:  # the FP32 rstd times the FP64 input, then the weight
        y = w * (h * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + form.eps))
    elif form.cast_policy == SCALE_THEN_ROUND:  # all in FP32, cast back once
        y = _normalize(traced_as_math, source, w.float(), form, None, offset).to(h.dtype)
    else:  # ROUND_THEN_SCALE: the FP32 normalized values cast back, then the FP64 weight
        xhat = _normalize(traced_as_math, source, source.new_ones(h.shape[-1]), form, None, 0.0)
        y = (w if offset == 0.0 else w + offset) * xhat.to(h.dtype)
    return y if residual is None else (y, h)


def _normalize(traced_as_math: bool, x, w, form: NormForm, residual, weight_offset):
    """The kernels, or, while traced with ``compiled_as="torch"``, the same math in torch operations."""
    if traced_as_math:
        return rmsnorm_math(x, w, form.eps, residual, weight_offset)
    return cake_rmsnorm(
        x, w, form.eps, residual, weight_offset=weight_offset, memory_efficient=form.memory_efficient
    )


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


class CakeRMSNorm(nn.Module):
    """RMSNorm over the last dimension with the fused cake_cute kernels, a drop-in for
    ``torch.nn.RMSNorm`` and, through ``cast_policy``, for the Hugging Face norms ``swap_rmsnorm``
    replaces.

    Parameters
    ----------
    normalized_shape : int, tuple of one int, or None
        H (only the last dimension is normalized); None, with ``elementwise_affine=False``, any H.
    eps : float, optional
        Added to the mean square; None means ``torch.finfo(torch.float32).eps``, as torch.nn.RMSNorm.
    elementwise_affine : bool
        Learn a weight (True) or scale by a fixed ones buffer (False).
    device, dtype : optional
        Of the weight.
    weight_offset : float
        The scale is ``weight + weight_offset`` (1.0 is Gemma's ``1 + weight``).
    sequence_parallel : bool
        Set ``weight.sequence_parallel = True``, the mark Megatron-Core's gradient finalization uses to
        all-reduce a sequence-parallel norm's weight gradient.
    cast_policy : str
        The roundings of the module replaced (docs/module.md): ``"torch"``, ``"round_then_scale"``
        (Llama family), ``"scale_then_round"`` (Gemma family), ``"t5"``.
    compiled_as : str
        What a graph traced by torch.compile runs: ``"kernel"`` (the custom op) or ``"torch"`` (the same
        math in PyTorch operations, which inductor fuses); eager calls run the kernels. An attribute too.
    memory_efficient : bool
        Save y for the backward instead of the input, recomputing the input from y and the weight
        (docs/memory.md). An attribute too.

    Raises
    ------
    ValueError
        ``normalized_shape`` not one positive int, eps / weight_offset out of range, an unknown
        cast_policy or compiled_as, a device naming none, a non-floating dtype.
    TypeError
        eps or weight_offset not a number; a flag not a bool; device or dtype of the wrong kind.
    """

    # The default of an instance pickled before ``compiled_as`` existed (torch.save of a whole model).
    compiled_as = KERNEL
    memory_efficient = False

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        weight_offset=0.0,
        sequence_parallel=False,
        cast_policy=TORCH,
        compiled_as=KERNEL,
        memory_efficient=False,
    ):
        super().__init__()
        self.elementwise_affine = v.check_bool("elementwise_affine", elementwise_affine)
        v.check_bool("sequence_parallel", sequence_parallel)
        v.check_factory_arguments(device, dtype)
        hidden = _hidden_size(normalized_shape, self.elementwise_affine)
        self.normalized_shape = None if hidden is None else (hidden,)
        self.eps = None if eps is None else v.check_eps(eps)
        self.weight_offset = v.check_weight_offset(weight_offset)
        self.cast_policy = _check_cast_policy(cast_policy)
        self.compiled_as = check_compiled_as("compiled_as", compiled_as)
        self.memory_efficient = v.check_memory_efficient(memory_efficient)
        weight = None if hidden is None else torch.empty(self.normalized_shape, device=device, dtype=dtype)
        if self.elementwise_affine:
            self.weight = nn.Parameter(weight)
            if sequence_parallel:
                self.weight.sequence_parallel = True
        else:
            # Not persistent: the state dict matches torch.nn.RMSNorm's, which has no weight here.
            self.register_buffer("weight", weight, persistent=False)
        self.reset_parameters()
        if torch.cuda.is_available():
            prepare()  # the native host path is built at construction, before any step, never in one

    def reset_parameters(self) -> None:
        """weight = 1 - weight_offset, so the scale starts at 1 (ones by default, zeros for Gemma)."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, input: torch.Tensor, *, residual: torch.Tensor | None = None):
        """y, or ``(y, input + residual)``, with the roundings and output dtype of the module replaced.

        Parameters
        ----------
        input : torch.Tensor
            ``[H]`` or ``[..., H]``, or a DTensor sharded on a non-hidden dimension; named as in the running
            torch's ``torch.nn.RMSNorm.forward`` (``x`` in torch 2.13, ``input`` before).
        residual : torch.Tensor, optional
            Added to input first (keyword only), shaped like input.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            y, or ``(y, h_new)``, shaped like input.

        Raises
        ------
        TypeError
            input or residual is not a tensor; the errors of ``cake_rmsnorm``.
        """
        v.check_tensor(INPUT_NAME, input)
        if residual is not None:
            v.check_tensor("residual", residual)
        eps = _DEFAULT_EPS if self.eps is None else self.eps
        form = NormForm(eps, self.weight_offset, self.cast_policy, self.compiled_as, self.memory_efficient)
        return rmsnorm_with_casts(input, self.weight, form, residual)

    forward = with_input_named(forward, INPUT_NAME)

    def extra_repr(self) -> str:
        policy = "" if self.cast_policy == TORCH else f", cast_policy={self.cast_policy}"
        compiled = "" if self.compiled_as == KERNEL else f", compiled_as={self.compiled_as}"
        saving = ", memory_efficient=True" if self.memory_efficient else ""
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"weight_offset={self.weight_offset}{policy}{compiled}{saving}"
        )
