"""The argument contract of every public name (``cake_cute.__all__``): an argument of the wrong kind or
value raises ``TypeError`` / ``ValueError`` naming it, before anything runs.

``CONTRACT`` has one row per public name (``test_every_public_name_has_a_row`` fails for a name
added without one). A row holds the callable whose signature lists the arguments, a valid base call,
and the cases beyond the generated ones. Two kinds of case come from a row:

* generated from the signature: every parameter whose default is a bool, given ``"no"``, ``None``,
  ``0`` and ``2.5``, raises ``TypeError("<parameter> must be a bool, got <type>")`` (``deterministic``
  included, which changes nothing but is still checked);
* listed in the row: the other arguments of the wrong kind or value, each with its exact error class
  (or ``ArgumentError``, a subclass of both) and a message naming the argument.

The base call of each row is valid: on this CPU-only machine it runs, or stops at the documented
device check (``device_error``), so every case's error is due to its one bad argument, raised before
that check. Tensor arguments of the wrong dtype, shape or device, and the caller-owned outputs left
untouched, are the tables of ``test_validation_*_cpu.py``. A name without arguments to check (an
exception class, a result type, ``prepare()``) says why in its row.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import cake_cute as c
from cake_cute.forward_names import INPUT_NAME

from ._validation_cases import assert_error_class

T, H = 4, 8
X, Z, G, W = (torch.randn(T, H, generator=torch.Generator().manual_seed(i)) for i in range(4))
W = W[0]
RSTD = torch.ones(T)
NOT_A_BOOL = ("no", None, 0, 2.5)
CUDA_ONLY = r"^x must be a CUDA tensor"  # the functional entries' device check, the last one
NO_CUDA = r"no CUDA device is available|^device must be a CUDA device"


@dataclass(frozen=True)
class Row:
    """A public name's contract: ``target``, whose signature lists the parameters; ``base(**kw)``, a
    valid call with keyword arguments replaced by ``kw``; ``device_error``, the error the base call
    raises where it needs a GPU (None: it runs here); ``cases``, (id, keyword arguments, error class,
    message) beyond the generated bool cases."""

    target: Callable
    base: Callable
    device_error: str | None = None
    cases: list = field(default_factory=list)


@dataclass(frozen=True)
class NoArguments:
    """A public name with no arguments to check, and why."""

    reason: str


def _fresh_model() -> nn.Module:
    return nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H))


def _hf_norms() -> nn.Module:
    """A module holding a norm transformers' kernel route replaces (Llama's, decorated "RMSNorm")."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    holder = nn.Module()
    holder.norm = LlamaRMSNorm(H)
    return holder


KERNEL_ROUTE_CASES = [
    ("model-str", dict(model="m"), TypeError, r"^model must be a torch.nn.Module or a transformers config"),
    ("layers-str", dict(layers="RMSNorm"), TypeError, r"^layers must be an iterable of layer names"),
    ("layers-unknown", dict(layers=["LayerNorm"]), ValueError, r"^layers: cake_cute serves"),
    ("layers-absent", dict(layers=["RMSNormGated"]), ValueError, r"^layers: Module has no module"),
]


