"""Readers of a Hugging Face norm module: its eps, its one weight, its forward's source and whether that
source averages squares over the last dimension. Hugging Face norms share no base class, so the swaps
recognize them by what they hold and what their source shows; this is the one reading both swaps use.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

# Squares as a forward's source writes them ("x.pow(2)", "x.square()", "(x ** 2)"), and their average
# over the last dimension (".mean(-1" or ".mean(dim=-1").
SQUARES = r"(pow\(2\)|square\(\)|\*\* ?2)\)?"
_MEAN_OF_SQUARES = re.compile(SQUARES + r"\.mean\((dim=)?-1")


class NormNotServed(ValueError):
    """A Hugging Face norm cake_cute cannot replace faithfully; the message names its class and why."""


def hf_eps(module: nn.Module) -> float | None:
    """The module's float ``variance_epsilon`` (or ``eps``); None when it holds neither."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def hf_weight(module: nn.Module) -> nn.Parameter | None:
    """The module's one 1-D ``weight`` Parameter, if that is all it learns."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    return weight if all(p is weight for p in module.parameters(recurse=False)) else None


def forward_source(cls: type) -> str | None:
    """``cls.forward``'s source with its ``_norm`` helper's, on one line, without comments or docstrings;
    None when unreadable."""
    parts = []
    for name in ("_norm", "forward"):
        function = getattr(cls, name, None)
        if function is None:
            continue
        try:
            parts.append(inspect.getsource(function))
        except (OSError, TypeError):
            return None
    text = re.sub(r'""".*?"""|#[^\n]*', "", "\n".join(parts), flags=re.S)
    return " ".join(text.split())


def averages_squares(source: str) -> bool:
    """Whether a forward's source (``forward_source``) averages squares over the last dimension."""
    return bool(_MEAN_OF_SQUARES.search(source))
