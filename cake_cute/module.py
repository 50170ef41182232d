"""``CakeRMSNorm``, a drop-in ``torch.nn.Module`` for ``torch.nn.RMSNorm``, and ``swap_rmsnorm``, which
puts it in place of the RMSNorm modules of an existing model (PyTorch's and Hugging Face's).

Swap before parallelizing (``parallelize_module``, ``fully_shard``, DDP): the parallel styles and FSDP
replace parameters by DTensors and attach hooks to the modules they see, so a module swapped in
afterwards would bypass them. ``swap_rmsnorm`` refuses a model whose norm weights are already DTensors.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import warnings

import torch
from torch import nn

from . import validation as v
from .autograd import cake_rmsnorm

# "(1.0 + self.weight" or "self.weight.float() + 1": the Gemma-style scale (1 + w).
_ONE_PLUS_WEIGHT = re.compile(
    r"(?<![\w.])1(\.0*)?\s*\+\s*self\.weight\b|\bself\.weight(\.\w+\(\))?\s*\+\s*1(\.0*)?\b"
)


# torch.nn.RMSNorm's eps=None: the epsilon of ATen's compute type (opmath), FP32 for bf16, fp16 and fp32.
_DEFAULT_EPS = torch.finfo(torch.float32).eps

# The cast policies: which roundings the replaced module does around its scale (``CakeRMSNorm.cast_policy``).
TORCH = "torch"  # torch.nn.RMSNorm: output in the input's dtype; FP32 where CUDA autocast lists rms_norm
ROUND_THEN_SCALE = "round_then_scale"  # HF Llama family: weight * xhat.to(input dtype)
SCALE_THEN_ROUND = "scale_then_round"  # HF Gemma family, L2 norms: (xhat * (offset + weight)).to(input dtype)
T5 = "t5"  # HF T5LayerNorm: weight * xhat.to(weight dtype if fp16/bf16 else FP32)
CAST_POLICIES = (TORCH, ROUND_THEN_SCALE, SCALE_THEN_ROUND, T5)
_HALF = (torch.float16, torch.bfloat16)


def _hidden_size(normalized_shape, elementwise_affine: bool) -> int | None:
    """The H of an int or 1-tuple ``normalized_shape`` (the kernels normalize the last dim only); None
    (any H) for a norm without a weight."""
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


def _check_cast_policy(cast_policy) -> str:
    if cast_policy not in CAST_POLICIES:
        raise ValueError(f"cast_policy must be one of {', '.join(CAST_POLICIES)}; got {cast_policy!r}")
    return cast_policy


@functools.cache
def _cuda_autocast_lists_rms_norm() -> bool:
    """Whether this torch's CUDA autocast has a kernel for rms_norm (among its FP32 ops): torch 2.13's
    has, torch 2.11's runs rms_norm in the input's dtype (seen on an H200). On CPU rms_norm is in no
    autocast list on any of them."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")


def _cuda_autocast(x: torch.Tensor) -> bool:
    """Whether torch's CUDA autocast would run ``torch.nn.RMSNorm`` on x in FP32."""
    return x.is_cuda and torch.is_autocast_enabled("cuda") and _cuda_autocast_lists_rms_norm()


