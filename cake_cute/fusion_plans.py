"""Whether and how a decoder layer's residual adds can be fused: decided once per layer class.

A Hugging Face decoder layer's forward is matched, statement by statement, against a small table of
templates (``_TEMPLATES``): pre-norm (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V3, SmolLM3,
GLM, Phi3's residual dropouts, Granite's residual multiplier, Llama4's mixture-of-experts tuple) and
sandwich-norm (Gemma2/3, GLM4). Post-norm layers (OLMo2/3) are recognized and refused: no residual add in
them feeds a norm. Any other forward is refused naming its class, the closest template (the one matching
the most statements in a row) and the forward's first statement that differs from it, instead of
computing something else. A match gives the class's ``_LayerPlan``: the names and branch ops the fused
forward (``cake_cute.fusion``) runs.

Before matching, the forms transformers 4.x writes the same layers in are taken out and recorded in the
plan (``_normalized``, ``_setup_statements``): the ``outputs = (hidden_states,)`` tail returning the
attention weights and router logits under their flags, the MLP's router-logit tuple, and the statements
before the attention call that only prepare its arguments (run as written, on the bound arguments). Each
is recognized only in its exact form and place; anything else stays in the body, where no template
matches it.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, replace

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


# How a decoder layer's MLP output carries router logits (``_LayerPlan.mlp_output``): "plain" (it does
# not); a tuple "always" (``hidden_states, router_logits = self.mlp(hidden_states)``); a tuple when
# "is_moe_layer" or "if_tuple" (``if self.is_moe_layer:`` / ``if isinstance(hidden_states, tuple):``
# ``hidden_states, router_logits = hidden_states``, optionally ``else: router_logits = None``).
_MLP_OUTPUTS = ("plain", "always", "is_moe_layer", "if_tuple")
_MLP_TUPLE_CALL = re.compile(r"hidden_states, (\w+) = self\.(\w+)\(hidden_states\)")
_MLP_TUPLE_SPLIT = re.compile(
    r"if (self\.is_moe_layer|isinstance\(hidden_states, tuple\)):\n    hidden_states, (\w+) = hidden_states"
    r"(\nelse:\n    \2 = None)?"
)
_MODULE_CALL = re.compile(r"hidden_states = self\.(\w+)\(hidden_states\)")
_OUTPUTS_START = re.compile(r"(\w+) = \(hidden_states,\)")
_OUTPUTS_ADD = re.compile(r"if (\w+):\n    (\w+) \+= \((\w+),\)")


@dataclass(frozen=True)
class _Form:
    """What ``_normalized`` took out of a forward's statements so that transformers 4.x's layers match
    the templates: how its MLP output is unpacked (one of ``_MLP_OUTPUTS``, and the variable the router
    logits go to) and the outputs tuple its tail returns ((flag, variable) pairs; None when it returns
    hidden_states)."""

    mlp_output: str = "plain"
    router: str | None = None
    mlp: str | None = None  # the module whose output was unpacked: must be the template's MLP
    returned: tuple[tuple[str, str], ...] | None = None
    outputs: tuple[tuple[str, str], ...] | None = None  # returned, each variable named by its source


def _statement(text: str, like: ast.stmt) -> ast.stmt:
    """The statement ``text`` at ``like``'s line (refusals name the forward's lines)."""
    return ast.copy_location(ast.parse(text).body[0], like)


def _normalized(body: list) -> tuple[list, _Form]:
    """The forward's statements with the 4.x forms of the MLP's router logits and of the outputs tuple
    rewritten to the templates' (``hidden_states = self.mlp(hidden_states)``; ``return hidden_states``),
    and what was rewritten. Statements of any other form are left as they are (to be refused)."""
    body, mlp_output, router, mlp, returned = list(body), "plain", None, None, None
    texts = [ast.unparse(stmt) for stmt in body]
    for index, text in enumerate(texts):
        call = _MLP_TUPLE_CALL.fullmatch(text)
        split = _MLP_TUPLE_SPLIT.fullmatch(text)
        # The unpacking right after a module's call; which module the template decides (_checked_form).
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
    return body, _Form(mlp_output, router, mlp, returned)


def _is_setup(stmt: ast.stmt, untouchable: frozenset) -> bool:
    """A statement that prepares the attention call's arguments (transformers 4.x: Gemma2/3's sliding
    window mask, Gemma3's choice of rotary embeddings, Llama4's chunked mask): it reads and writes no
    name of ``untouchable`` (hidden_states, residual, the forward's ``*args`` / ``**kwargs``), calls no
    method of self, and only assigns plain local names."""
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
    return _is_name(node, "self")


def _setup_statements(body: list, signature: inspect.Signature) -> tuple[list, list]:
    """(the statements before the attention call that only prepare its arguments (``_is_setup``), the
    body without them)."""
    variadic = {p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    untouchable = frozenset({"hidden_states", "residual", *variadic})
    attention = next(
        (
            i
            for i, stmt in enumerate(body)
            if isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Call)
            and _self_attr(stmt.value.func) == "self_attn"
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


def _setup_function(statements: list, names: frozenset, forward):
    """The forward's own setup statements as a function ``(self, arguments)`` that runs them on the
    dict of the forward's arguments (and the locals they assign), in order; compiled at the forward's
    file and lines, so a traceback shows the source."""
    function = ast.parse("def _cake_setup(self, _arguments):\n    pass").body[0]
    function.body = [_ToArguments(names).visit(copy.deepcopy(stmt)) for stmt in statements]
    ast.copy_location(function, statements[0])
    module = ast.fix_missing_locations(ast.Module([function], type_ignores=[]))
    namespace: dict = {}
    exec(
        compile(module, inspect.getsourcefile(forward) or "<forward>", "exec"), forward.__globals__, namespace
    )
    return namespace["_cake_setup"]


def _assigned_names(statements: list) -> frozenset:
    return frozenset(
        node.id
        for stmt in statements
        for node in ast.walk(stmt)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    )


def _checked_form(form: _Form, bindings: dict, signature: inspect.Signature) -> _Form | str:
    """``form`` once a template matched: the unpacked output must be the template's MLP's, and each
    returned variable is named by its source (the attention call's second output, "attention", or the
    router logits, "router"); else why the forward is refused."""
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
    mlp_output: str  # how the MLP's output holds router logits: one of _MLP_OUTPUTS
    # None: the forward returns hidden_states. Else it returns a tuple, (hidden_states,) followed, for
    # each (flag, source) whose flag argument is true, by the attention weights ("attention") or the
    # router logits ("router"): transformers 4.x's `outputs = (hidden_states,)` tail.
    outputs: tuple[tuple[str, str], ...] | None = None
    # The forward's statements that prepare the attention call's arguments, as a function run on the
    # bound arguments (``_setup_function``), or None.
    setup: object = None

    def bind(self, layer: nn.Module, args: tuple, kwargs: dict) -> dict:
        """The forward's arguments after hidden_states, by name, defaults filled in, after the
        forward's setup statements ran on them (the locals they assign included)."""
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
        """The keywords the original forward would pass to ``self_attn`` for these arguments (``bind``)."""
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


class _Mismatch(Exception):
    """A template statement the forward's statement does not match."""


def _attention_call(stmt: ast.stmt, signature: inspect.Signature, local_names: frozenset) -> tuple | None:
    """(the output name, the second output's name, the forward parameters passed on by name) of
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
        elif (keyword.arg in signature.parameters or keyword.arg in local_names) and _is_name(
            keyword.value, keyword.arg
        ):
            forwarded.add(keyword.arg)
        else:
            return None
    return (target.elts[0].id, target.elts[1].id, frozenset(forwarded)) if has_hidden_states else None


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


def _match(
    template: _Template, body: list, signature: inspect.Signature, local_names: frozenset = frozenset()
) -> dict | tuple[int, str]:
    """The bindings of ``template`` in the forward's statements, or (how many statements matched,
    the problem); ``local_names`` are the locals the setup statements assign (``_setup_statements``)."""
    statements = ast.parse(template.body).body
    bindings: dict = {}
    for index, (expected, actual) in enumerate(zip(statements, body)):
        if isinstance(expected, ast.Expr) and _is_name(expected.value, "ATTENTION_CALL"):
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


@functools.cache
def _layer_plan(cls: type) -> _LayerPlan:
    """The plan of a decoder-layer class whose forward matches a fusable template; a ValueError naming
    the class (and the closest template's first statement the forward differs in) otherwise."""
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
    setup, body = _setup_statements(body, signature)
    local_names = _assigned_names(setup) - set(signature.parameters)
    body, form = _normalized(body)
    closest = (-1, "")
    for template in _TEMPLATES:
        found = _match(template, body, signature, local_names)
        if not isinstance(found, tuple):
            if not template.fusable:
                raise ValueError(f"{prefix}: {template.refusal}; use swap_rmsnorm alone")
            form = _checked_form(form, found, signature)
            if isinstance(form, str):
                raise ValueError(f"{prefix}: {form}; use swap_rmsnorm alone")
            plan = _plan(template, found, signature, form)
            return _with_setup(plan, setup, local_names, forward) if setup else plan
        if found[0] > closest[0]:  # the first template that matches the most statements in a row
            closest = (found[0], f"closest, the {template.name} template: {found[1]}")
    raise ValueError(
        f"{prefix}: its forward ({inspect.getsourcefile(forward)}) is none of the decoder-layer templates "
        f"the fused forward computes ({', '.join(t.name for t in _TEMPLATES if t.fusable)}; "
        f"{closest[1]}); use swap_rmsnorm alone"
    )


def _with_setup(plan: _LayerPlan, setup: list, local_names: frozenset, forward) -> _LayerPlan:
    """``plan`` running the forward's setup statements on its bound arguments; the locals they assign
    count as named (passed to the attention only where the forward passes them)."""
    names = (frozenset(inspect.signature(forward).parameters) - {"self"}) | local_names
    return replace(plan, setup=_setup_function(setup, names, forward), named=plan.named | local_names)


def _plan(template: _Template, bindings: dict, signature: inspect.Signature, form: _Form) -> _LayerPlan:
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