SWAP_CASES = [
    ("model-str", dict(model="m"), TypeError, r"^model must be a torch.nn.Module, got str"),
    ("weight_offset-str", dict(weight_offset="1"), TypeError, r"^weight_offset must be a float, got str"),
    ("weight_offset-inf", dict(weight_offset=float("inf")), ValueError, r"^weight_offset must be a finite"),
    ("compiled_head_norms", dict(compiled_head_norms="inductor"), ValueError, r"^compiled_head_norms must"),
]
WORKSPACE_CASES = [
    ("rows-str", dict(rows="4"), TypeError, r"^rows must be an int, got str"),
    ("rows-negative", dict(rows=-1), ValueError, r"^rows must be an int >= 0"),
    ("hidden-float", dict(hidden=8.0), TypeError, r"^hidden must be an int, got float"),
    ("device-cpu", dict(device="cpu"), ValueError, r"^device must be a CUDA device"),
]
MODULE_FACTORY_CASES = [
    ("device-nowhere", dict(device="nowhere"), ValueError, r"^device must name a device, got 'nowhere'"),
    ("device-list", dict(device=["cuda"]), TypeError, r"^device must be a torch.device, str or int"),
    ("dtype-str", dict(dtype="float32"), TypeError, r"^dtype must be a torch.dtype, got str"),
    ("dtype-int", dict(dtype=torch.int32), ValueError, r"^dtype must be a floating-point dtype"),
    ("eps-str", dict(eps="1e-6"), TypeError, r"^eps must be a float, got str"),
    ("eps-negative", dict(eps=-1.0), ValueError, r"^eps must be a finite number >= 0"),
    ("weight_offset-nan", dict(weight_offset=float("nan")), ValueError, r"^weight_offset must be a finite"),
    ("cast_policy", dict(cast_policy="twice"), ValueError, r"^cast_policy must be one of"),
]
TENSOR_KIND_CASES = [
    ("x-str", dict(x="x"), TypeError, r"^x must be a torch.Tensor, got str"),
    ("eps-str", dict(eps="1e-6"), TypeError, r"^eps must be a float, got str"),
]


def _gated_workspace(fn):
    return Row(
        fn,
        lambda **kw: fn(**{"rows": T, "device": "cuda", **kw}),
        NO_CUDA,
        [
            ("rows-str", dict(rows="4"), TypeError, r"^rows must be an int, got str"),
            ("hidden-zero", dict(hidden=0), ValueError, r"^hidden must be an int in"),
        ],
    )


def _plain_workspace(fn):
    return Row(
        fn, lambda **kw: fn(**{"rows": T, "hidden": H, "device": "cuda", **kw}), NO_CUDA, WORKSPACE_CASES
    )


