"""``CakeRMSNorm``, a drop-in ``torch.nn.Module`` for ``torch.nn.RMSNorm``, and ``swap_rmsnorm``, which
puts it in place of the RMSNorm modules of an existing model (PyTorch's and Hugging Face's).

Swap before parallelizing (``parallelize_module``, ``fully_shard``, DDP): the parallel styles and FSDP
replace parameters by DTensors and attach hooks to the modules they see, so a module swapped in
afterwards would bypass them. ``swap_rmsnorm`` refuses a model whose norm weights are already DTensors.
"""

from __future__ import annotations

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


def _hidden_size(normalized_shape) -> int:
    """The H of an int or 1-tuple ``normalized_shape``; the kernels normalize the last dim only."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    try:
        shape = tuple(shape)
    except TypeError:
        shape = ()
    if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int) or shape[0] < 1:
        raise ValueError(
            "normalized_shape must be a positive int or a 1-tuple (CakeRMSNorm normalizes over the last "
            f"dimension only), got {normalized_shape!r}"
        )
    return shape[0]


class CakeRMSNorm(nn.Module):
    """RMSNorm over the last dimension with the fused cake_cute kernels, a drop-in for
    ``torch.nn.RMSNorm``.

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` with the residual add fused in;
    the output has x's dtype. x may be a DTensor sharded on a non-hidden dimension (sequence parallel):
    see ``cake_cute.SequenceParallelResidual`` for the residual call.

    Parameters
    ----------
    normalized_shape : int or tuple of one int
        The hidden size H (only the last dimension is normalized).
    eps : float, optional
        Added to the mean square; None means the input dtype's machine epsilon, as in torch.
    elementwise_affine : bool
        Learn a weight (True) or scale by a fixed ones buffer (False).
    device, dtype : optional
        Of the weight.
    weight_offset : float
        The scale is ``weight + weight_offset`` (1.0 is Gemma's ``1 + weight``).
    sequence_parallel : bool
        Set ``weight.sequence_parallel = True``, the mark Megatron-Core's gradient finalization uses to
        all-reduce a sequence-parallel norm's weight gradient over the tensor-parallel group.

    Raises
    ------
    ValueError
        ``normalized_shape`` is not one positive int, or eps / weight_offset out of range.
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
    ):
        super().__init__()
        self.normalized_shape = (_hidden_size(normalized_shape),)
        self.eps = None if eps is None else v.check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight_offset = v.check_weight_offset(weight_offset)
        weight = torch.empty(self.normalized_shape, device=device, dtype=dtype)
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
        nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """y, or ``(y, x + residual)``; see ``cake_rmsnorm``."""
        # eps=None means the input dtype's machine epsilon, as in torch.nn.RMSNorm.
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        w = self.weight
        if w.dtype != x.dtype and w.dtype != torch.float32:
            w = w.to(x.dtype)  # the kernels take w in x's dtype or FP32 (e.g. a bf16 model fed fp32)
        return cake_rmsnorm(x, w, eps, residual, True, self.weight_offset)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"weight_offset={self.weight_offset}"
        )


def _hf_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _is_hf_rmsnorm(module: nn.Module) -> bool:
    """A Hugging Face-style RMSNorm: class name ending in "RMSNorm", one 1-D ``weight`` Parameter and
    nothing else learnable, a float ``variance_epsilon`` or ``eps``. Gated or biased variants fail this."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and _hf_eps(module) is not None
        and next(module.children(), None) is None
        and all(p is weight for p in module.parameters(recurse=False))
    )


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


def _wrapping(weight: nn.Parameter, eps, weight_offset: float) -> CakeRMSNorm:
    """A CakeRMSNorm that holds ``weight`` itself (optimizer state and weight tying stay valid)."""
    new = CakeRMSNorm(weight.shape[0], eps=eps, weight_offset=weight_offset, device="meta")
    new.weight = weight
    return new


def _is_swappable(module: nn.Module) -> bool:
    if isinstance(module, CakeRMSNorm):
        return False
    if isinstance(module, nn.RMSNorm):
        return len(module.normalized_shape) == 1
    return _is_hf_rmsnorm(module)


def _replacement(module: nn.Module, buffer_device: torch.device, weight_offset) -> CakeRMSNorm:
    """The CakeRMSNorm to put in place of a swappable ``module``; ``weight_offset`` was decided."""
    if not isinstance(module, nn.RMSNorm):
        new = _wrapping(module.weight, _hf_eps(module), weight_offset)
    elif module.weight is None:
        new = CakeRMSNorm(
            module.normalized_shape, eps=module.eps, elementwise_affine=False, device=buffer_device
        )
    else:
        new = _wrapping(module.weight, module.eps, weight_offset)
    return new.train(module.training)


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
        {f"{type(m).__name__}: {decided[m]}" for m in swappable if not isinstance(m, nn.RMSNorm)}
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
    RMSNorm module of ``model`` with a ``CakeRMSNorm`` that keeps the same weight Parameter, eps and
    training mode.

    A module used in several places is replaced by one CakeRMSNorm everywhere. Hooks registered on the
    old modules do not carry over. Call it before ``parallelize_module`` / ``fully_shard`` / DDP.

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
        weight_offset is not a number.
    """
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
    return len(replaced)
