"""The residual add fused into the norm where models write it outside the norm module.

``CakeRMSNorm.forward(out, residual=residual)`` returns ``(y, h)`` from one kernel, and its backward adds
the residual branch's gradient into dx in the same pass. Your own blocks call ``add_rmsnorm(norm, out,
h)``; Hugging Face decoders get ``fuse_residual_rmsnorm(model)``, which swaps the norms and gives each
decoder layer whose forward matches a template of ``cake_cute.hf.plans`` a fused forward, through a
subclass of the same ``__name__`` (the module tree, state dict, pickling and checkpointing stay).

The add that ends a layer belongs to the *next* norm: the layer computes ``(y, h) =
next_norm(branch, residual=h)``, returns the true h, and hands y over; the next norm uses it only when
called on that very h with y in the autograd graph whenever h is, else normalizes h itself. Nothing is
handed over for a DTensor weight, in reentrant checkpointing's gradient-free pass, or across a
checkpointed region traced by torch.compile; under non-reentrant checkpointing a recompute rebuilds
the handed-over y from its recorded input, so both runs save the same tensors.

Each add is fused when both operands share a shape and a kernel dtype, else it is torch's promoting
add then the norm. The forward values are bitwise the unfused cake model's; the gradients agree to
rounding (the fused backward rounds dx once after adding the residual gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import validation as v
from ..casts import TORCH_MATH
from ..forward_names import INPUT_NAME, with_input_named
from ..module import CakeRMSNorm
from ..routing import DTensor
from ..vocab import DTYPE_BY_TORCH
from .plans import _layer_plan, _LayerPlan
from .swap import _is_swappable, _swap_norms, check_swap_arguments


def _fusable(branch: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``residual + branch`` is the fused kernel's add: one dtype it takes, one shape."""
    return (
        branch.dtype == residual.dtype
        and branch.dtype in DTYPE_BY_TORCH  # an activation dtype the kernels take
        and branch.shape == residual.shape
        and branch.device == residual.device
    )


def add_rmsnorm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """``(norm(residual + x), residual + x)``, in one fused kernel when ``norm`` is a ``CakeRMSNorm`` and
    x and residual share a shape and a dtype the kernels take; otherwise torch's type-promoting add and
    then the norm, as the unfused block would compute.

    Parameters
    ----------
    norm : torch.nn.Module
        A ``CakeRMSNorm``, or any module that normalizes one tensor.
    x, residual : torch.Tensor
        The branch output and the residual stream; their sum is rounded once, as torch's add rounds it.

    Returns
    -------
    tuple of torch.Tensor
        ``(y, h)`` with ``h = residual + x`` and ``y = norm(h)``.

    Raises
    ------
    TypeError
        norm is not a torch.nn.Module; x or residual is not a tensor (each named).
    """
    if not (
        isinstance(norm, nn.Module) and isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)
    ):
        v.check_module("norm", norm)
        v.check_tensor("x", x)
        v.check_tensor("residual", residual)
    if isinstance(norm, CakeRMSNorm) and _fusable(x, residual):
        return norm(x, residual=residual)
    h = residual + x
    return norm(h), h


@dataclass(eq=False)
class _Handoff:
    """The y a layer computed for the next norm, keyed by that norm and its h; consumed by the first read."""

    pending: tuple | None = None

    def give(self, norm: CakeRMSNorm, y: torch.Tensor, h: torch.Tensor) -> None:
        self.pending = (norm, h, y)

    def take(self, norm: CakeRMSNorm, h: torch.Tensor) -> torch.Tensor | None:
        """The y handed to ``norm`` for exactly this ``h`` (None if there is none); always clears."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        owner, handed_h, y = pending
        # requires_grad differs when h came out of a recomputing wrapper (reentrant checkpointing)
        # that ran the producing layer without grad: that y would cut the gradient, so recompute.
        if owner is norm and handed_h is h and y.requires_grad == h.requires_grad:
            return y
        return None

    def __getstate__(self):
        return {"pending": None}


def _checkpoint_enabled(layer: nn.Module) -> bool:
    """Whether the layer is set to checkpoint and the model is training."""
    holder = layer if hasattr(layer, "gradient_checkpointing") else layer._cake_fusion.stack_owner
    return getattr(holder, "gradient_checkpointing", False) and layer.training


def _checkpointing(layer: nn.Module) -> bool:
    """Whether transformers' ``GradientCheckpointingLayer`` checkpoints this call (its condition)."""
    return _checkpoint_enabled(layer) and torch.is_grad_enabled()