CONTRACT = {
    "CakeGatedRMSNorm": Row(
        c.CakeGatedRMSNorm,
        lambda **kw: c.CakeGatedRMSNorm(**{"hidden_size": H, **kw}),
        cases=[
            *MODULE_FACTORY_CASES,
            ("hidden_size-str", dict(hidden_size="8"), TypeError, r"^hidden_size must be an int, got str"),
            ("group_size", dict(group_size=3), ValueError, r"^group_size must divide"),
        ],
    ),
    "CakeGatedRMSNorm.forward": Row(
        c.CakeGatedRMSNorm.forward,
        lambda **kw: c.CakeGatedRMSNorm(H)(**{"hidden_states": X, "gate": Z, **kw}),
        cases=[
            (
                "hidden_states-str",
                dict(hidden_states="x"),
                TypeError,
                r"^hidden_states must be a torch.Tensor",
            ),
            ("gate-str", dict(gate="z"), TypeError, r"^gate must be a torch.Tensor, got str"),
            ("gate-shape", dict(gate=Z[:2]), ValueError, r"^z must have shape \(4, 8\)"),
        ],
    ),
    "CakeRMSNormSiLUGateFunction": Row(
        c.CakeRMSNormSiLUGateFunction.forward,
        lambda **kw: c.CakeRMSNormSiLUGateFunction.apply(
            *({"x": X, "z": Z, "weight": W, "eps": 1e-6} | kw).values()
        ),
        cases=[*TENSOR_KIND_CASES, ("weight-str", dict(weight="w"), TypeError, r"^weight must be a torch")],
    ),
    "cake_rmsnorm_silu_gate": Row(
        c.cake_rmsnorm_silu_gate,
        lambda **kw: c.cake_rmsnorm_silu_gate(**{"x": X, "z": Z, "weight": W, **kw}),
        cases=[
            *TENSOR_KIND_CASES,
            ("z-dtype", dict(z=Z.bfloat16()), TypeError, r"^z must have dtype float32"),
        ],
    ),
    "cake_rmsnorm_silu_gate_train_backward": Row(
        c.cake_rmsnorm_silu_gate_train_backward,
        lambda **kw: c.cake_rmsnorm_silu_gate_train_backward(
            **{"grad_out": G, "x": X, "z": Z, "weight": W, **kw}
        ),
        CUDA_ONLY,
        [
            *TENSOR_KIND_CASES,
            ("grad_out-str", dict(grad_out="g"), TypeError, r"^grad_out must be a torch.Tensor"),
            ("workspace-str", dict(workspace="w"), TypeError, r"^workspace must be a torch.Tensor"),
        ],
    ),
    "cake_rmsnorm_silu_gate_train_backward_workspace": _gated_workspace(
        c.cake_rmsnorm_silu_gate_train_backward_workspace
    ),
    "cake_rmsnorm_silu_gate_train_backward_workspace_bytes": _gated_workspace(
        c.cake_rmsnorm_silu_gate_train_backward_workspace_bytes
    ),
    "cake_rmsnorm_silu_gate_train_forward": Row(
        c.cake_rmsnorm_silu_gate_train_forward,
        lambda **kw: c.cake_rmsnorm_silu_gate_train_forward(**{"x": X, "z": Z, "weight": W, **kw}),
        CUDA_ONLY,
        [*TENSOR_KIND_CASES, ("out-str", dict(out="o"), TypeError, r"^out must be a torch.Tensor, got str")],
    ),
    "GatedNormNotServed": NoArguments("an exception class (a ValueError) that swap_gated_rmsnorm raises"),
    "cake_gated_rmsnorm": Row(
        c.cake_gated_rmsnorm,
        lambda **kw: c.cake_gated_rmsnorm(**{"x": X, "z": Z, "w": W, **kw}),
        cases=[
            *TENSOR_KIND_CASES,
            ("group_size-str", dict(group_size="4"), TypeError, r"^group_size must be an int, got str"),
            ("weight_offset-str", dict(weight_offset="1"), TypeError, r"^weight_offset must be a float"),
        ],
    ),
    "swap_gated_rmsnorm": Row(
        c.swap_gated_rmsnorm,
        lambda **kw: c.swap_gated_rmsnorm(**{"model": _fresh_model(), **kw}),
        cases=[
            ("model-str", dict(model="m"), TypeError, r"^model must be a torch.nn.Module, got str"),
            ("cast_policy", dict(cast_policy="twice"), ValueError, r"^cast_policy must be None or one of"),
        ],
    ),
    "ArgumentError": NoArguments(
        "an exception class, raised for a tensor of the wrong dtype, shape or device"
    ),
    "CakeRMSNorm": Row(
        c.CakeRMSNorm,
        lambda **kw: c.CakeRMSNorm(**{"normalized_shape": H, **kw}),
        cases=[
            *MODULE_FACTORY_CASES,
            ("normalized_shape-2d", dict(normalized_shape=(2, H)), ValueError, r"^normalized_shape must be"),
            ("compiled_as", dict(compiled_as="inductor"), ValueError, r"^compiled_as must be one of"),
        ],
    ),
    "CakeRMSNorm.forward": Row(
        c.CakeRMSNorm.forward,
        lambda **kw: c.CakeRMSNorm(H)(**{INPUT_NAME: X, **kw}),
        cases=[
            ("input-str", {INPUT_NAME: "x"}, TypeError, rf"^{INPUT_NAME} must be a torch.Tensor, got str"),
            ("residual-float", dict(residual=0.5), TypeError, r"^residual must be a torch.Tensor, got float"),
            ("residual-dtype", dict(residual=X.bfloat16()), TypeError, r"^residual must have dtype float32"),
        ],
    ),
    "CakeRMSNormFunction": Row(
        c.CakeRMSNormFunction.apply,
        lambda **kw: c.CakeRMSNormFunction.apply(**{"x": X, "w": W, "eps": 1e-6, **kw}),
        cases=[*TENSOR_KIND_CASES, ("w-str", dict(w="w"), TypeError, r"^w must be a torch.Tensor, got str")],
    ),
    "Fp8NormOutput": NoArguments("the result type of cake_rmsnorm_fp8 (a NamedTuple of its outputs)"),
    "add_rmsnorm": Row(
        c.add_rmsnorm,
        lambda **kw: c.add_rmsnorm(**{"norm": c.CakeRMSNorm(H), "x": X, "residual": Z, **kw}),
        cases=[
            ("norm-str", dict(norm="norm"), TypeError, r"^norm must be a torch.nn.Module, got str"),
            ("x-str", dict(x="x"), TypeError, r"^x must be a torch.Tensor, got str"),
            ("residual-float", dict(residual=0.5), TypeError, r"^residual must be a torch.Tensor, got float"),
        ],
    ),
    "SequenceParallelResidual": Row(
        c.SequenceParallelResidual,
        lambda **kw: c.SequenceParallelResidual(**kw),
        cases=[("sequence_dim-str", dict(sequence_dim="1"), TypeError, r"^sequence_dim must be an int")],
    ),
    "cake_rmsnorm": Row(
        c.cake_rmsnorm,
        lambda **kw: c.cake_rmsnorm(**{"x": X, "w": W, **kw}),
        cases=[
            *TENSOR_KIND_CASES,
            ("residual-str", dict(residual="r"), TypeError, r"^residual must be a torch.Tensor, got str"),
            ("weight_offset-str", dict(weight_offset="1"), TypeError, r"^weight_offset must be a float"),
        ],
    ),
    "cake_rmsnorm_fp8": Row(
        c.cake_rmsnorm_fp8,
        lambda **kw: c.cake_rmsnorm_fp8(**{"x": torch.randn(T, 64), "w": torch.randn(64), **kw}),
        cases=[
            ("recipe-int", dict(recipe=3), TypeError, r"^recipe must be a str"),
            ("recipe-unknown", dict(recipe="nvfp4"), ValueError, r"^recipe must be one of"),
            ("scale_layout", dict(scale_layout="tiles"), ValueError, r"^scale_layout must be one of"),
        ],
    ),
    "cake_rmsnorm_train_backward": Row(
        c.cake_rmsnorm_train_backward,
        lambda **kw: c.cake_rmsnorm_train_backward(**{"g": G, "x": X, "w": W, "rstd": RSTD, **kw}),
        CUDA_ONLY,
        [
            ("g-str", dict(g="g"), TypeError, r"^g must be a tensor or a list / tuple"),
            ("rstd-str", dict(rstd="r"), TypeError, r"^rstd must be a torch.Tensor, got str"),
            ("dw_dtype-str", dict(dw_dtype="fp32"), TypeError, r"^dw_dtype must be torch.float32"),
            ("workspace-str", dict(workspace="w"), TypeError, r"^workspace must be a torch.Tensor"),
        ],
    ),
    "cake_rmsnorm_train_backward_workspace": _plain_workspace(c.cake_rmsnorm_train_backward_workspace),
    "cake_rmsnorm_train_backward_workspace_bytes": _plain_workspace(
        c.cake_rmsnorm_train_backward_workspace_bytes
    ),
    "cake_rmsnorm_train_forward": Row(
        c.cake_rmsnorm_train_forward,
        lambda **kw: c.cake_rmsnorm_train_forward(**{"x": X, "w": W, "eps": 1e-6, **kw}),
        CUDA_ONLY,
        [*TENSOR_KIND_CASES, ("out-str", dict(out="o"), TypeError, r"^out must be a torch.Tensor, got str")],
    ),
    "fuse_residual_rmsnorm": Row(
        c.fuse_residual_rmsnorm,
        lambda **kw: c.fuse_residual_rmsnorm(**{"model": _fresh_model(), **kw}),
        r"^Sequential has no Hugging Face-style decoder layers",  # the model check after the arguments'
        SWAP_CASES,
    ),
    "is_cake_rmsnorm_train_supported": NoArguments(
        "answers False for any argument naming no supported device or size, never raises "
        "(test_validation_entry_points_cpu.py)"
    ),
    "prepare": NoArguments("takes no arguments"),
    "NormNotServed": NoArguments("an exception class (a ValueError) the kernel route raises for a norm"),
    "hf_kernel_config": Row(
        c.hf_kernel_config,
        lambda **kw: c.hf_kernel_config(**{"model": _hf_norms(), **kw}),
        cases=KERNEL_ROUTE_CASES,
    ),
    "hf_kernel_mapping": Row(
        c.hf_kernel_mapping,
        lambda **kw: c.hf_kernel_mapping(**{"model": _hf_norms(), **kw}),
        cases=KERNEL_ROUTE_CASES,
    ),
    "swap_rmsnorm": Row(
        c.swap_rmsnorm, lambda **kw: c.swap_rmsnorm(**{"model": _fresh_model(), **kw}), cases=SWAP_CASES
    ),
}

