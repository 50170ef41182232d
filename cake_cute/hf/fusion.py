"""The residual add fused into the norm where models write it outside the norm module.

Pre-norm decoders write ``h = residual + out; y = norm(h)``: an add kernel (read two, write one) and a
norm kernel (read one, write one). ``CakeRMSNorm.forward(out, residual=residual)`` returns ``(y, h)``
from one kernel that reads two and writes two, and its backward adds the residual branch's gradient
into dx in the same pass. Two ways to get there:

* your own blocks: call ``add_rmsnorm(norm, out, residual)`` where the block adds and normalizes; it
  is the fused kernel once ``norm`` is a ``CakeRMSNorm`` and torch's add + norm before the swap::

      normed, h = add_rmsnorm(self.ffn_norm, attn_out, h)
      h = h + self.feed_forward(normed)

* Hugging Face decoders: ``fuse_residual_rmsnorm(model)`` swaps the norms (``swap_rmsnorm``) and
  gives each decoder layer a fused forward, once its class's forward matched one of the templates of
  ``cake_cute.hf.plans`` (any other forward is refused there, before anything changes).

The layer's class is swapped for a subclass created once per class (same ``__name__``, so name-based
wrap policies still match; pickled and deep-copied as "that class, fused", see ``_rebuild_fused``):
the module tree and the state dict are unchanged, ``torch.save`` / ``torch.load`` of the whole model
and ``copy.deepcopy`` keep it fused, and transformers' gradient checkpointing (which wraps the
class's ``forward``) checkpoints the fused forward.

The add in the middle of a layer feeds the layer's own norm: ``(y, h) = norm(branch, residual=h)``.
The add that ends a layer belongs to the *next* norm (the next layer's input norm, or the model's final
norm): the layer computes ``(y, h) = next_norm(branch, residual=h)``, returns h (so hooks, captured
hidden states and anything else between layers see the true hidden state) and hands y to the next
norm, which uses it only if it is called on that very h with y in the autograd graph whenever h is;
otherwise it normalizes h itself. Nothing is handed over when the next norm's weight is a DTensor
(FSDP2 keeps it sharded outside the next layer's forward) or in the first, gradient-free pass of
reentrant checkpointing; such a layer ends with torch's add.

Each add is decided per call: fused when both operands have one dtype the kernels take and the same
shape; otherwise (autocast with fp32 master weights: an fp32 residual stream plus a bf16 attention or
MLP output) torch's type-promoting add and then the norm, exactly what the unfused model computes.

Under non-reentrant checkpointing the backward re-runs a layer's forward on the same input objects
and must save the same tensors as the first run. A layer that used a handed-over y records its input
(weakly); its recompute normalizes that input without grad (bitwise the y it was handed; the gradient
to y flows through the graph of the first run) and hands nothing over. Under torch.compile a
checkpointed layer is traced as a region that may not change state outside itself: it hands nothing
over in either direction (its in-layer add stays fused).

The forward values are bitwise those of the unfused cake model (the kernel rounds ``h = a + b`` to
the activation dtype exactly as torch's add does). The gradients agree to rounding: in bf16 / fp16
the fused backward adds the residual branch's gradient to dx before rounding once, where the unfused
graph rounds dx first; on a GPU the residual backward's launch plan may sum dW's partial rows over
another number of programs. On CPU (the ops' CPU kernels) FP32 gradients are bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import validation as v
from ..forward_names import INPUT_NAME, with_input_named
from ..module import TORCH_MATH, CakeRMSNorm
from ..routing import DTensor
from ..vocab import DTYPE_BY_TORCH
from .plans import _layer_plan, _LayerPlan
from .swap import _is_swappable, _swap_norms, check_swap_arguments


def _fusable(branch: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``residual + branch`` is the fused kernel's add: one dtype it takes, one shape (no type
    promotion, no broadcast)."""
    return (
        branch.dtype == residual.dtype
        and branch.dtype in DTYPE_BY_TORCH  # an activation dtype the kernels take
        and branch.shape == residual.shape
        and branch.device == residual.device
    )


def add_rmsnorm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """``(norm(residual + x), residual + x)``, in one fused kernel when ``norm`` is a ``CakeRMSNorm``
    and x and residual share a shape and a dtype the kernels take.

    For blocks written ``h = residual + out; y = norm(h)``: write ``y, h = add_rmsnorm(norm, out,
    residual)`` instead, and the same block runs torch's add and norm before ``swap_rmsnorm`` and the
    fused kernel after it. Operands of different dtypes (an fp32 residual stream and a bf16 branch
    under autocast) take torch's type-promoting add and then the norm, as the unfused block would.

    Parameters
    ----------
    norm : torch.nn.Module
        A ``CakeRMSNorm``, or any module that normalizes one tensor (``torch.nn.RMSNorm``, ...).
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
    """The normalized output a layer computed for the next norm, keyed by that norm and by the hidden
    state it normalized; shared by the fused layers of one model, consumed by the first read. Not
    pickled or copied: a y in flight belongs to one forward."""

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
    """``gradient_checkpointing_enable`` set this layer to checkpoint and the model is training. In
    newer transformers each layer (a ``GradientCheckpointingLayer``) holds the flag and checkpoints its
    own call; in older ones (4.51) the model holding the layers holds it and checkpoints each call."""
    holder = layer if hasattr(layer, "gradient_checkpointing") else layer._cake_fusion.stack_owner
    return getattr(holder, "gradient_checkpointing", False) and layer.training


def _checkpointing(layer: nn.Module) -> bool:
    """Whether transformers' ``GradientCheckpointingLayer`` checkpoints this call (its condition)."""
    return _checkpoint_enabled(layer) and torch.is_grad_enabled()