def _traced_in_checkpoint(layer: nn.Module) -> bool:
    """A checkpointed call traced by torch.compile, whose region may not change state outside itself."""
    return _checkpointing(layer) and torch.compiler.is_compiling()


def _reentrant_first_pass(layer: nn.Module) -> bool:
    """Reentrant checkpointing's gradient-free first pass, whose outputs the backward recomputes."""
    return _checkpoint_enabled(layer) and not torch.is_grad_enabled()


@dataclass(eq=False)
class _LayerFusion:
    """A fused layer instance's state: the model's hand-off, the next norm, the layers' owner, and the
    inputs it was handed a y for."""

    handoff: _Handoff
    next_norm: CakeRMSNorm | None
    stack_owner: nn.Module | None = None
    handed_inputs: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    def input_norm(self, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's input norm of ``hidden_states``, or the y the previous layer computed for it."""
        norm = getattr(layer, layer._cake_plan.input_norm)
        if _traced_in_checkpoint(layer):
            return norm(hidden_states)
        y = self.handoff.take(norm, hidden_states)
        if not _checkpointing(layer):
            return norm(hidden_states) if y is None else y
        if y is not None:
            self.handed_inputs[hidden_states] = True
            return y
        if hidden_states in self.handed_inputs:
            # The recompute of a call that was handed y: the same value, saving nothing of its own
            # (the first run saved nothing for it either); y's gradient flows through the first run's
            # graph. It requires grad as y did, so the ops that read it save what they saved then.
            with torch.no_grad():
                y = norm(hidden_states)
            return y.requires_grad_(hidden_states.requires_grad)
        return norm(hidden_states)

    def end(self, layer: nn.Module, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + branch``, computed by the next norm's fused kernel when it can take it."""
        norm = self.next_norm
        # A DTensor weight outside its own layer's forward is FSDP2's shard (or tensor-parallel): the
        # next layer's norm can only run inside that layer's forward.
        if (
            norm is None
            or isinstance(norm.weight, DTensor)
            or not _fusable(branch, residual)
            or _reentrant_first_pass(layer)
            or _traced_in_checkpoint(layer)
        ):
            return residual + branch
        y, hidden_states = norm(branch, residual=residual)
        # A checkpoint's recompute runs inside the backward: its y has no next layer to go to.
        if not (_checkpointing(layer) and torch._C._current_graph_task_id() != -1):
            self.handoff.give(norm, y, hidden_states)
        return hidden_states

    def __getstate__(self):
        return {"handoff": self.handoff, "next_norm": self.next_norm, "stack_owner": self.stack_owner}

    def __setstate__(self, state):
        self.__dict__.update(state, handed_inputs=WeakIdKeyDictionary())


class _FusedDecoderLayer:
    """The first base of each fused class: the template's forward, pickled as "this class, fused"."""

    _cake_base: type
    _cake_plan: _LayerPlan

    def forward(self, hidden_states, *args, **kwargs):
        """The layer's forward with its residual adds in the norm kernels."""
        plan, fusion = self._cake_plan, self._cake_fusion
        bound = plan.bind(self, args, kwargs)
        residual = hidden_states
        normed = fusion.input_norm(self, hidden_states)
        branch, attention = self.self_attn(hidden_states=normed, **plan.attention_kwargs(bound))
        if plan.post_attention_norm is not None:
            branch = getattr(self, plan.post_attention_norm)(branch)
        branch = plan.attention_branch.apply(self, branch, residual)
        normed, residual = add_rmsnorm(getattr(self, plan.mid_norm), branch, residual)
        branch, router = plan.split_mlp_output(self, getattr(self, plan.mlp)(normed))
        if plan.post_mlp_norm is not None:
            branch = getattr(self, plan.post_mlp_norm)(branch)
        branch = plan.mlp_branch.apply(self, branch, residual)
        return plan.result(fusion.end(self, branch, residual), bound, attention, router)

    def __reduce_ex__(self, protocol):
        return _rebuild_fused, (self._cake_base,), self.__getstate__()


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(base: type) -> type:
    """The fused subclass of a decoder-layer class, created once, with the same ``__name__``."""
    fused = _FUSED_CLASSES.get(base)
    if fused is None:
        namespace = {
            "__module__": __name__,
            "__qualname__": f"_fused_class({base.__module__}.{base.__qualname__})",
            "_cake_base": base,
            "_cake_plan": _layer_plan(base),
        }
        fused = _FUSED_CLASSES[base] = type(base.__name__, (_FusedDecoderLayer, base), namespace)
    return fused


def _rebuild_fused(base: type) -> nn.Module:
    """An empty fused layer of ``base`` for pickle and deepcopy to fill (its template checked again)."""
    fused = _fused_class(base)
    return fused.__new__(fused)


class _FinalRMSNorm(CakeRMSNorm):
    """A model's final norm after fusion: the y handed over for this input, else a ``CakeRMSNorm``."""

    def forward(self, input, *, residual=None):
        if residual is None:
            y = self._cake_handoff.take(self, input)
            if y is not None:
                return y
        return super().forward(input, residual=residual)

    forward = with_input_named(forward, INPUT_NAME)


def _base_class(layer: nn.Module) -> type:
    return getattr(type(layer), "_cake_base", type(layer))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, CakeRMSNorm) or _is_swappable(module)


def _decoder_stacks(model: nn.Module) -> list[tuple[nn.Module, nn.ModuleList]]:
    """(owner, layers) for every ModuleList of Hugging Face decoder layers."""
    stacks = []
    for owner in model.modules():
        for child in owner.children():
            if (
                isinstance(child, nn.ModuleList)
                and len(child)
                and all(hasattr(m, "self_attn") and any(map(_is_norm, m.children())) for m in child)
            ):
                stacks.append((owner, child))
    return stacks


def _require_swappable_norms(layer: nn.Module, plan: _LayerPlan) -> None:
    for name in (plan.input_norm, plan.mid_norm):
        norm = getattr(layer, name)
        if not _is_norm(norm):
            raise ValueError(
                f"{type(layer).__qualname__}.{name} is a {type(norm).__qualname__}, which swap_rmsnorm "
                "does not replace; the fused residual needs a CakeRMSNorm there"
            )


def _planned_patch(model: nn.Module):
    """Check that every decoder layer can be fused, before anything changes; return the function that
    fuses them."""
    stacks = _decoder_stacks(model)
    if not stacks:
        raise ValueError(
            f"{type(model).__qualname__} has no Hugging Face-style decoder layers (a ModuleList of layers "
            "with a self_attn and RMSNorm modules) to fuse; in your own blocks call "
            "cake_cute.add_rmsnorm(norm, x, residual) where the residual is added before a norm"
        )
    for _, layers in stacks:
        for layer in layers:
            _require_swappable_norms(layer, _layer_plan(_base_class(layer)))

    def patch() -> None:
        for owner, layers in stacks:
            handoff = _Handoff()
            final = getattr(owner, "norm", None)
            final = final if isinstance(final, CakeRMSNorm) else None
            followers = [getattr(layer, _layer_plan(_base_class(layer)).input_norm) for layer in layers[1:]]
            followers.append(final)
            for layer, next_norm in zip(layers, followers):
                layer.__class__ = _fused_class(_base_class(layer))
                layer._cake_fusion = _LayerFusion(handoff, next_norm, owner)
            if final is not None:
                final.__class__ = _FinalRMSNorm
                final._cake_handoff = handoff

    return patch


def fuse_residual_rmsnorm(
    model: nn.Module,
    weight_offset: float | None = None,
    *,
    compiled_head_norms: str = TORCH_MATH,
    memory_efficient: bool = False,
) -> int:
    """Swap the RMSNorm modules of a Hugging Face decoder for ``CakeRMSNorm`` and fuse every residual add
    that feeds a norm into that norm; the layers are checked before anything changes, and a second call
    re-fuses.

    Parameters
    ----------
    model : torch.nn.Module
        E.g. a ``LlamaForCausalLM`` or a PEFT model wrapping one; changed in place, its module tree and
        state dict kept.
    weight_offset, compiled_head_norms, memory_efficient
        As in ``swap_rmsnorm``.

    Returns
    -------
    int
        How many norm modules were swapped.

    Raises
    ------
    ValueError
        No Hugging Face decoder layers; a post-norm layer or one matching no template (the message names
        the class and the first line that differs); a norm ``swap_rmsnorm`` does not replace; its errors.
    TypeError
        model is not a torch.nn.Module; weight_offset is not a number; memory_efficient is not a bool.
    """
    check_swap_arguments(model, weight_offset, compiled_head_norms, memory_efficient)
    patch = _planned_patch(model)
    # Called directly from here, so that its warnings name this function and point at its caller.
    swapped = _swap_norms(
        model, weight_offset, compiled_head_norms, "fuse_residual_rmsnorm", memory_efficient
    )
    patch()
    return swapped