class CakeRMSNorm(nn.Module):
    """RMSNorm over the last dimension with the fused cake_cute kernels, a drop-in for
    ``torch.nn.RMSNorm`` (and, through ``cast_policy``, for the Hugging Face norms ``swap_rmsnorm``
    replaces).

    ``forward(input, *, residual=None)`` returns y, or ``(y, input + residual)`` with the residual add
    fused in. input may be ``[H]`` or ``[..., H]``, or a DTensor sharded on a non-hidden dimension
    (sequence parallel): see ``cake_cute.SequenceParallelResidual`` for the residual call.

    Parameters
    ----------
    normalized_shape : int, tuple of one int, or None
        The hidden size H (only the last dimension is normalized). None (with
        ``elementwise_affine=False``) normalizes any last dimension with a unit scale.
    eps : float, optional
        Added to the mean square; None means torch.nn.RMSNorm's default, the epsilon of its FP32
        compute type (``torch.finfo(torch.float32).eps``) for bf16, fp16 and fp32 inputs alike.
    elementwise_affine : bool
        Learn a weight (True) or scale by a fixed ones buffer (False).
    device, dtype : optional
        Of the weight.
    weight_offset : float
        The scale is ``weight + weight_offset`` (1.0 is Gemma's ``1 + weight``).
    sequence_parallel : bool
        Set ``weight.sequence_parallel = True``, the mark Megatron-Core's gradient finalization uses to
        all-reduce a sequence-parallel norm's weight gradient over the tensor-parallel group.
    cast_policy : str
        The roundings of the module replaced (docs/module.md): ``"torch"`` (torch.nn.RMSNorm),
        ``"round_then_scale"`` (Hugging Face Llama family), ``"scale_then_round"`` (Gemma family, L2
        norms), ``"t5"`` (T5LayerNorm). ``swap_rmsnorm`` sets it from the module it replaces.

    Raises
    ------
    ValueError
        ``normalized_shape`` is not one positive int, eps / weight_offset out of range, an unknown
        cast_policy.
    TypeError
        eps or weight_offset is not a number.
    """

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
    ):
        super().__init__()
        self.elementwise_affine = bool(elementwise_affine)
        hidden = _hidden_size(normalized_shape, self.elementwise_affine)
        self.normalized_shape = None if hidden is None else (hidden,)
        self.eps = None if eps is None else v.check_eps(eps)
        self.weight_offset = v.check_weight_offset(weight_offset)
        self.cast_policy = _check_cast_policy(cast_policy)
        weight = None if hidden is None else torch.empty(self.normalized_shape, device=device, dtype=dtype)
        if self.elementwise_affine:
            self.weight = nn.Parameter(weight)
            if sequence_parallel:
                self.weight.sequence_parallel = True
        else:
            # Not persistent: the state dict matches torch.nn.RMSNorm's, which has no weight here.
            self.register_buffer("weight", weight, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight = 1 - weight_offset, so the scale starts at 1 (ones by default, zeros for Gemma)."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, input: torch.Tensor, *, residual: torch.Tensor | None = None):
        """y, or ``(y, input + residual)``, with the roundings and output dtype of the module replaced
        (``cast_policy``); see ``cake_rmsnorm``.

        Parameters
        ----------
        input : torch.Tensor
            ``[H]`` or ``[..., H]``.
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
        v.check_tensor("input", input)
        if residual is not None:
            v.check_tensor("residual", residual)
        if input.dim() != 1:
            return self._norm(input, residual)
        # [H]: one row for the kernels, and the outputs back in input's shape.
        out = self._norm(input.unsqueeze(0), None if residual is None else residual.unsqueeze(0))
        return out.squeeze(0) if residual is None else tuple(t.squeeze(0) for t in out)

    def _norm(self, x, residual):
        eps = _DEFAULT_EPS if self.eps is None else self.eps
        w = x.new_ones(x.shape[-1]) if self.weight is None else self.weight
        rounding = self._rounding_dtype(x, w)
        if rounding is None or w.dtype == rounding == x.dtype:
            # The kernels' own math: the scale, then one rounding to x's dtype (where the replaced module
            # rounds before and after a bf16/fp16 scale, the last bit may differ). A weight in neither
            # x's dtype nor FP32 joins the FP32 compute exactly.
            w = w if w.dtype in (x.dtype, torch.float32) else w.float()
            return cake_rmsnorm(x, w, eps, residual, True, self.weight_offset)
        # The replaced module rounds the normalized values to `rounding`, then scales in torch's
        # promoted dtype: torch's add, then the kernel, then (below FP32) torch's multiply.
        h = x if residual is None else x + residual
        if rounding == torch.float32:
            # FP32 normalized values times the scale, rounded to FP32 once: the kernel's FP32 math.
            y = cake_rmsnorm(h.float(), w.float(), eps, None, True, self.weight_offset)
        else:
            source = h if rounding == h.dtype else h.float()
            xhat = cake_rmsnorm(source, source.new_ones(h.shape[-1]), eps).to(rounding)
            y = (w if self.weight_offset == 0.0 else w + self.weight_offset) * xhat
        return y if residual is None else (y, h)

    def _rounding_dtype(self, x, w) -> torch.dtype | None:
        """The dtype the replaced module rounds the normalized values to before it scales them, or None
        when it scales first and rounds once to x's dtype (what the kernels do)."""
        policy = self.cast_policy
        if policy == TORCH:
            # Where CUDA autocast lists rms_norm, torch runs it on FP32 casts of its inputs: an FP32 output.
            return torch.float32 if _cuda_autocast(x) else None
        if policy == ROUND_THEN_SCALE:
            return x.dtype
        if policy == T5:
            return w.dtype if w.dtype in _HALF else torch.float32
        return None

    def extra_repr(self) -> str:
        policy = "" if self.cast_policy == TORCH else f", cast_policy={self.cast_policy}"
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"weight_offset={self.weight_offset}{policy}"
        )


