"""The residual add fused into the norm where models write it outside the norm module.

Pre-norm decoders write ``h = residual + out; y = norm(h)``: an add kernel (read two, write one) and a
norm kernel (read one, write one). ``CakeRMSNorm.forward(out, residual=residual)`` returns ``(y, h)`` from one
kernel that reads two and writes two, and its backward adds the residual branch's gradient into dx in
the same pass. Two ways to get there:

* your own blocks: call ``add_rmsnorm(norm, out, residual)`` where the block adds and normalizes; it
  is the fused kernel once ``norm`` is a ``CakeRMSNorm`` and torch's add + norm before the swap::

      normed, h = add_rmsnorm(self.ffn_norm, attn_out, h)
      h = h + self.feed_forward(normed)

* Hugging Face pre-norm decoders (Llama, Qwen2, Qwen3, Mistral, Gemma, Mixtral, Qwen3-MoE, and any
  decoder layer whose forward is that same pattern): ``fuse_residual_rmsnorm(model)`` swaps the norms
  (``swap_rmsnorm``) and replaces each decoder layer's
  ``forward`` on the instance (as Liger patches instances; the class, the module tree and the state
  dict are unchanged).

The patched layer computes its post-attention norm as ``(y, h) = norm(attn_out, residual=residual)``. The add
that ends a layer belongs to the *next* norm (the next layer's input norm, or the model's final norm):
the layer computes ``(y, h) = next_norm(mlp_out, residual)``, returns h (so hooks, captured hidden
states and anything else between layers see the true hidden state) and hands y to the next norm,
which uses it only if it is called on that very h (and y is in the autograd graph whenever h is: a
reentrant checkpoint that ran the producer without grad fails that); otherwise it normalizes h itself.
A layer that transformers checkpoints (``gradient_checkpointing_enable``) runs its own, unfused
forward under the checkpoint, which the patch would otherwise bypass. Nothing is handed over when the
next norm's weight is a DTensor (FSDP2 keeps it sharded outside the next layer's forward): the layer
then ends with torch's add, and only its post-attention add is fused.

The forward values are bitwise those of the unfused cake model (the kernel rounds ``h = a + b`` to
the activation dtype exactly as torch's add does). The gradients agree to rounding: in bf16 / fp16
the fused backward adds the residual branch's gradient to dx before rounding once, where the unfused
graph rounds dx first; on a GPU the residual backward's launch plan may sum dW's partial rows over
another number of programs. On CPU (the ops' CPU kernels) FP32 gradients are bitwise.

Before patching, each layer class's ``forward`` source is checked statement by statement against the
pattern the patch computes; any other structure (Gemma 2/3's sandwich norms, a future transformers
release that changes the layer) raises a ``ValueError`` naming the class instead of computing
something else.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from .autograd import DTensor
from .module import CakeRMSNorm, _is_swappable, swap_rmsnorm

# The body a patchable decoder layer's forward must have, statement for statement; ATTENTION_CALL
# stands for ``hidden_states, _ = self.self_attn(hidden_states=hidden_states, ..., **kwargs)``, whose
# other keywords must each pass on the forward's parameter of the same name.
_PRENORM_BODY = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
ATTENTION_CALL
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""


def add_rmsnorm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """``(norm(x + residual), x + residual)``, in one fused kernel when ``norm`` is a ``CakeRMSNorm``.

    For blocks written ``h = residual + out; y = norm(h)``: write ``y, h = add_rmsnorm(norm, out,
    residual)`` instead, and the same block runs torch's add and norm before ``swap_rmsnorm`` and the
    fused kernel after it.

    Parameters
    ----------
    norm : torch.nn.Module
        A ``CakeRMSNorm``, or any module that normalizes one tensor (``torch.nn.RMSNorm``, ...).
    x, residual : torch.Tensor
        Added in x's dtype (the result rounded once, as torch's add rounds it).

    Returns
    -------
    tuple of torch.Tensor
        ``(y, h)`` with ``h = x + residual`` and ``y = norm(h)``.
    """
    if isinstance(norm, CakeRMSNorm):
        return norm(x, residual=residual)
    h = x + residual
    return norm(h), h


@dataclass(eq=False)
class _Handoff:
    """The normalized output a layer computed for the next norm, keyed by that norm and by the hidden
    state it normalized; shared by the patched layers of one model, consumed by the first read."""

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


@dataclass(frozen=True)
class _LayerPlan:
    """How a decoder layer class's forward arguments reach its ``self_attn`` call."""

    positional: tuple[str, ...]  # the parameters after hidden_states that can be given by position
    named: frozenset  # every named parameter after hidden_states
    defaults: dict
    forwarded: frozenset  # the ones passed on to self_attn by name


