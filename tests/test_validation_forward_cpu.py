"""Bad inputs of ``cake_rmsnorm_train_forward`` (x, w, eps, residual, caller-owned outputs,
weight_offset) raise the exact error naming the argument, before anything is written; the call model
is ``_validation_cases``."""

from __future__ import annotations

import pytest
import torch

from ._helpers import fixed_seed, sentinel  # noqa: F401 (fixed_seed: autouse fixture)
from ._validation_cases import (
    BF16,
    F16,
    F32,
    Case,
    H,
    T,
    arg,
    both,
    check_raises,
    ids,
    kw,
    rand,
)

FORWARD_CASES = [
    # ---- forward: x
    Case("fwd-x-fp64", "fwd", arg(0, lambda c, d: c.args[0].double()), TypeError, r"^x must have dtype"),
    Case(
        "fwd-x-int32",
        "fwd",
        arg(0, lambda c, d: rand((T, H), torch.int32, d)),
        TypeError,
        r"^x must have dtype",
    ),
    Case(
        "fwd-x-bool",
        "fwd",
        arg(0, lambda c, d: rand((T, H), torch.bool, d)),
        TypeError,
        r"^x must have dtype",
    ),
    Case(
        "fwd-x-list", "fwd", arg(0, lambda c, d: c.args[0].tolist()), TypeError, r"^x must be a torch\.Tensor"
    ),
    Case("fwd-x-None", "fwd", arg(0, lambda c, d: None), TypeError, r"^x must be a torch\.Tensor"),
    Case(
        "fwd-x-0d",
        "fwd",
        arg(0, lambda c, d: torch.tensor(1.5, device=d)),
        ValueError,
        r"^x must have at least 1 dim",
    ),
    Case(
        "fwd-x-H0",
        "fwd",
        both(arg(0, lambda c, d: rand((T, 0), F32, d)), arg(1, lambda c, d: rand((0,), F32, d))),
        ValueError,
        r"^x's hidden size .*got 0",
    ),
    Case(
        "fwd-x-H-262145",
        "fwd",
        both(
            arg(0, lambda c, d: rand((1, 262145), BF16, d)),
            arg(1, lambda c, d: rand((262145,), BF16, d)),
            kw("out", lambda c, d: sentinel((1, 262145), BF16, d)),
            kw("rstd", lambda c, d: sentinel((1,), F32, d)),
        ),
        ValueError,
        r"^x's hidden size .*262144.*got 262145",
        build=dict(dtype=BF16),
    ),
    # ---- forward: w
    Case(
        "fwd-w-int32",
        "fwd",
        arg(1, lambda c, d: rand((H,), torch.int32, d)),
        TypeError,
        r"^w must have dtype",
    ),
    Case(
        "fwd-w-fp64",
        "fwd",
        arg(1, lambda c, d: rand((H,), torch.float64, d)),
        TypeError,
        r"^w must have dtype",
    ),
    Case(
        "fwd-w-fp16-with-bf16-x",
        "fwd",
        arg(1, lambda c, d: rand((H,), F16, d)),
        TypeError,
        r"^w must have dtype bfloat16, float32",
        build=dict(dtype=BF16),
    ),
    Case(
        "fwd-w-wrong-length",
        "fwd",
        arg(1, lambda c, d: rand((H - 1,), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case(
        "fwd-w-2d",
        "fwd",
        arg(1, lambda c, d: rand((1, H), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case("fwd-w-list", "fwd", arg(1, lambda c, d: [1.0] * H), TypeError, r"^w must be a torch\.Tensor"),
    # ---- forward: eps
    Case(
        "fwd-eps-negative",
        "fwd",
        arg(2, lambda c, d: -1e-6),
        ValueError,
        r"^eps must be a finite number >= 0",
    ),
    Case(
        "fwd-eps-nan", "fwd", arg(2, lambda c, d: float("nan")), ValueError, r"^eps must be a finite number"
    ),
    Case(
        "fwd-eps-inf", "fwd", arg(2, lambda c, d: float("inf")), ValueError, r"^eps must be a finite number"
    ),
    Case(
        "fwd-eps-minus-inf",
        "fwd",
        arg(2, lambda c, d: float("-inf")),
        ValueError,
        r"^eps must be a finite number",
    ),
    Case("fwd-eps-str", "fwd", arg(2, lambda c, d: "1e-6"), TypeError, r"^eps must be a float"),
    Case("fwd-eps-bool", "fwd", arg(2, lambda c, d: True), TypeError, r"^eps must be a float"),
    Case("fwd-eps-None", "fwd", arg(2, lambda c, d: None), TypeError, r"^eps must be a float"),
    Case("fwd-eps-complex", "fwd", arg(2, lambda c, d: 1e-6 + 0j), TypeError, r"^eps must be a float"),
    # ---- forward: residual
    Case(
        "fwd-residual-shape",
        "fwd",
        kw("residual", lambda c, d: rand((T, H + 1), F32, d)),
        ValueError,
        r"^residual must have shape \(4, 8\)",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual-transposed-shape",
        "fwd",
        kw("residual", lambda c, d: rand((H, T), F32, d)),
        ValueError,
        r"^residual must have shape",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual-dtype",
        "fwd",
        kw("residual", lambda c, d: rand((T, H), F16, d)),
        TypeError,
        r"^residual must have dtype float32",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual-list",
        "fwd",
        kw("residual", lambda c, d: [[0.5] * H] * T),
        TypeError,
        r"^residual must be a torch\.Tensor",
        build=dict(residual=True),
    ),
    # ---- forward: caller-owned outputs
    Case(
        "fwd-out-shape",
        "fwd",
        kw("out", lambda c, d: sentinel((T, H - 1), F32, d)),
        ValueError,
        r"^out must have shape \(4, 8\)",
    ),
    Case(
        "fwd-out-dtype",
        "fwd",
        kw("out", lambda c, d: sentinel((T, H), BF16, d)),
        TypeError,
        r"^out must have dtype float32",
    ),
    Case(
        "fwd-out-list", "fwd", kw("out", lambda c, d: [0.0] * H), TypeError, r"^out must be a torch\.Tensor"
    ),
    Case(
        "fwd-rstd-out-fp16",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), F16, d)),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "fwd-rstd-out-fp64",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), torch.float64, d)),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "fwd-rstd-out-bf16-x",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), BF16, d)),
        TypeError,
        r"^rstd must have dtype float32",
        build=dict(dtype=BF16),
    ),
    Case(
        "fwd-rstd-out-length",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T + 1,), F32, d)),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case(
        "fwd-rstd-out-2d",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T, 1), F32, d)),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case(
        "fwd-rstd-out-3d-x",
        "fwd",
        kw("rstd", lambda c, d: sentinel((2, 3), F32, d)),
        ValueError,
        r"^rstd must have shape \(6,\)",
        build=dict(shape=(2, 3, H)),
    ),
    Case(
        "fwd-residual_out-without-residual",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T, H), F32, d)),
        ValueError,
        r"^residual_out .*residual=",
    ),
    Case(
        "fwd-residual_out-shape",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T + 1, H), F32, d)),
        ValueError,
        r"^residual_out must have shape \(4, 8\)",
        build=dict(residual=True),
    ),
    Case(
        "fwd-residual_out-dtype",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T, H), F16, d)),
        TypeError,
        r"^residual_out must have dtype float32",
        build=dict(residual=True),
    ),
    # ---- forward: weight_offset (not validated yet)
    Case(
        "fwd-weight_offset-str", "fwd", kw("weight_offset", lambda c, d: "1.0"), TypeError, r"weight_offset"
    ),
    Case(
        "fwd-weight_offset-nan",
        "fwd",
        kw("weight_offset", lambda c, d: float("nan")),
        ValueError,
        r"weight_offset",
    ),
    Case(
        "fwd-weight_offset-inf",
        "fwd",
        kw("weight_offset", lambda c, d: float("inf")),
        ValueError,
        r"weight_offset",
    ),
]


@pytest.mark.parametrize("case", ids(FORWARD_CASES))
def test_bad_forward_input_cpu(case):
    check_raises(case, "cpu")