def _hf_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _hf_weight(module: nn.Module) -> nn.Parameter | None:
    """The module's one 1-D ``weight`` Parameter, if that is all it learns."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    return weight if all(p is weight for p in module.parameters(recurse=False)) else None


def _is_hf_norm_shaped(module: nn.Module) -> bool:
    """A Hugging Face-style norm module: a class name ending in "Norm", a float ``variance_epsilon`` or
    ``eps``, no submodules, and one 1-D ``weight`` Parameter or nothing learnable at all (biased or
    gated variants fail this). Whether it is an RMSNorm its forward's source decides (``_hf_form``)."""
    return (
        type(module).__name__.endswith("Norm")
        and _hf_eps(module) is not None
        and next(module.children(), None) is None
        and (_hf_weight(module) is not None or next(module.parameters(recurse=False), None) is None)
    )


def _forward_source(cls: type) -> str | None:
    """The source of ``cls.forward`` and of its ``_norm`` helper, if any, on one line with single spaces
    and without comments or docstrings; None when it cannot be read."""
    parts = []
    for name in ("_norm", "forward"):
        function = getattr(cls, name, None)
        if function is None:
            continue
        try:
            parts.append(inspect.getsource(function))
        except (OSError, TypeError):
            return None
    text = re.sub(r'""".*?"""|#[^\n]*', "", "\n".join(parts), flags=re.S)
    return " ".join(text.split())


# What a forward's source must show to be an RMSNorm (the squares averaged over the last dimension and
# a reciprocal square root), and what the recognized forms differ by.
_MEAN_OF_SQUARES = re.compile(r"(pow\(2\)|square\(\)|\*\* ?2)\)?\.mean\((dim=)?-1")
_SUM_OF_SQUARES = re.compile(r"(pow\(2\)|square\(\)|\*\* ?2)\)?\.sum\((dim=)?-1")
_MEAN_SUBTRACTED = re.compile(r"- mean\b|\.var\(")
_RSTD_ROUNDED = re.compile(r"rsqrt\(.*?keepdim=True\) \+ self\.\w+\)\.(to|type_as)\(")
_NORM_OF_INPUT = re.compile(r"self\._norm\((x|hidden_states)(\.float\(\)|\.to\(torch\.float32\))?\)")
_T5_CAST = re.compile(r"if self\.weight\.dtype in")
_ROUND_THEN_SCALE = re.compile(
    r"self\.weight \* \w+\.to\(\w+\)$|\.(to|type_as)\(\w+\) \* self\.weight\b"
    r"|\.type_as\((\w+)\) return \w+ \* self\.weight$"
)


def _hf_form(module: nn.Module) -> str | None:
    """The cast policy of a norm-shaped Hugging Face module (``_is_hf_norm_shaped``), or None when its
    forward is not an RMSNorm (``_hf_refusal`` says why). Without readable source, a class named
    "...RMSNorm" with a weight is taken as one: Gemma's casts when "Gemma" is in the name, else Llama's."""
    cls = type(module)
    source = _forward_source(cls)
    weighted = _hf_weight(module) is not None
    if source is None:
        if not (weighted and cls.__name__.endswith("RMSNorm")):
            return None
        return SCALE_THEN_ROUND if "Gemma" in cls.__name__ else ROUND_THEN_SCALE
    if not _computes_an_rms(source) or _hf_refusal(module, source) is not None:
        return None
    if not weighted:
        return SCALE_THEN_ROUND  # a unit scale: computed in FP32, rounded once
    if _T5_CAST.search(source):
        return T5
    return ROUND_THEN_SCALE if _ROUND_THEN_SCALE.search(source) else SCALE_THEN_ROUND


def _computes_an_rms(source: str) -> bool:
    """A reciprocal square root of the mean of the squares over the last dimension, no mean subtracted."""
    return "rsqrt" in source and bool(_MEAN_OF_SQUARES.search(source)) and not _MEAN_SUBTRACTED.search(source)


def _hf_refusal(module: nn.Module, source: str | None) -> str | None:
    """Why a norm-shaped module whose forward computes a reciprocal square root is not swapped, or None
    when it is an RMSNorm (or computes no rsqrt at all: then it is no business of swap_rmsnorm)."""
    if source is None or "rsqrt" not in source or _MEAN_SUBTRACTED.search(source):
        return None
    if not _MEAN_OF_SQUARES.search(source):
        if _SUM_OF_SQUARES.search(source):
            return "it divides by the root of the sum of squares (an L2 norm), not of their mean"
        return "its forward does not average the squares over the last dimension"
    if getattr(module, "group_size", None) is not None:
        return "it normalizes groups of group_size channels, not the whole last dimension"
    if "return torch.rsqrt" in source:
        return "it returns the reciprocal RMS, not the normalized input"
    if _RSTD_ROUNDED.search(source):
        return "it rounds the reciprocal RMS to the input dtype before scaling by it"
    if "self._norm(" in source and not _NORM_OF_INPUT.search(source):
        return "it scales its input before normalizing it"
    return None


