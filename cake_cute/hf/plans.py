"""Whether and how a decoder layer's residual adds can be fused, decided once per layer class.

The forward is matched, statement by statement, against ``cake_cute.hf.templates``: pre-norm and
sandwich-norm layers are fused; post-norm layers are refused, since no residual add in them feeds a
norm. Any other forward is refused naming its class, the closest template and the first statement that
differs, rather than computing something else. A match gives the class's ``_LayerPlan``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass, replace

import torch
from torch import nn

from .forms import Form, assigned_names, checked_form, normalized, setup_function, setup_statements
from .templates import TEMPLATES, Branch, Template, match


@dataclass(frozen=True)
class _LayerPlan:
    """What one decoder-layer class's fused forward needs: argument binding and the template's names."""

    template: str
    positional: tuple[str, ...]  # the parameters after hidden_states that can be given by position
    named: frozenset  # every named parameter after hidden_states
    defaults: dict
    forwarded: frozenset  # the ones passed on to self_attn by name
    mlp: str
    input_norm: str  # the layer's first norm, which the previous layer's last add feeds
    mid_norm: str  # the norm the in-layer add feeds
    post_attention_norm: str | None  # sandwich layers normalize each branch before its add
    post_mlp_norm: str | None
    attention_branch: Branch
    mlp_branch: Branch
    mlp_output: str  # how the MLP's output holds router logits: one of forms.MLP_OUTPUTS
    # None: the forward returns hidden_states. Else it returns a tuple, (hidden_states,) followed, for
    # each (flag, source) whose flag argument is true, by the attention weights ("attention") or the
    # router logits ("router"): transformers 4.x's `outputs = (hidden_states,)` tail.
    outputs: tuple[tuple[str, str], ...] | None = None
    # The forward's statements that prepare the attention call's arguments, as a function run on the
    # bound arguments (``forms.setup_function``), or None.
    setup: object = None

    def bind(self, layer: nn.Module, args: tuple, kwargs: dict) -> dict:
        """The forward's arguments after hidden_states by name, defaults filled, setup statements run."""
        if len(args) > len(self.positional):
            raise TypeError(
                f"decoder layer forward takes {len(self.positional) + 1} positional arguments, "
                f"got {len(args) + 1}"
            )
        bound = {**self.defaults, **dict(zip(self.positional, args)), **kwargs}
        if self.setup is not None:
            self.setup(layer, bound)
        return bound

    def attention_kwargs(self, bound: dict) -> dict:
        """The keywords the original forward would pass to ``self_attn``."""
        # Named parameters the original does not pass on are dropped; its **kwargs are passed on.
        return {k: v for k, v in bound.items() if k in self.forwarded or k not in self.named}

    def split_mlp_output(self, layer: nn.Module, output):
        """``(branch, router logits or None)`` from the MLP's output, as the original unpacks it."""
        kind = self.mlp_output
        if kind == "always" or (kind == "is_moe_layer" and layer.is_moe_layer):
            return output
        if kind == "if_tuple" and isinstance(output, tuple):
            return output
        return output, None

    def result(self, hidden_states: torch.Tensor, bound: dict, attention, router):
        """What the original forward returns: hidden_states, or its 4.x outputs tuple."""
        if self.outputs is None:
            return hidden_states
        found = {"attention": attention, "router": router}
        return (hidden_states, *(found[source] for flag, source in self.outputs if bound.get(flag)))


@functools.cache
def _layer_plan(cls: type) -> _LayerPlan:
    """The plan of a class matching a fusable template; else a ValueError naming the difference."""
    forward = inspect.unwrap(cls.forward)
    prefix = f"cannot fuse the residual adds of {cls.__qualname__}"
    try:
        lines, first_line = inspect.getsourcelines(forward)
    except (OSError, TypeError) as e:
        raise ValueError(f"{prefix}: its forward has no readable source to check ({e})") from None
    function = ast.parse(textwrap.dedent("".join(lines))).body[0]
    ast.increment_lineno(function, first_line - 1)  # lines of the file, as tracebacks show them
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    signature = inspect.signature(forward)
    if list(signature.parameters)[:2] != ["self", "hidden_states"]:
        raise ValueError(f"{prefix}: its forward's first argument is not hidden_states; use swap_rmsnorm")
    setup, body = setup_statements(body, signature)
    local_names = assigned_names(setup) - set(signature.parameters)
    body, form = normalized(body)
    closest = (-1, "")
    for template in TEMPLATES:
        found = match(template, body, signature, local_names)
        if not isinstance(found, tuple):
            if not template.fusable:
                raise ValueError(f"{prefix}: {template.refusal}; use swap_rmsnorm alone")
            form = checked_form(form, found, signature)
            if isinstance(form, str):
                raise ValueError(f"{prefix}: {form}; use swap_rmsnorm alone")
            plan = _plan(template, found, signature, form)
            return _with_setup(plan, setup, local_names, forward) if setup else plan
        if found[0] > closest[0]:  # the first template that matches the most statements in a row
            closest = (found[0], f"closest, the {template.name} template: {found[1]}")
    raise ValueError(
        f"{prefix}: its forward ({inspect.getsourcefile(forward)}) is none of the decoder-layer templates "
        f"the fused forward computes ({', '.join(t.name for t in TEMPLATES if t.fusable)}; "
        f"{closest[1]}); use swap_rmsnorm alone"
    )


def _with_setup(plan: _LayerPlan, setup: list, local_names: frozenset, forward) -> _LayerPlan:
    """``plan`` running the forward's setup statements on its bound arguments."""
    names = (frozenset(inspect.signature(forward).parameters) - {"self"}) | local_names
    return replace(plan, setup=setup_function(setup, names, forward), named=plan.named | local_names)


def _plan(template: Template, bindings: dict, signature: inspect.Signature, form: Form) -> _LayerPlan:
    named = [p for p in signature.parameters.values() if p.name not in ("self", "hidden_states")]
    attention_branch, mlp_branch = bindings["branches"]
    return _LayerPlan(
        template=template.name,
        positional=tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD),
        named=frozenset(p.name for p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)),
        defaults={p.name: p.default for p in named if p.default is not p.empty},
        forwarded=bindings["forwarded"],
        mlp=bindings["MLP"],
        input_norm=bindings["INPUT_NORM"],
        mid_norm=bindings["MID_NORM"],
        post_attention_norm=bindings.get("POST_ATTENTION_NORM"),
        post_mlp_norm=bindings.get("POST_MLP_NORM"),
        attention_branch=attention_branch,
        mlp_branch=mlp_branch,
        mlp_output=form.mlp_output,
        outputs=form.outputs,
    )
