"""cake_cute's norms as layers of Hugging Face's kernel route, which the ``kernels`` package loads from
the package's local layer repository and binds to a model's norm modules.

A layer holds no state: its forward runs with ``self`` the replaced module and computes what
``swap_rmsnorm`` / ``swap_gated_rmsnorm`` would put in its place, with the same reading of the class
and the same math; a class that reading cannot serve is refused on its first call. The ``kernels``
package accepts only ``forward``, ``can_torch_compile`` and ``has_backward`` as members beyond
``torch.nn.Module``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import validation as v
from ..calls import module_call
from ..casts import rmsnorm_with_casts
from ..gated.module import GatedForm, gated_rmsnorm_with_casts
from ..gated.swap import GatedNormNotServed, hf_gated_form
from .norm_reading import hf_weight
from .swap import hf_rmsnorm_reading

__all__ = ["CakeHFRMSNorm", "CakeHFRMSNormGated", "CakeHFRMSNormZeroCentered"]

# Where the layers run: CUDA (the kernels), and CPU, where cake_cute's ops compute with their
# reference kernels (what a swapped model computes there too).
DEVICES = ("cuda", "cpu")


def _rmsnorm(module: nn.Module, hidden_states: torch.Tensor, name: str = "hidden_states") -> torch.Tensor:
    """What ``swap_rmsnorm``'s ``CakeRMSNorm`` computes in place of ``module``."""
    form = hf_rmsnorm_reading(module)
    call = module_call(hidden_states, hf_weight(module), None, form, name)
    return rmsnorm_with_casts(call, form)


def gated_form(module: nn.Module) -> GatedForm:
    """``gated.swap.hf_gated_form(module)``, its refusal naming the module's class."""
    try:
        return hf_gated_form(module)
    except GatedNormNotServed as refused:
        raise GatedNormNotServed(f"{type(module).__name__}: {refused}") from None


def _gated_rmsnorm(module: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None):
    """What ``swap_gated_rmsnorm``'s ``CakeGatedRMSNorm`` computes in place of ``module``."""
    v.check_tensor("hidden_states", hidden_states)
    return gated_rmsnorm_with_casts(hidden_states, gate, module.weight, gated_form(module))


class CakeHFRMSNorm(nn.Module):
    """The layer for transformers' ``"RMSNorm"``; raises ``NormNotServed`` on the first call for a class
    ``swap_rmsnorm`` reads only with a guess, or not at all."""

    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The replaced norm of ``hidden_states`` ([H] or [..., H]), in its output dtype."""
        return _rmsnorm(self, hidden_states)


class CakeHFRMSNormZeroCentered(nn.Module):
    """The layer for ``"RMSNormZeroCentered"`` (its forward's input is ``x``)."""

    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The replaced norm of ``x`` ([H] or [..., H]), in its output dtype."""
        return _rmsnorm(self, x, "x")


class CakeHFRMSNormGated(nn.Module):
    """The layer for ``"RMSNormGated"``; raises ``GatedNormNotServed`` on the first call for a class
    ``swap_gated_rmsnorm`` does not serve."""

    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The replaced gated norm of ``hidden_states`` by ``gate`` (its shape; None: the norm alone)."""
        return _gated_rmsnorm(self, hidden_states, gate)