def _hf_weight_offset(module: nn.Module) -> float:
    """1.0 when the module scales by ``1 + weight`` (Gemma, Gemma 2/3, Qwen3-Next), else 0.0; a guess
    (``swap_rmsnorm`` warns when it is used).

    The forward's source decides, because class names mislead both ways (Gemma3n's RMSNorm scales by
    plain ``weight``, Qwen3-Next's by ``1 + weight``). Without readable source, a class name containing
    "Gemma" means ``1 + weight``."""
    cls = type(module)
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return 1.0 if "Gemma" in cls.__name__ else 0.0
    return 1.0 if _ONE_PLUS_WEIGHT.search(source) else 0.0


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


def _warn_refused(model: nn.Module) -> None:
    """One warning naming the norm-shaped classes left alone and why."""
    refused = {}
    for module in model.modules():
        if not isinstance(module, CakeRMSNorm) and _is_hf_norm_shaped(module):
            reason = _hf_refusal(module, _forward_source(type(module)))
            if reason is not None:
                refused[type(module).__name__] = reason
    if refused:
        listed = "; ".join(f"{name}: {reason}" for name, reason in sorted(refused.items()))
        warnings.warn(f"swap_rmsnorm left these norms alone ({listed})", UserWarning, stacklevel=3)


def _refuse_parallelized(name: str, module: nn.Module) -> None:
    """A weight that is already a DTensor means parallelize_module / fully_shard ran first."""
    from torch.distributed.tensor import DTensor

    if isinstance(getattr(module, "weight", None), DTensor):
        raise ValueError(
            f"{name} ({type(module).__name__}) has a DTensor weight: swap_rmsnorm must run before "
            "parallelize_module / fully_shard, which replace parameters and hook the modules they see"
        )


def _decided_offsets(swappable, weight_offset) -> dict[nn.Module, float]:
    """The weight_offset of each swappable module: the caller's, 0.0 for torch.nn.RMSNorm, or the
    source-pattern guess for Hugging Face modules (with one warning naming the classes guessed)."""
    if weight_offset is not None:
        offset = v.check_weight_offset(weight_offset)
        return dict.fromkeys(swappable, offset)
    decided = {m: 0.0 if isinstance(m, nn.RMSNorm) else _hf_weight_offset(m) for m in swappable}
    guessed = sorted(
        {
            f"{type(m).__name__}: {decided[m]}"
            for m in swappable
            if not isinstance(m, nn.RMSNorm) and _hf_weight(m) is not None
        }
    )
    if guessed:
        warnings.warn(
            f"swap_rmsnorm guessed weight_offset from each module's forward source or class name "
            f"({', '.join(guessed)}); "
            "pass weight_offset= (1.0 for a 1 + weight scale, else 0.0) to decide it explicitly",
            UserWarning,
            stacklevel=3,
        )
    return decided


def _model_device(model: nn.Module) -> torch.device:
    """Where a swapped module without weights keeps its ones buffer: with the model's first tensor."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def swap_rmsnorm(model: nn.Module, weight_offset: float | None = None) -> int:
    """Replace, in place, every ``torch.nn.RMSNorm`` over one dimension and every Hugging Face-style
    RMSNorm-shaped module of ``model`` (``...RMSNorm``, ``T5LayerNorm`` and its copies, weightless ones
    such as ``Llama4TextL2Norm``) with a ``CakeRMSNorm`` that keeps the same weight Parameter, eps,
    offset, casts (``cast_policy``) and training mode.

    A module used in several places is replaced by one CakeRMSNorm everywhere. Hooks registered on the
    old modules do not carry over. Call it before ``parallelize_module`` / ``fully_shard`` / DDP.
    Norm-shaped modules whose forward is not an RMSNorm (an L2 norm over the sum of squares, a grouped
    norm, ...) are left alone, with one ``UserWarning`` naming each class and the reason.

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place.
    weight_offset : float, optional
        The scale of every swapped module is ``weight + weight_offset``. None: 0.0 for
        ``torch.nn.RMSNorm``; for Hugging Face modules a guess from the forward's source (``1 + weight``
        means 1.0), with a ``UserWarning`` that names the classes guessed.

    Returns
    -------
    int
        How many modules were replaced.

    Raises
    ------
    ValueError
        ``model`` is itself an RMSNorm; a norm weight is already a DTensor (the model was parallelized
        or sharded before the swap); weight_offset is not finite.
    TypeError
        model is not a torch.nn.Module; weight_offset is not a number.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
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
    offsets = _decided_offsets(list(dict.fromkeys(child for _, _, child in found)), weight_offset)
    device = _model_device(model)
    replaced: dict[nn.Module, CakeRMSNorm] = {}
    for parent, name, child in found:
        if child not in replaced:
            replaced[child] = _replacement(child, device, offsets[child])
        setattr(parent, name, replaced[child])
    _warn_refused(model)
    return len(replaced)