ROWS = {name: row for name, row in CONTRACT.items() if isinstance(row, Row)}


def _bool_parameters(target: Callable) -> list[str]:
    """The parameters of ``target`` (a function, or a class: its constructor) whose default is a bool."""
    signature = inspect.signature(target)
    return [p.name for p in signature.parameters.values() if isinstance(p.default, bool)]


def _cases():
    for name, row in ROWS.items():
        for parameter in _bool_parameters(row.target):
            for bad in NOT_A_BOOL:
                message = rf"^{parameter} must be a bool, got {type(bad).__name__}"
                yield pytest.param(
                    row, {parameter: bad}, TypeError, message, id=f"{name}-{parameter}-{bad!r}"
                )
        for case_id, kwargs, error, message in row.cases:
            yield pytest.param(row, kwargs, error, message, id=f"{name}-{case_id}")


def test_every_public_name_has_a_row():
    """A public name added without a row here fails: its arguments join the contract when it joins
    ``__all__``."""
    rows = {name.split(".")[0] for name in CONTRACT}
    assert rows == set(c.__all__), rows ^ set(c.__all__)


def test_every_flag_of_the_public_names_is_generated():
    """The bool parameters the generated cases cover, so that a flag taken out of a signature shows."""
    flags = {name: _bool_parameters(row.target) for name, row in ROWS.items()}
    assert flags["cake_rmsnorm"] == ["deterministic", "memory_efficient"]
    assert flags["CakeRMSNormFunction"] == ["deterministic", "memory_efficient"]
    assert flags["cake_rmsnorm_train_backward"] == ["deterministic"]
    assert flags["CakeRMSNorm"] == ["elementwise_affine", "sequence_parallel", "memory_efficient"]
    assert flags["cake_rmsnorm_train_backward_workspace_bytes"] == ["residual"]
    assert sum(map(len, flags.values())) >= 20


@pytest.mark.parametrize("name", list(ROWS))
def test_the_base_call_is_valid(name):
    """It runs here, or fails only on its device check: the cases' errors are their own."""
    row = ROWS[name]
    try:
        row.base()
    except ValueError as error:
        assert type(error) is ValueError and row.device_error is not None, error
        assert re.search(row.device_error, str(error)), error
    else:
        assert row.device_error is None or torch.cuda.is_available()


@pytest.mark.parametrize(("row", "kwargs", "error", "message"), list(_cases()))
def test_a_bad_argument_is_named(row, kwargs, error, message):
    with pytest.raises((TypeError, ValueError), match=message) as info:
        row.base(**kwargs)
    assert_error_class(info.value, error)


def test_a_refused_swap_changes_nothing():
    """The swaps check their arguments before they look at the model."""
    model = _fresh_model()
    for swap in (c.swap_rmsnorm, c.fuse_residual_rmsnorm):
        with pytest.raises(TypeError, match="^memory_efficient must be a bool"):
            swap(model, memory_efficient="yes")
        assert isinstance(model[1], nn.RMSNorm)
