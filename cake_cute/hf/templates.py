"""The decoder-layer templates a Hugging Face forward is matched against, and the matcher.

``TEMPLATES`` holds the three forms a decoder layer's residual adds and norms come in: pre-norm,
sandwich-norm and post-norm (recognized in order to be refused). ``match`` binds a template's
placeholders in a forward's statements, or says how far it got and where the forward differs, which a
refusal names. This module knows only the syntax; ``cake_cute.hf.plans`` says what a match means.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Branch:
    """What a template's ``BRANCH(v)`` matched: the expression added to the residual stream."""

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


def self_attr(node) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def is_name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _branch(node, variable: str) -> Branch | None:
    """The ``Branch`` an add operand ``node`` is over ``variable``, or None."""
    if isinstance(node, ast.Name) and node.id == variable:
        return Branch("identity")
    if (
        isinstance(node, ast.Call)
        and self_attr(node.func) is not None
        and not node.keywords
        and len(node.args) == 1
        and is_name(node.args[0], variable)
    ):
        return Branch("module", self_attr(node.func))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if is_name(node.left, variable) and self_attr(node.right) is not None:
            return Branch("scale_right", self_attr(node.right))
        if self_attr(node.left) is not None and is_name(node.right, variable):
            return Branch("scale_left", self_attr(node.left))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "view"
        and is_name(node.func.value, variable)
        and not node.keywords
        and len(node.args) == 1
        and ast.dump(node.args[0]) == ast.dump(ast.parse("residual.shape", mode="eval").body)
    ):
        return Branch("view_as_residual")
    return None


@dataclass(frozen=True)
class Template:
    """A decoder-layer forward body the fused forward computes (``fusable``) or refuses (``refusal``).
    Placeholders: the statement ``ATTENTION_CALL`` is ``OUT, _ = self.self_attn(hidden_states=hidden_states,
    ...)`` passing the forward's arguments on by name; upper-case names and ``self.UPPER`` attributes bind
    to any name / attribute (the same at every use); ``BRANCH(v)`` is a ``Branch`` over v."""

    name: str
    body: str
    fusable: bool = True
    refusal: str = ""


def _layer_body(pre_norms: bool, post_norms: bool) -> str:
    """A decoder layer's forward body: attention then MLP, each adding its branch to the residual;
    ``pre_norms`` / ``post_norms`` normalize each block's input / branch."""
    statements = []
    for pre_norm, call, output, post_norm in (
        ("INPUT_NORM", "ATTENTION_CALL", "ATTN_OUT", "POST_ATTENTION_NORM"),
        ("MID_NORM", "hidden_states = self.MLP(hidden_states)", "hidden_states", "POST_MLP_NORM"),
    ):
        statements.append("residual = hidden_states")
        if pre_norms:
            statements.append(f"hidden_states = self.{pre_norm}(hidden_states)")
        statements.append(call)
        if post_norms:
            statements.append(f"hidden_states = self.{post_norm}({output})")
            output = "hidden_states"
        statements.append(f"hidden_states = residual + BRANCH({output})")
    return "\n".join([*statements, "return hidden_states"])


# In this order: a refusal names the first template that matches the most statements in a row.
TEMPLATES = (
    Template("pre-norm", _layer_body(pre_norms=True, post_norms=False)),
    Template("sandwich-norm", _layer_body(pre_norms=True, post_norms=True)),
    Template(
        "post-norm",
        _layer_body(pre_norms=False, post_norms=True),
        fusable=False,
        refusal="it is a post-norm layer (each branch is normalized before its residual add and no norm "
        "follows an add: the next layer's attention reads the sum directly), so no residual add feeds a "
        "norm and there is nothing to fuse",
    ),
)


class _Mismatch(Exception):
    """A template statement the forward's statement does not match."""


def _attention_call(stmt: ast.stmt, signature: inspect.Signature, local_names: frozenset) -> tuple | None:
    """(output, second output, parameters passed by name) of the attention call, or None."""
    call = stmt.value if isinstance(stmt, ast.Assign) else None
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
    if (
        not isinstance(call, ast.Call)
        or self_attr(call.func) != "self_attn"
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
            if var_keyword is None or not is_name(keyword.value, var_keyword):
                return None
        elif keyword.arg == "hidden_states":
            if not is_name(keyword.value, "hidden_states"):
                return None
            has_hidden_states = True
        elif (keyword.arg in signature.parameters or keyword.arg in local_names) and is_name(
            keyword.value, keyword.arg
        ):
            forwarded.add(keyword.arg)
        else:
            return None
    return (target.elts[0].id, target.elts[1].id, frozenset(forwarded)) if has_hidden_states else None


def _is_placeholder(name: str) -> bool:
    return name.isupper()


def _unify(template, actual, bindings: dict) -> None:
    """Match a template's AST node against the forward's, binding placeholders; _Mismatch if they differ."""
    if isinstance(template, ast.Name) and _is_placeholder(template.id):
        if not isinstance(actual, ast.Name) or bindings.setdefault(template.id, actual.id) != actual.id:
            raise _Mismatch
        return
    attr = self_attr(template)
    if attr is not None and _is_placeholder(attr):
        if self_attr(actual) is None or bindings.setdefault(attr, self_attr(actual)) != self_attr(actual):
            raise _Mismatch
        return
    if isinstance(template, ast.Call) and is_name(template.func, "BRANCH"):
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


def match(
    template: Template, body: list, signature: inspect.Signature, local_names: frozenset = frozenset()
) -> dict | tuple[int, str]:
    """The bindings of ``template`` in the forward's statements, or (statements matched, the problem)."""
    statements = ast.parse(template.body).body
    bindings: dict = {}
    for index, (expected, actual) in enumerate(zip(statements, body)):
        if isinstance(expected, ast.Expr) and is_name(expected.value, "ATTENTION_CALL"):
            found = _attention_call(actual, signature, local_names)
            if found is None:
                return index, f"line {actual.lineno}: not self_attn called with the forward's arguments"
            bindings["ATTN_OUT"], bindings["ATTN_EXTRA"], bindings["forwarded"] = found
            continue
        try:
            _unify(expected, actual, bindings)
        except _Mismatch:
            return index, f"line {actual.lineno}: {_first_line(actual)!r}"
    if len(body) > len(statements):  # a template ends with its return: unreachable, but say so
        return len(statements), f"line {body[len(statements)].lineno}: {_first_line(body[len(statements)])!r}"
    if len(body) < len(statements):
        return len(
            body
        ), f"its forward ends where the template goes on with {_first_line(statements[len(body)])!r}"
    return bindings


def _first_line(node: ast.AST) -> str:
    """A statement's source as ``ast.unparse`` writes it, its first line only (an ``if``'s header)."""
    return ast.unparse(node).splitlines()[0]
