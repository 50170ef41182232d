"""The forms transformers 4.x writes decoder layers in, taken out of a forward before it is matched.

4.x writes the templates' layers with more around them: an ``outputs = (hidden_states,)`` tail, the
MLP's router-logit tuple, and statements before the attention call that only prepare its arguments.
``normalized`` rewrites the first two to the templates' forms and records them; ``setup_statements``
takes out the third, which the fused forward runs as written. Each is recognized only in its exact
form and place; anything else stays, where no template matches it.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
from dataclasses import dataclass, replace

from .templates import is_name, self_attr

# How a decoder layer's MLP output carries router logits (``_LayerPlan.mlp_output``): "plain" (it does
# not); a tuple "always" (``hidden_states, router_logits = self.mlp(hidden_states)``); a tuple when
# "is_moe_layer" or "if_tuple" (``if self.is_moe_layer:`` / ``if isinstance(hidden_states, tuple):``
# ``hidden_states, router_logits = hidden_states``, optionally ``else: router_logits = None``).
MLP_OUTPUTS = ("plain", "always", "is_moe_layer", "if_tuple")
_MLP_TUPLE_CALL = re.compile(r"hidden_states, (\w+) = self\.(\w+)\(hidden_states\)")
_MLP_TUPLE_SPLIT = re.compile(
    r"if (self\.is_moe_layer|isinstance\(hidden_states, tuple\)):\n    hidden_states, (\w+) = hidden_states"
    r"(\nelse:\n    \2 = None)?"
)
_MODULE_CALL = re.compile(r"hidden_states = self\.(\w+)\(hidden_states\)")
_OUTPUTS_START = re.compile(r"(\w+) = \(hidden_states,\)")
_OUTPUTS_ADD = re.compile(r"if (\w+):\n    (\w+) \+= \((\w+),\)")


@dataclass(frozen=True)
class Form:
    """What ``normalized`` took out of a forward: its MLP output's unpacking and its outputs tuple."""

    mlp_output: str = "plain"
    router: str | None = None
    mlp: str | None = None  # the module whose output was unpacked: must be the template's MLP
    returned: tuple[tuple[str, str], ...] | None = None
    outputs: tuple[tuple[str, str], ...] | None = None  # returned, each variable named by its source


def _statement(text: str, like: ast.stmt) -> ast.stmt:
    """The statement ``text`` at ``like``'s line (refusals name the forward's lines)."""
    return ast.copy_location(ast.parse(text).body[0], like)


def normalized(body: list) -> tuple[list, Form]:
    """The forward's statements with the 4.x forms rewritten to the templates', and what was rewritten."""
    body, mlp_output, router, mlp, returned = list(body), "plain", None, None, None
    texts = [ast.unparse(stmt) for stmt in body]
    for index, text in enumerate(texts):
        call = _MLP_TUPLE_CALL.fullmatch(text)
        split = _MLP_TUPLE_SPLIT.fullmatch(text)
        # The unpacking right after a module's call; which module the template decides (checked_form).
        before = _MODULE_CALL.fullmatch(texts[index - 1]) if index else None
        if call and mlp_output == "plain":
            mlp_output, router, mlp = "always", call.group(1), call.group(2)
            body[index] = _statement(f"hidden_states = self.{mlp}(hidden_states)", body[index])
        elif split and before and mlp_output == "plain":
            mlp_output = "is_moe_layer" if split.group(1).startswith("self.") else "if_tuple"
            router, mlp, body[index] = split.group(2), before.group(1), None
    body = [stmt for stmt in body if stmt is not None]
    texts = [ast.unparse(stmt) for stmt in body]
    returns = re.fullmatch(r"return (\w+)", texts[-1]) if texts else None
    if returns and returns.group(1) != "hidden_states":
        name = returns.group(1)
        start = next((i for i, t in enumerate(texts) if _OUTPUTS_START.fullmatch(t)), None)
        adds = [_OUTPUTS_ADD.fullmatch(t) for t in texts[start + 1 : -1]] if start is not None else []
        if (
            start is not None
            and _OUTPUTS_START.fullmatch(texts[start]).group(1) == name
            and all(add and add.group(2) == name for add in adds)
        ):
            returned = tuple((add.group(1), add.group(3)) for add in adds)
            body = [*body[:start], _statement("return hidden_states", body[-1])]
    return body, Form(mlp_output, router, mlp, returned)


def checked_form(form: Form, bindings: dict, signature: inspect.Signature) -> Form | str:
    """``form`` once a template matched, returned variables named by source; else why it is refused."""
    if form.mlp is not None and form.mlp != bindings["MLP"]:
        return f"it unpacks the output of self.{form.mlp}, not of its MLP self.{bindings['MLP']}"
    if form.returned is None:
        return form
    sources = {bindings["ATTN_EXTRA"]: "attention"}
    if form.router is not None:
        sources[form.router] = "router"
    outputs = []
    for flag, variable in form.returned:
        if flag not in signature.parameters or variable not in sources or variable == "_":
            return (
                f"its outputs tuple adds {variable!r} under {flag!r}, which is neither the attention "
                "weights nor the router logits"
            )
        outputs.append((flag, sources[variable]))
    return replace(form, outputs=tuple(outputs))


def _is_setup(stmt: ast.stmt, untouchable: frozenset) -> bool:
    """A statement that only prepares the attention call's arguments: no name of ``untouchable``, no method
    of self, only plain local names assigned."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and node.id in untouchable:
            return False
        if isinstance(node, ast.Call) and _rooted_at_self(node.func):
            return False
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal)):
            return False
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not all(isinstance(t, ast.Name) for t in targets):
                return False
    return isinstance(stmt, (ast.Assign, ast.AugAssign, ast.If))


def _rooted_at_self(node) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return is_name(node, "self")


def setup_statements(body: list, signature: inspect.Signature) -> tuple[list, list]:
    """(the setup statements before the attention call, the body without them)."""
    variadic = {p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    untouchable = frozenset({"hidden_states", "residual", *variadic})
    attention = next(
        (
            i
            for i, stmt in enumerate(body)
            if isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Call)
            and self_attr(stmt.value.func) == "self_attn"
        ),
        None,
    )
    if attention is None:
        return [], body
    setup = [stmt for stmt in body[:attention] if _is_setup(stmt, untouchable)]
    return setup, [stmt for stmt in body if not any(stmt is s for s in setup)]


class _ToArguments(ast.NodeTransformer):
    """Each use of the names ``names`` becomes an item of the dict ``_arguments``."""

    def __init__(self, names: frozenset):
        self.names = names

    def visit_Name(self, node):
        if node.id not in self.names:
            return node
        item = ast.Subscript(ast.Name("_arguments", ast.Load()), ast.Constant(node.id), node.ctx)
        return ast.copy_location(item, node)


def setup_function(statements: list, names: frozenset, forward):
    """The setup statements as a function ``(self, arguments)`` on the forward's arguments, compiled at the
    forward's file and lines so tracebacks show the source."""
    function = ast.parse("def _cake_setup(self, _arguments):\n    pass").body[0]
    function.body = [_ToArguments(names).visit(copy.deepcopy(stmt)) for stmt in statements]
    ast.copy_location(function, statements[0])
    module = ast.fix_missing_locations(ast.Module([function], type_ignores=[]))
    namespace: dict = {}
    exec(
        compile(module, inspect.getsourcefile(forward) or "<forward>", "exec"), forward.__globals__, namespace
    )
    return namespace["_cake_setup"]


def assigned_names(statements: list) -> frozenset:
    return frozenset(
        node.id
        for stmt in statements
        for node in ast.walk(stmt)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    )
