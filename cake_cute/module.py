"""``CakeRMSNorm``, a drop-in for ``torch.nn.RMSNorm`` that, through its cast policy (``casts``), also
stands in for the Hugging Face norms. Under torch.compile a norm traces to the kernels' custom op, or,
where ``compiled_as`` says so, to its PyTorch math, which inductor can fuse with its neighbours.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import validation as v
from .calls import module_call
from .casts import COMPILED_AS, KERNEL, TORCH, NormForm, check_cast_policy, rmsnorm_with_casts
from .dispatch import prepare
from .forward_names import INPUT_NAME, with_input_named

# torch.nn.RMSNorm's eps=None: the epsilon of ATen's compute type (opmath), FP32 for bf16, fp16 and fp32.
_DEFAULT_EPS = torch.finfo(torch.float32).eps


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


_SETTING_CHECKS = {
    "eps": lambda eps: None if eps is None else v.check_eps(eps),
    "weight_offset": v.check_weight_offset,
    "cast_policy": check_cast_policy,
    "compiled_as": functools.partial(check_compiled_as, "compiled_as"),
    "memory_efficient": v.check_memory_efficient,
}


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
        self.eps = eps
        self.weight_offset = weight_offset
        self.cast_policy = cast_policy
        self.compiled_as = compiled_as
        self.memory_efficient = memory_efficient
        self._form = self._settings_form()
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

    def __setattr__(self, name: str, value) -> None:
        # The settings are checked when they are set, here or later by a user, and their form made
        # once, so a call trusts them and reads one value.
        check = _SETTING_CHECKS.get(name)
        if check is None:
            super().__setattr__(name, value)
            return
        super().__setattr__(name, check(value))
        if "_form" in self.__dict__:
            self._form = self._settings_form()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._form = self._settings_form()  # an instance pickled before a setting existed

    def _settings_form(self) -> NormForm:
        eps = _DEFAULT_EPS if self.eps is None else self.eps
        return NormForm(eps, self.weight_offset, self.cast_policy, self.compiled_as, self.memory_efficient)

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
            input or residual is not a tensor; the errors of ``calls.module_call``.
        """
        form = self._form
        # The tensors checked once, into the value the casts and everything below them trust.
        call = module_call(input, self.weight, residual, form, INPUT_NAME)
        return rmsnorm_with_casts(call, form)

    forward = with_input_named(forward, INPUT_NAME)

    def extra_repr(self) -> str:
        policy = "" if self.cast_policy == TORCH else f", cast_policy={self.cast_policy}"
        compiled = "" if self.compiled_as == KERNEL else f", compiled_as={self.compiled_as}"
        saving = ", memory_efficient=True" if self.memory_efficient else ""
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"weight_offset={self.weight_offset}{policy}{compiled}{saving}"
        )
