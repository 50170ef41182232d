"""Bad inputs of ``cake_rmsnorm_train_backward`` (g, x, w, rstd, g_residual, caller-owned outputs,
workspace, weight_offset, dw_dtype) raise the exact error naming the argument, before anything is
written; the call model is ``_validation_cases``."""

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
    misaligned_workspace,
    rand,
)

BACKWARD_CASES = [
    # ---- backward: g, x, w, rstd, g_residual
    Case("bwd-x-fp64", "bwd", arg(1, lambda c, d: c.args[1].double()), TypeError, r"^x must have dtype"),
    Case(
        "bwd-x-0d",
        "bwd",
        arg(1, lambda c, d: torch.tensor(1.5, device=d)),
        ValueError,
        r"^x must have at least 1 dim",
    ),
    Case("bwd-x-list", "bwd", arg(1, lambda c, d: [[1.0] * H] * T), TypeError, r"^x must be a torch\.Tensor"),
    Case(
        "bwd-g-dtype",
        "bwd",
        arg(0, lambda c, d: rand((T, H), BF16, d)),
        TypeError,
        r"^g must have dtype float32",
    ),
    Case(
        "bwd-g-fp32-with-bf16-x",
        "bwd",
        arg(0, lambda c, d: rand((T, H), F32, d)),
        TypeError,
        r"^g must have dtype bfloat16",
        build=dict(dtype=BF16),
    ),
    Case(
        "bwd-g-shape",
        "bwd",
        arg(0, lambda c, d: rand((T + 1, H), F32, d)),
        ValueError,
        r"^g must have shape \(4, 8\)",
    ),
    Case(
        "bwd-g-flattened-3d",
        "bwd",
        arg(0, lambda c, d: rand((6, H), F32, d)),
        ValueError,
        r"^g must have shape \(2, 3, 8\)",
        build=dict(shape=(2, 3, H)),
    ),
    Case(
        "bwd-g-list",
        "bwd",
        arg(0, lambda c, d: [[1.0] * H] * T),
        TypeError,
        r"^g must be a tensor or a list / tuple of 1 to 3 tensors \(its summands\), got list of length 4",
    ),
    Case(
        "bwd-g-parts-lists",
        "bwd",
        arg(0, lambda c, d: [[1.0] * H] * 2),
        TypeError,
        r"^g\[0\] must be a torch\.Tensor",
    ),
    Case(
        "bwd-g-parts-shape",
        "bwd",
        arg(0, lambda c, d: (rand((T, H), F32, d), rand((T + 1, H), F32, d))),
        ValueError,
        r"^g\[1\] must have shape \(4, 8\)",
    ),
    Case(
        "bwd-w-int", "bwd", arg(2, lambda c, d: rand((H,), torch.int64, d)), TypeError, r"^w must have dtype"
    ),
    Case(
        "bwd-w-wrong-length",
        "bwd",
        arg(2, lambda c, d: rand((H + 1,), F32, d)),
        ValueError,
        r"^w must have shape \(8,\)",
    ),
    Case(
        "bwd-rstd-fp16",
        "bwd",
        arg(3, lambda c, d: c.args[3].half()),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "bwd-rstd-bf16",
        "bwd",
        arg(3, lambda c, d: c.args[3].bfloat16()),
        TypeError,
        r"^rstd must have dtype float32",
    ),
    Case(
        "bwd-rstd-length",
        "bwd",
        arg(3, lambda c, d: c.args[3][:-1]),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case(
        "bwd-rstd-2d",
        "bwd",
        arg(3, lambda c, d: c.args[3][:, None]),
        ValueError,
        r"^rstd must have shape \(4,\)",
    ),
    Case("bwd-rstd-list", "bwd", arg(3, lambda c, d: [1.0] * T), TypeError, r"^rstd must be a torch\.Tensor"),
    Case(
        "bwd-g_residual-dtype",
        "bwd",
        kw("g_residual", lambda c, d: rand((T, H), F16, d)),
        TypeError,
        r"^g_residual must have dtype float32",
    ),
    Case(
        "bwd-g_residual-shape",
        "bwd",
        kw("g_residual", lambda c, d: rand((T, H + 2), F32, d)),
        ValueError,
        r"^g_residual must have shape \(4, 8\)",
    ),
    Case(
        "bwd-deterministic-int",
        "bwd",
        kw("deterministic", lambda c, d: 1),
        TypeError,
        r"^deterministic must be a bool",
    ),
    Case(
        "bwd-deterministic-None",
        "bwd",
        kw("deterministic", lambda c, d: None),
        TypeError,
        r"^deterministic must be a bool",
    ),
    Case(
        "bwd-deterministic-str",
        "bwd",
        kw("deterministic", lambda c, d: "yes"),
        TypeError,
        r"^deterministic must be a bool",
    ),
    # ---- backward: caller-owned outputs
    Case(
        "bwd-dx-dtype",
        "bwd",
        kw("dx", lambda c, d: sentinel((T, H), F16, d)),
        TypeError,
        r"^dx must have dtype float32",
    ),
    Case(
        "bwd-dx-shape",
        "bwd",
        kw("dx", lambda c, d: sentinel((T, H + 1), F32, d)),
        ValueError,
        r"^dx must have shape \(4, 8\)",
    ),
    Case("bwd-dx-list", "bwd", kw("dx", lambda c, d: [0.0]), TypeError, r"^dx must be a torch\.Tensor"),
    Case(
        "bwd-dw-shape",
        "bwd",
        kw("dw", lambda c, d: sentinel((H - 1,), F32, d)),
        ValueError,
        r"^dw must have shape \(8,\)",
    ),
    Case(
        "bwd-dw-2d",
        "bwd",
        kw("dw", lambda c, d: sentinel((1, H), F32, d)),
        ValueError,
        r"^dw must have shape \(8,\)",
    ),
    Case(
        "bwd-dw-dtype",
        "bwd",
        kw("dw", lambda c, d: sentinel((H,), BF16, d)),
        TypeError,
        r"^dw must have dtype float32",
    ),
    Case(
        "bwd-dw-fp32-when-dw_dtype-bf16",
        "bwd",
        both(kw("dw", lambda c, d: sentinel((H,), F32, d)), kw("dw_dtype", lambda c, d: BF16)),
        TypeError,
        r"^dw must have dtype bfloat16",
    ),
    # ---- backward: workspace
    Case(
        "bwd-workspace-fp32",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(4096, dtype=F32, device=d)),
        TypeError,
        r"^workspace must have dtype uint8",
    ),
    Case(
        "bwd-workspace-int8",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(4096, dtype=torch.int8, device=d)),
        TypeError,
        r"^workspace must have dtype uint8",
    ),
    Case(
        "bwd-workspace-list",
        "bwd",
        kw("workspace", lambda c, d: [0] * 64),
        TypeError,
        r"^workspace must be a torch\.Tensor",
    ),
    Case(
        "bwd-workspace-non-contiguous",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(1 << 16, dtype=torch.uint8, device=d)[::2]),
        ValueError,
        r"^workspace must be a contiguous",
    ),
    Case(
        "bwd-workspace-misaligned",
        "bwd",
        kw("workspace", misaligned_workspace),
        ValueError,
        r"^workspace .*16-byte aligned",
    ),
    Case(
        "bwd-workspace-2d",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(256, 256, dtype=torch.uint8, device=d)),
        ValueError,
        r"^workspace must be a contiguous 1-D",
    ),
    # ---- backward: weight_offset / dw_dtype (not validated yet)
    Case(
        "bwd-weight_offset-nan",
        "bwd",
        kw("weight_offset", lambda c, d: float("nan")),
        ValueError,
        r"weight_offset",
    ),
    Case("bwd-dw_dtype-int32", "bwd", kw("dw_dtype", lambda c, d: torch.int32), TypeError, r"dw_dtype"),
    Case("bwd-dw_dtype-fp64", "bwd", kw("dw_dtype", lambda c, d: torch.float64), TypeError, r"dw_dtype"),
]


@pytest.mark.parametrize("case", ids(BACKWARD_CASES))
def test_bad_backward_input_cpu(case):
    check_raises(case, "cpu")