def _traced_in_checkpoint(layer: nn.Module) -> bool:
    """A checkpointed call traced by torch.compile: the region may not change state outside itself
    (dynamo refuses such side effects), so nothing is handed over into or out of it."""
    return _checkpointing(layer) and torch.compiler.is_compiling()


def _reentrant_first_pass(layer: nn.Module) -> bool:
    """A checkpointed layer running without grad: reentrant checkpointing's first pass (or a
    ``no_grad`` call of a training model), whose outputs the backward recomputes from detached inputs."""
    return _checkpoint_enabled(layer) and not torch.is_grad_enabled()


@dataclass(eq=False)
class _LayerFusion:
    """What a fused layer instance needs besides its class's plan: the model's hand-off, the norm
    that follows the layer, the module holding the layers (whose flag says whether transformers 4.x
    checkpoints them), and (under non-reentrant checkpointing) the inputs it was handed a y for."""

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
    """The first base of each class ``_fused_class`` creates: the fused forward of the matched
    template, and pickling as "this transformers class, fused"."""

    _cake_base: type
    _cake_plan: _LayerPlan

    def forward(self, hidden_states, *args, **kwargs):
        """The layer's forward with its residual adds in the norm kernels (see the module)."""
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
    """The fused subclass of a decoder-layer class (created once): ``_FusedDecoderLayer`` first, the
    same ``__name__``; transformers' checkpointing wrapper wraps its forward as it wraps every layer's."""
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
    """An empty fused layer of ``base`` for pickle and deepcopy to fill (its template is checked
    against the installed ``base`` again)."""
    fused = _fused_class(base)
    return fused.__new__(fused)


class _FinalRMSNorm(CakeRMSNorm):
    """A model's final norm after fusion: the y the last layer handed over for this input, else a
    ``CakeRMSNorm``."""

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
    """(owner, layers) for every ModuleList of modules that each have a ``self_attn`` and an
    RMSNorm-shaped child (the Hugging Face decoder-layer layout)."""
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
    """Check that every decoder layer of ``model`` can be fused, before anything changes (a
    ``ValueError`` naming what is not), and return the function that fuses them once their norms are
    ``CakeRMSNorm``."""
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
    """Swap the RMSNorm modules of a Hugging Face decoder for ``CakeRMSNorm`` (``swap_rmsnorm``) and fuse
    every residual add that feeds a norm into that norm. The layers are checked before anything is
    swapped; calling it again on a fused model re-fuses it (e.g. after layers were replaced).

    Parameters
    ----------
    model : torch.nn.Module
        E.g. a ``LlamaForCausalLM``, or a PEFT model wrapping one; changed in place (each decoder
        layer's class becomes its fused subclass; the module tree and the state dict stay the same).
    weight_offset : float, optional
        As in ``swap_rmsnorm`` (Gemma's ``1 + weight`` is recognized from the norm's source).
    compiled_head_norms : str
        As in ``swap_rmsnorm``: what a compiled graph runs for the per-head q / k norms, ``"torch"``
        (the default: their PyTorch math, left to inductor) or ``"kernel"``.
    memory_efficient : bool
        As in ``swap_rmsnorm``: every norm saves its output instead of its input (in residual mode
        h_new is then not saved by the norm).

    Returns
    -------
    int
        How many norm modules were swapped.

    Raises
    ------
    ValueError
        The model has no decoder layers in the Hugging Face layout; a layer's forward is a post-norm
        layer (nothing to fuse) or matches no template (the message names the class and the first
        line that differs); a layer's norm is not one ``swap_rmsnorm`` replaces; ``swap_rmsnorm``'s errors
        (its arguments' are checked first).
    TypeError
        model is not a torch.nn.Module; weight_offset is not a number; memory_efficient is not a bool
        (the arguments are checked before anything else).
    """
    check_swap_arguments(model, weight_offset, compiled_head_norms, memory_efficient)
    patch = _planned_patch(model)
    # Called directly from here, so that its warnings name this function and point at its caller.
    swapped = _swap_norms(
        model, weight_offset, compiled_head_norms, "fuse_residual_rmsnorm", memory_efficient
    )
    patch()
    return swapped
