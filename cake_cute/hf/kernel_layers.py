"""cake_cute's norms as layers of Hugging Face's kernel route: the classes that the ``kernels`` package
loads from cake_cute's local layer repository (``cake_cute.hf.kernel_route``) and whose ``forward``
it binds to the norm modules of a model (``kernelize``; transformers' ``use_kernels=True``).

A kernel layer holds no state: its forward runs with ``self`` the replaced Hugging Face module, reads
that module's weight and eps, and computes what ``swap_rmsnorm`` / ``swap_gated_rmsnorm`` would put in
its place: the same reading of the class (``hf.swap.hf_rmsnorm_reading``, ``gated.swap.hf_gated_form``:
eps, weight offset, group size, gate order, casts) and the same math (``module.rmsnorm_with_casts``,
``gated.module.gated_rmsnorm_with_casts``). A class that reading cannot serve faithfully is refused
on its first call, before anything is computed (``NormNotServed``, naming the class).

The ``kernels`` package accepts a layer whose only members beyond ``torch.nn.Module``'s are ``forward``,
``can_torch_compile`` and ``has_backward``, and whose forward has the replaced forward's parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import validation as v
from ..gated.module import GatedForm, gated_rmsnorm_with_casts
from ..gated.swap import GatedNormNotServed, hf_gated_form
from ..module import rmsnorm_with_casts
from .norm_reading import hf_weight
from .swap import hf_rmsnorm_reading

__all__ = ["CakeHFRMSNorm", "CakeHFRMSNormGated", "CakeHFRMSNormZeroCentered"]

# Where the layers run: CUDA (the kernels), and CPU, where cake_cute's ops compute with their
# reference kernels (what a swapped model computes there too).
DEVICES = ("cuda", "cpu")


def _rmsnorm(module: nn.Module, hidden_states: torch.Tensor, name: str = "hidden_states") -> torch.Tensor:
    """What ``swap_rmsnorm``'s ``CakeRMSNorm`` computes in place of ``module``; ``name``: the replaced
    forward's name for its input."""
    v.check_tensor(name, hidden_states)
    return rmsnorm_with_casts(hidden_states, hf_weight(module), hf_rmsnorm_reading(module))


def gated_form(module: nn.Module) -> GatedForm:
    """``gated.swap.hf_gated_form(module)``, its refusal naming the module's class.

    Raises
    ------
    GatedNormNotServed
        "<class>: <reason>" (``hf_gated_form``'s reasons).
    """
    try:
        return hf_gated_form(module)
    except GatedNormNotServed as refused:
        raise GatedNormNotServed(f"{type(module).__name__}: {refused}") from None


def _gated_rmsnorm(module: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None):
    """What ``swap_gated_rmsnorm``'s ``CakeGatedRMSNorm`` computes in place of ``module``."""
    v.check_tensor("hidden_states", hidden_states)
    return gated_rmsnorm_with_casts(hidden_states, gate, module.weight, gated_form(module))


class CakeHFRMSNorm(nn.Module):
    """The layer for transformers' ``"RMSNorm"`` (``LlamaRMSNorm`` and the classes like it): the
    replaced module's RMSNorm with cake_cute's kernels, its eps, weight offset and casts.

    Raises
    ------
    NormNotServed
        On the first call, when the replaced module's class is not an RMSNorm ``swap_rmsnorm`` reads
        without a guess.
    """

    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The replaced norm of ``hidden_states`` ([H] or [..., H]), in its output dtype."""
        return _rmsnorm(self, hidden_states)


class CakeHFRMSNormZeroCentered(nn.Module):
    """The layer for transformers' ``"RMSNormZeroCentered"`` (Qwen3.5's ``1 + weight`` norms, whose
    forward names its input ``x``): ``CakeHFRMSNorm``'s computation."""

    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The replaced norm of ``x`` ([H] or [..., H]), in its output dtype."""
        return _rmsnorm(self, x, "x")


class CakeHFRMSNormGated(nn.Module):
    """The layer for transformers' ``"RMSNormGated"`` (the SiLU-gated norms of Qwen3-Next, Qwen3.5,
    OLMo-hybrid, Lara-mini; the sigmoid-gated ones of Kimi Linear, GLM-5 Next, Bailing hybrid): the
    replaced module's gated RMSNorm with cake_cute's kernels, its eps, gate activation and order, and
    casts.

    Raises
    ------
    GatedNormNotServed
        On the first call, when the replaced module's class is not one ``swap_gated_rmsnorm`` serves.
    """

    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The replaced gated norm of ``hidden_states`` by ``gate`` (its shape; None: the norm alone)."""
        return _gated_rmsnorm(self, hidden_states, gate)
