"""The code blocks and printed signatures of README.md and docs/*.md, read for the tests that keep the docs
true to the code (``test_docs_cpu.py``, ``test_gpu_docs.py``).

The convention a page follows (a fence's language, and the HTML comment on the line just before it):

* Every fenced block names its language (```` ```python ````, ```` ```bash ````, ```` ```text ````, ...);
  only ``python`` blocks are ever run or checked.
* A ``python`` block with no marker runs on the CPU as written, alone, in a fresh namespace and an empty
  working directory: it imports what it uses and defines what it reads.
* ``<!-- gpu -->``: the block needs a CUDA GPU; it runs in the GPU suite (``test_gpu_docs.py``).
* ``<!-- not run: <why> -->``: shown, never run (a fragment of a larger program, the reader's own model or
  checkpoint, a config line); the reason is required.
* ``<!-- signature -->`` or ``<!-- signature: <module> -->``: a listing of calls
  ``[targets =] name(parameters)``, each checked against ``inspect.signature`` of that name in
  ``cake_cute`` (or in the module named).

A printed signature lists the parameters with the code's names, order, keyword-only marker (``*``) and
defaults; one that ends in ``...`` lists the first ones only. A norm module's ``forward`` is printed with
torch 2.13's name for its first parameter, ``x`` (``input`` before 2.13, which the running torch's name
replaces when compared).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cake_cute.forward_names import INPUT_NAME

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\S*)\s*$")
_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
_MARKER = re.compile(
    r"^\s*<!-- (?:(?P<gpu>gpu)|not run: (?P<reason>\S.*?)|signature(?:: (?P<module>[\w.]+))?) -->\s*$"
)
DOCUMENTED_INPUT_NAME = "x"  # torch 2.13's name for a norm module's forward input


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: where it starts (its fence's line), its language, its marker
    (``"gpu"``, ``"not run"``, ``"signature"`` or None), the module a signature block names, and its
    text (dedented)."""

    page: Path
    line: int
    language: str
    marker: str | None
    module: str
    text: str
    comment: str | None  # the HTML comment just before the fence, marker or not

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(pages=PAGES) -> list[Block]:
    """Every fenced block of ``pages``."""
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            indent = len(opening["indent"])
            text = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            before = lines[i - 1] if i > 0 else ""
            comment = before.strip() if _COMMENT.match(before) else None
            marker = _MARKER.match(before)
            kind = None
            if marker:
                kind = "gpu" if marker["gpu"] else "not run" if marker["reason"] else "signature"
            module = marker["module"] if marker and marker["module"] else "cake_cute"
            found.append(Block(page, i + 1, opening["language"], kind, module, text, comment))
            i = end + 1
    return found


def python_blocks(marker: str | None) -> list[Block]:
    return [b for b in blocks() if b.language == "python" and b.marker == marker]


# --- printed signatures ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    name: str
    keyword_only: bool
    default: object  # inspect.Parameter.empty when there is none


def documented_parameters(text: str) -> tuple[list[Parameter], bool]:
    """The parameters a printed list ``text`` names (``"x, w, eps=1e-6, *, residual=None"``), and
    whether it ends in ``...`` (the rest left out). Defaults are evaluated with ``torch`` in scope.

    Raises
    ------
    SyntaxError
        ``text`` is not a parameter list.
    """
    text = " ".join(text.split())
    open_ended = text.endswith("...")
    text = text.removesuffix("...").rstrip().rstrip(",")
    arguments = ast.parse(f"def f({text}): pass").body[0].args
    positional = arguments.posonlyargs + arguments.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(arguments.defaults)) + [
        _value(d) for d in arguments.defaults
    ]
    parameters = [Parameter(a.arg, False, d) for a, d in zip(positional, defaults)]
    for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults):
        parameters.append(Parameter(a.arg, True, inspect.Parameter.empty if d is None else _value(d)))
    return parameters, open_ended


def _value(node: ast.expr):
    return eval(compile(ast.Expression(node), "<default>", "eval"), {"torch": torch})