@dataclass(eq=False)
class _LayerFusion:
    """What a patched layer needs besides itself: how its forward's arguments reach the attention,
    the norm that follows it and the model's hand-off."""

    handoff: _Handoff
    next_norm: CakeRMSNorm | None
    plan: _LayerPlan

    def attention_kwargs(self, args: tuple, kwargs: dict) -> dict:
        """The keywords the original forward would pass to ``self_attn`` for this call."""
        plan = self.plan
        if len(args) > len(plan.positional):
            raise TypeError(
                f"decoder layer forward takes {len(plan.positional) + 1} positional arguments, "
                f"got {len(args) + 1}"
            )
        bound = {**plan.defaults, **dict(zip(plan.positional, args)), **kwargs}
        # Named parameters the original does not pass on are dropped; its **kwargs are passed on.
        return {k: v for k, v in bound.items() if k in plan.forwarded or k not in plan.named}


def _checkpointing(layer: nn.Module) -> bool:
    """Whether transformers' ``GradientCheckpointingLayer`` would checkpoint this call (its condition)."""
    return getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled()


def _fused_layer_forward(self, hidden_states, *args, **kwargs):
    """A pre-norm decoder layer with both residual adds done by the norm kernels (see the module)."""
    fusion: _LayerFusion = self._cake_fusion
    normed = fusion.handoff.take(self.input_layernorm, hidden_states)
    if _checkpointing(self):
        # transformers checkpoints inside the class's forward, which this instance attribute shadows:
        # run that (the unfused layer under checkpointing) rather than silently not checkpointing.
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if normed is None:
        normed = self.input_layernorm(hidden_states)
    attention_out, _ = self.self_attn(hidden_states=normed, **fusion.attention_kwargs(args, kwargs))
    normed, hidden_states = self.post_attention_layernorm(attention_out, residual=hidden_states)
    mlp_out = self.mlp(normed)
    # A DTensor weight outside its own layer's forward is FSDP2's shard (or tensor-parallel): the
    # next layer's norm can only run inside that layer's forward.
    if fusion.next_norm is None or isinstance(fusion.next_norm.weight, DTensor):
        return hidden_states + mlp_out
    y, hidden_states = fusion.next_norm(mlp_out, residual=hidden_states)
    fusion.handoff.give(fusion.next_norm, y, hidden_states)
    return hidden_states


def _final_norm_forward(self, x, residual=None, *, handoff: _Handoff):
    """The model's final norm: the y the last layer handed over for this x, else ``CakeRMSNorm``."""
    if residual is None:
        y = handoff.take(self, x)
        if y is not None:
            return y
    return CakeRMSNorm.forward(self, x, residual=residual)


