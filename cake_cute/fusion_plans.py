"""Whether and how a decoder layer's residual adds can be fused: decided once per layer class.

A Hugging Face decoder layer's forward is matched, statement by statement, against a small table of
templates (``_TEMPLATES``): pre-norm (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V3, SmolLM3,
GLM, Phi3's residual dropouts, Granite's residual multiplier, Llama4's mixture-of-experts tuple) and
sandwich-norm (Gemma2/3, GLM4). Post-norm layers (OLMo2/3) are recognized and refused: no residual add in
them feeds a norm. Any other forward is refused naming its class and the first line that differs, instead
of computing something else. A match gives the class's ``_LayerPlan``: the names and branch ops the fused
forward (``cake_cute.fusion``) runs.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class _Branch:
    """What a template's ``BRANCH(v)`` matched: the expression added to the residual stream, one of
    ``v``, ``self.<attr>(v)`` (Phi3's residual dropouts), ``v * self.<attr>`` or ``self.<attr> * v``
    (Granite's residual multiplier) and ``v.view(residual.shape)`` (Llama4's MoE output)."""

    kind: str  # "identity", "module", "scale_right", "scale_left", "view_as_residual"
    attr: str | None = None

    def apply(self, layer: nn.Module, value: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The same op the original forward applies to the branch before its add."""
        if self.kind == "module":
            return getattr(layer, self.attr)(value)
        if self.kind == "scale_right":
            return value * getattr(layer, self.attr)
        if self.kind == "scale_left":
            return getattr(layer, self.attr) * value
        if self.kind == "view_as_residual":
            return value.view(residual.shape)
        return value


def _self_attr(node) -> str | None:
    """``x`` for the expression ``self.x``, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _branch(node, variable: str) -> _Branch | None:
    """The ``_Branch`` an add operand ``node`` is over the variable named ``variable``, or None."""
    if isinstance(node, ast.Name) and node.id == variable:
        return _Branch("identity")
    if (
        isinstance(node, ast.Call)
        and _self_attr(node.func) is not None
        and not node.keywords
        and len(node.args) == 1
        and _is_name(node.args[0], variable)
    ):
        return _Branch("module", _self_attr(node.func))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if _is_name(node.left, variable) and _self_attr(node.right) is not None:
            return _Branch("scale_right", _self_attr(node.right))
        if _self_attr(node.left) is not None and _is_name(node.right, variable):
            return _Branch("scale_left", _self_attr(node.left))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "view"
        and _is_name(node.func.value, variable)
        and not node.keywords
        and len(node.args) == 1
        and ast.dump(node.args[0]) == ast.dump(ast.parse("residual.shape", mode="eval").body)
    ):
        return _Branch("view_as_residual")
    return None


def _is_name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


@dataclass(frozen=True)
class _Template:
    """A decoder-layer forward body the fused forward computes (``fusable``) or that is recognized in
    order to be refused with ``refusal``. Placeholders: a statement ``ATTENTION_CALL`` is
    ``OUT, _ = self.self_attn(hidden_states=hidden_states, ...)`` passing the forward's own arguments on
    by name; upper-case names and ``self.UPPER`` attributes bind to any name / attribute (the same one at
    every use); ``BRANCH(v)`` is a ``_Branch`` over v."""

    name: str
    body: str
    fusable: bool = True
    refusal: str = ""


_TEMPLATES = (
    _Template(
        "pre-norm",
        """
residual = hidden_states
hidden_states = self.INPUT_NORM(hidden_states)
ATTENTION_CALL
hidden_states = residual + BRANCH(ATTN_OUT)
residual = hidden_states
hidden_states = self.MID_NORM(hidden_states)
hidden_states = self.MLP(hidden_states)
hidden_states = residual + BRANCH(hidden_states)
return hidden_states
""",
    ),
    _Template(
        "pre-norm with a mixture-of-experts tuple",
        """
residual = hidden_states
hidden_states = self.INPUT_NORM(hidden_states)
ATTENTION_CALL
hidden_states = residual + BRANCH(ATTN_OUT)
residual = hidden_states
hidden_states = self.MID_NORM(hidden_states)
hidden_states = self.MLP(hidden_states)
if self.is_moe_layer:
    hidden_states, _ = hidden_states
hidden_states = residual + BRANCH(hidden_states)
return hidden_states
""",
    ),
    _Template(
        "sandwich-norm",
        """
residual = hidden_states
hidden_states = self.INPUT_NORM(hidden_states)
ATTENTION_CALL
hidden_states = self.POST_ATTENTION_NORM(ATTN_OUT)
hidden_states = residual + BRANCH(hidden_states)
residual = hidden_states
hidden_states = self.MID_NORM(hidden_states)
hidden_states = self.MLP(hidden_states)
hidden_states = self.POST_MLP_NORM(hidden_states)
hidden_states = residual + BRANCH(hidden_states)
return hidden_states
""",
    ),
    _Template(
        "post-norm",
        """
residual = hidden_states
ATTENTION_CALL
hidden_states = self.POST_ATTENTION_NORM(ATTN_OUT)
hidden_states = residual + BRANCH(hidden_states)
residual = hidden_states
hidden_states = self.MLP(hidden_states)
hidden_states = self.POST_MLP_NORM(hidden_states)
hidden_states = residual + BRANCH(hidden_states)
return hidden_states
""",
        fusable=False,
        refusal="it is a post-norm layer (each branch is normalized before its residual add and no norm "
        "follows an add: the next layer's attention reads the sum directly), so no residual add feeds a "
        "norm and there is nothing to fuse",
    ),
)


@dataclass(frozen=True)
class _LayerPlan:
    """What the fused forward of one decoder-layer class needs: how the forward's arguments reach its
    ``self_attn`` call, and the names and branch ops the matched template bound."""

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
    attention_branch: _Branch
    mlp_branch: _Branch
    moe_tuple: bool  # the MLP returns (out, router logits) when self.is_moe_layer

    def attention_kwargs(self, args: tuple, kwargs: dict) -> dict:
        """The keywords the original forward would pass to ``self_attn`` for this call."""
        if len(args) > len(self.positional):
            raise TypeError(
                f"decoder layer forward takes {len(self.positional) + 1} positional arguments, "
                f"got {len(args) + 1}"
            )
        bound = {**self.defaults, **dict(zip(self.positional, args)), **kwargs}
        # Named parameters the original does not pass on are dropped; its **kwargs are passed on.
        return {k: v for k, v in bound.items() if k in self.forwarded or k not in self.named}


class _Mismatch(Exception):
    """A template statement the forward's statement does not match."""


def _attention_call(stmt: ast.stmt, signature: inspect.Signature) -> tuple[str, frozenset] | None:
    """(the output name, the forward parameters passed on by name) of
    ``out, _ = self.self_attn(hidden_states=hidden_states, ...)``, or None if ``stmt`` is anything else."""
    call = stmt.value if isinstance(stmt, ast.Assign) else None
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
    if (
        not isinstance(call, ast.Call)
        or _self_attr(call.func) != "self_attn"
        or call.args
        or not isinstance(target, ast.Tuple)
        or len(target.elts) != 2
        or not all(isinstance(e, ast.Name) for e in target.elts)
    ):
        return None
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    forwarded, has_hidden_states = set(), False
    for keyword in call.keywords:
        if keyword.arg is None:
            if var_keyword is None or not _is_name(keyword.value, var_keyword):
                return None
        elif keyword.arg == "hidden_states":
            if not _is_name(keyword.value, "hidden_states"):
                return None
            has_hidden_states = True
        elif keyword.arg in signature.parameters and _is_name(keyword.value, keyword.arg):
            forwarded.add(keyword.arg)
        else:
            return None
    return (target.elts[0].id, frozenset(forwarded)) if has_hidden_states else None


def _is_placeholder(name: str) -> bool:
    return name.isupper()


def _unify(template, actual, bindings: dict) -> None:
    """Match an AST node of a template against the forward's node, binding placeholders; _Mismatch
    if they differ."""
    if isinstance(template, ast.Name) and _is_placeholder(template.id):
        if not isinstance(actual, ast.Name) or bindings.setdefault(template.id, actual.id) != actual.id:
            raise _Mismatch
        return
    attr = _self_attr(template)
    if attr is not None and _is_placeholder(attr):
        if _self_attr(actual) is None or bindings.setdefault(attr, _self_attr(actual)) != _self_attr(actual):
            raise _Mismatch
        return
    if isinstance(template, ast.Call) and _is_name(template.func, "BRANCH"):
        variable = template.args[0].id
        branch = _branch(actual, bindings.get(variable, variable))
        if branch is None:
            raise _Mismatch
        bindings.setdefault("branches", []).append(branch)
        return
    if type(template) is not type(actual):
        raise _Mismatch
    for name in template._fields:
        expected, found = getattr(template, name), getattr(actual, name)
        if isinstance(expected, list):
            if not isinstance(found, list) or len(found) != len(expected):
                raise _Mismatch
            for e, f in zip(expected, found):
                _unify(e, f, bindings)
        elif isinstance(expected, ast.AST):
            _unify(expected, found, bindings)
        elif expected != found:
            raise _Mismatch


def _match(template: _Template, body: list, signature: inspect.Signature) -> dict | tuple[int, str]:
    """The bindings of ``template`` in the forward's statements, or (how many statements matched,
    the problem)."""
    statements = ast.parse(template.body).body
    bindings: dict = {}
    if len(body) != len(statements):
        return 0, f"it has {len(body)} statements, the {template.name} template {len(statements)}"
    for index, (expected, actual) in enumerate(zip(statements, body)):
        if isinstance(expected, ast.Expr) and _is_name(expected.value, "ATTENTION_CALL"):
            found = _attention_call(actual, signature)
            if found is None:
                return index, f"line {actual.lineno}: not self_attn called with the forward's arguments"
            bindings["ATTN_OUT"], bindings["forwarded"] = found
            continue
        try:
            _unify(expected, actual, bindings)
        except _Mismatch:
            return index, f"line {actual.lineno}: {ast.unparse(actual)!r}"
    return bindings


@functools.cache
def _layer_plan(cls: type) -> _LayerPlan:
    """The plan of a decoder-layer class whose forward matches a fusable template; a ValueError naming
    the class (and the first line that matches no template) otherwise."""
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
    closest = (-1, "")
    for template in _TEMPLATES:
        found = _match(template, body, signature)
        if isinstance(found, tuple):
            closest = max(closest, (found[0], f"closest, the {template.name} template: {found[1]}"))
            continue
        if not template.fusable:
            raise ValueError(f"{prefix}: {template.refusal}; use swap_rmsnorm alone")
        return _plan(template, found, signature)
    raise ValueError(
        f"{prefix}: its forward ({inspect.getsourcefile(forward)}) is none of the decoder-layer templates "
        f"the fused forward computes ({', '.join(t.name for t in _TEMPLATES if t.fusable)}; "
        f"{closest[1]}); use swap_rmsnorm alone"
    )


def _plan(template: _Template, bindings: dict, signature: inspect.Signature) -> _LayerPlan:
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
        moe_tuple="mixture-of-experts" in template.name,
    )
