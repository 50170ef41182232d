"""The name of a norm module's input parameter: torch 2.13 renamed ``torch.nn.RMSNorm.forward``'s first
parameter from ``input`` to ``x``, and frameworks that bind module arguments by name (torchtitan's
sharding layouts, DTensor's parallel styles) need the running torch's name.
"""

from __future__ import annotations

import inspect
import types

from torch import nn


def forward_input_name(forward) -> str:
    """The name of ``forward``'s first parameter after ``self``; TypeError if it has none."""
    parameters = list(inspect.signature(forward).parameters)
    if len(parameters) < 2:
        raise TypeError(f"{forward.__qualname__} takes no input parameter after self")
    return parameters[1]


def with_input_named(forward, name: str):
    """A copy of ``forward`` whose first parameter after ``self`` is named ``name`` (``forward`` itself if
    it already is); ValueError if ``name`` is not an identifier or is one of its locals."""
    code = forward.__code__
    old = code.co_varnames[1]
    if name == old:
        return forward
    if not name.isidentifier() or name in code.co_varnames:
        raise ValueError(f"cannot name {forward.__qualname__}'s input {name!r}")
    # Local variables are read by index, so renaming the slot renames the parameter and nothing else.
    varnames = (code.co_varnames[0], name, *code.co_varnames[2:])
    renamed = types.FunctionType(
        code.replace(co_varnames=varnames),
        forward.__globals__,
        forward.__name__,
        forward.__defaults__,
        forward.__closure__,  # the __class__ cell of a forward that calls super()
    )
    renamed.__kwdefaults__ = forward.__kwdefaults__
    renamed.__qualname__ = forward.__qualname__
    renamed.__doc__ = forward.__doc__
    renamed.__module__ = forward.__module__
    renamed.__annotations__ = {name if k == old else k: a for k, a in forward.__annotations__.items()}
    return renamed


INPUT_NAME = forward_input_name(nn.RMSNorm.forward)  # "x" from torch 2.13 on, "input" before