def _is_name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _forwarded_by_attention_call(stmt: ast.stmt, params: inspect.Signature) -> frozenset | None:
    """The forward parameters ``hidden_states, _ = self.self_attn(...)`` passes on by name, or None
    if the statement is anything else."""
    call = stmt.value if isinstance(stmt, ast.Assign) else None
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
    if (
        not isinstance(call, ast.Call)
        or ast.dump(call.func) != ast.dump(ast.parse("self.self_attn", mode="eval").body)
        or call.args
        or not isinstance(target, ast.Tuple)
        or [ast.dump(e) for e in target.elts]
        != [ast.dump(ast.Name(n, ast.Store())) for n in ("hidden_states", "_")]
    ):
        return None
    var_keyword = next((p.name for p in params.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    forwarded = set()
    for keyword in call.keywords:
        if keyword.arg is None:
            if var_keyword is None or not _is_name(keyword.value, var_keyword):
                return None
        elif keyword.arg == "hidden_states":
            if not _is_name(keyword.value, "hidden_states"):
                return None
        elif keyword.arg in params.parameters and _is_name(keyword.value, keyword.arg):
            forwarded.add(keyword.arg)
        else:
            return None
    return frozenset(forwarded)


@functools.cache
def _layer_plan(cls: type) -> _LayerPlan:
    """The plan of a decoder layer class whose forward is the pre-norm pattern; ValueError naming the
    class otherwise."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError) as e:
        raise ValueError(f"{cls.__qualname__}.forward has no readable source to check ({e})") from None
    function = ast.parse(source).body[0]
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    template = ast.parse(_PRENORM_BODY).body
    signature = inspect.signature(cls.forward)
    names = list(signature.parameters)
    problem, forwarded = None, frozenset()
    if names[:2] != ["self", "hidden_states"]:
        problem = "its first argument is not hidden_states"
    elif len(body) != len(template):
        problem = f"it has {len(body)} statements, the pre-norm pattern {len(template)}"
    else:
        for expected, actual in zip(template, body):
            if _is_name(getattr(expected, "value", None), "ATTENTION_CALL"):
                forwarded = _forwarded_by_attention_call(actual, signature)
                if forwarded is None:
                    problem = f"line {actual.lineno}: not self_attn called with the forward's arguments"
                    break
            elif ast.dump(expected) != ast.dump(actual):
                problem = f"line {actual.lineno}: {ast.unparse(actual)!r}"
                break
    if problem is not None:
        raise ValueError(
            f"cannot fuse the residual adds of {cls.__qualname__}: its forward is not the pre-norm "
            f"decoder pattern the patch computes ({problem}); use swap_rmsnorm alone"
        )
    named = [p for p in signature.parameters.values() if p.name not in ("self", "hidden_states")]
    return _LayerPlan(
        positional=tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD),
        named=frozenset(p.name for p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)),
        defaults={p.name: p.default for p in named if p.default is not p.empty},
        forwarded=forwarded,
    )


def _decoder_stacks(model: nn.Module) -> list[tuple[nn.Module, nn.ModuleList]]:
    """(owner, layers) for every ModuleList of modules that have both an ``input_layernorm`` and a
    ``post_attention_layernorm`` (the Hugging Face decoder-layer naming)."""
    stacks = []
    for owner in model.modules():
        for child in owner.children():
            if (
                isinstance(child, nn.ModuleList)
                and len(child)
                and all(
                    hasattr(m, "input_layernorm") and hasattr(m, "post_attention_layernorm") for m in child
                )
            ):
                stacks.append((owner, child))
    return stacks


def _require_swappable_norms(layer: nn.Module) -> None:
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name)
        if not isinstance(norm, CakeRMSNorm) and not _is_swappable(norm):
            raise ValueError(
                f"{type(layer).__qualname__}.{name} is a {type(norm).__qualname__}, which swap_rmsnorm "
                "does not replace; the fused residual needs a CakeRMSNorm there"
            )


def _planned_patch(model: nn.Module):
    """Check that every decoder layer of ``model`` can be patched, before anything changes (a
    ``ValueError`` naming what is not), and return the function that patches them once their norms are
    ``CakeRMSNorm``."""
    stacks = _decoder_stacks(model)
    if not stacks:
        raise ValueError(
            f"{type(model).__qualname__} has no Hugging Face-style decoder layers (a ModuleList of layers "
            "with input_layernorm and post_attention_layernorm) to fuse; in your own blocks call "
            "cake_cute.add_rmsnorm(norm, x, residual) where the residual is added before a norm"
        )
    plans = {}
    for _, layers in stacks:
        for layer in layers:
            plans[layer] = _layer_plan(type(layer))
            _require_swappable_norms(layer)

    def patch() -> int:
        for owner, layers in stacks:
            handoff = _Handoff()
            final = getattr(owner, "norm", None)
            final = final if isinstance(final, CakeRMSNorm) else None
            followers = [layer.input_layernorm for layer in layers[1:]] + [final]
            for layer, next_norm in zip(layers, followers):
                layer._cake_fusion = _LayerFusion(handoff, next_norm, plans[layer])
                layer.forward = _fused_layer_forward.__get__(layer, type(layer))
            if final is not None:
                final.forward = functools.partial(_final_norm_forward, final, handoff=handoff)

    return patch


def fuse_residual_rmsnorm(model: nn.Module, weight_offset: float | None = None) -> int:
    """Swap the RMSNorm modules of a Hugging Face pre-norm decoder for ``CakeRMSNorm`` (``swap_rmsnorm``)
    and fuse every residual add into the norm that follows it. The layers are checked before anything
    is swapped.

    Parameters
    ----------
    model : torch.nn.Module
        E.g. a ``LlamaForCausalLM``; changed in place (layer forwards are replaced on the instances).
    weight_offset : float, optional
        As in ``swap_rmsnorm`` (Gemma's ``1 + weight`` is recognized from the norm's source).

    Returns
    -------
    int
        How many norm modules were swapped.

    Raises
    ------
    ValueError
        The model has no decoder layers in the Hugging Face layout, a layer's forward is not the
        pre-norm pattern, or a layer's norm is not one ``swap_rmsnorm`` replaces (the message names the
        class); ``swap_rmsnorm``'s errors.
    TypeError
        weight_offset is not a number.
    """
    patch = _planned_patch(model)
    swapped = swap_rmsnorm(model, weight_offset)
    patch()
    return swapped