def code_parameters(target) -> list[Parameter]:
    """The parameters of ``target`` as ``signature_target`` resolved it."""
    obj, drop = target
    parameters = list(inspect.signature(obj).parameters.values())[drop:]
    return [
        Parameter(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in parameters
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def signature_target(name: str, module: str = "cake_cute", subject: str | None = None):
    """``(callable, leading parameters to drop)`` that a printed ``name(...)`` documents: a name of
    ``module`` (dotted names walk attributes); ``forward`` / ``apply`` alone are ``subject``'s. A method
    taken from its class drops ``self``; an autograd Function's inherited ``apply`` is its ``forward``
    without ``ctx``. None when ``name`` names nothing there."""
    if name in ("forward", "apply") and subject is not None:
        name = f"{subject}.{name}"
    obj = importlib.import_module(module)
    owner = None
    for part in name.split("."):
        owner, obj = obj, getattr(obj, part, None)
        if obj is None:
            return None
    if inspect.isclass(owner) and name.endswith(".apply") and "apply" not in vars(owner):
        return owner.forward, 1  # torch.autograd.Function.apply(*args): the forward's, ctx dropped
    if (
        inspect.isclass(owner)
        and inspect.isfunction(obj)
        and next(iter(inspect.signature(obj).parameters), "") == "self"
    ):
        return obj, 1
    return obj, 0


def mismatches(printed: str, target, *, forward_of_a_norm: bool = False) -> list[str]:
    """How the printed parameter list ``printed`` differs from ``target``'s (empty: it matches)."""
    documented, open_ended = documented_parameters(printed)
    actual = code_parameters(target)
    if forward_of_a_norm and documented and actual and actual[0].name == INPUT_NAME:
        if documented[0].name == DOCUMENTED_INPUT_NAME:
            documented[0] = Parameter(INPUT_NAME, documented[0].keyword_only, documented[0].default)
    if open_ended:
        actual = actual[: len(documented)]
    problems = []
    if [p.name for p in documented] != [p.name for p in actual]:
        problems.append(f"names {[p.name for p in documented]} != the code's {[p.name for p in actual]}")
        return problems
    for doc, code in zip(documented, actual):
        if doc.keyword_only != code.keyword_only:
            problems.append(f"{doc.name}: keyword-only {doc.keyword_only} != the code's {code.keyword_only}")
        if not _same_default(doc.default, code.default):
            problems.append(f"{doc.name}: default {doc.default!r} != the code's {code.default!r}")
    return problems


def _same_default(a, b) -> bool:
    if a is inspect.Parameter.empty or b is inspect.Parameter.empty:
        return a is b
    return type(a) is type(b) and a == b


_CALL = re.compile(r"(?P<name>[A-Za-z_][\w.]*)\(")


def printed_calls(text: str) -> list[tuple[str, str]]:
    """``(name, parameter list)`` of each ``name(...)`` that starts a statement or follows ``=`` in a
    signature block (comments dropped, parentheses matched across lines)."""
    code = "\n".join(line.split("#")[0] for line in text.splitlines())
    calls, consumed = [], 0
    for match in _CALL.finditer(code):
        before = code[: match.start()].rstrip(" ")
        if match.start() < consumed or (before and not before.endswith(("\n", "="))):
            continue
        end = _closing(code, match.end() - 1)
        calls.append((match["name"], code[match.end() : end]))
        consumed = end
    return calls


def _closing(text: str, opening: int) -> int:
    """The index of the parenthesis that closes the one at ``opening``."""
    depth = 0
    for i in range(opening, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses after {text[opening : opening + 40]!r}")


_SPAN = re.compile(r"`([^`]+)`")
_PRINTED = re.compile(r"(?P<name>[A-Za-z_][\w.]*)?\((?P<parameters>.*)\)")


@dataclass(frozen=True)
class Printed:
    """A signature a page prints: where (page and line), the public name it documents (``subject``,
    for a table row), the name printed before the parentheses (None: the subject's own), and the
    parameter list."""

    page: Path
    line: int
    subject: str | None
    name: str | None
    parameters: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}:{self.name or self.subject}"


def table_signatures(page: Path, heading: str, public: set[str]) -> list[Printed]:
    """The signatures the API table under ``## heading`` of ``page`` prints: the code spans of the form
    ``[name](parameters)`` in each row's first two cells. A span without a name, ``forward(...)`` or
    ``apply(...)`` is that of each public name the row's first cell names; a named span of the second
    cell is a signature when it names a public name (else a call in prose: ``norm(x, residual=r)``)."""
    lines = page.read_text().splitlines()
    start = lines.index(f"## {heading}")
    found = []
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = re.split(r"(?<!\\)\|", line)[1:3]
        named = [_PRINTED.sub(r"\g<name>", span) for span in _SPAN.findall(cells[0])]
        subjects = [name for name in named if name in public]
        for column, cell in enumerate(cells):
            for span in _SPAN.findall(cell):
                printed = _PRINTED.fullmatch(span)
                if printed is None:
                    continue
                name, parameters = printed["name"], printed["parameters"]
                if name in (None, "forward", "apply"):
                    found += [Printed(page, number, subject, name, parameters) for subject in subjects]
                elif column == 0 or name in public:
                    found.append(Printed(page, number, None, name, parameters))
    return found


def keyword_only_signatures(page: Path) -> list[Printed]:
    """The prose signatures of ``page`` that a bare ``*`` marks as such: code spans ``name(..., *, ...)``
    (over one line or several) outside its tables and code blocks."""
    text = _FENCED.sub(lambda m: "\n" * m[0].count("\n"), page.read_text())  # code blocks: not prose
    lines = text.splitlines()
    found = []
    for span in _SPAN.finditer(text):
        number = text.count("\n", 0, span.start()) + 1
        if lines[number - 1].startswith("|"):
            continue
        printed = _PRINTED.fullmatch(" ".join(span[1].split()))
        if printed and printed["name"] and re.search(r"(^|, )\*,", printed["parameters"]):
            found.append(Printed(page, number, None, printed["name"], printed["parameters"]))
    return found


_FENCED = re.compile(r"^ *```.*?^ *```", re.S | re.M)
