"""The bad-input tables again with CUDA tensors (where the device check would pass), plus what needs
CUDA: mixed devices, a too-small or misaligned workspace; the valid base calls run and the workspace
helpers on the GPU. The call model is ``_validation_cases``."""

from __future__ import annotations

import pytest
import torch

from cake_cute import cake_rmsnorm_train_backward_workspace, cake_rmsnorm_train_backward_workspace_bytes

from ._helpers import fixed_seed, sentinel  # noqa: F401 (fixed_seed: autouse fixture)
from ._validation_cases import (
    BF16,
    CONTROL_CALLS,
    F32,
    OUTPUT_NAMES,
    Case,
    H,
    T,
    arg,
    assert_untouched,
    bwd_call,
    check_raises,
    ids,
    kw,
    misaligned_workspace,
)
from .test_validation_backward_cpu import BACKWARD_CASES
from .test_validation_entry_points_cpu import ENTRY_CASES
from .test_validation_forward_cpu import FORWARD_CASES

GPU_CASES = [
    # ---- mixed devices
    Case(
        "gpu-fwd-w-on-cpu",
        "fwd",
        arg(1, lambda c, d: c.args[1].cpu()),
        ValueError,
        r"^w must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-fwd-x-on-cpu",
        "fwd",
        arg(0, lambda c, d: c.args[0].cpu()),
        ValueError,
        r"^w must be on the same device as x \(cpu\)",
    ),
    Case(
        "gpu-fwd-residual-on-cpu",
        "fwd",
        kw("residual", lambda c, d: c.kwargs["residual"].cpu()),
        ValueError,
        r"^residual must be on the same device as x \(cuda",
        build=dict(residual=True),
    ),
    Case(
        "gpu-fwd-out-on-cpu",
        "fwd",
        kw("out", lambda c, d: sentinel((T, H), F32, "cpu")),
        ValueError,
        r"^out must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-fwd-rstd-out-on-cpu",
        "fwd",
        kw("rstd", lambda c, d: sentinel((T,), F32, "cpu")),
        ValueError,
        r"^rstd must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-fwd-residual_out-on-cpu",
        "fwd",
        kw("residual_out", lambda c, d: sentinel((T, H), F32, "cpu")),
        ValueError,
        r"^residual_out must be on the same device as x \(cuda",
        build=dict(residual=True),
    ),
    Case(
        "gpu-bwd-g-on-cpu",
        "bwd",
        arg(0, lambda c, d: c.args[0].cpu()),
        ValueError,
        r"^g must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-w-on-cpu",
        "bwd",
        arg(2, lambda c, d: c.args[2].cpu()),
        ValueError,
        r"^w must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-rstd-on-cpu",
        "bwd",
        arg(3, lambda c, d: c.args[3].cpu()),
        ValueError,
        r"^rstd must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-g_residual-on-cpu",
        "bwd",
        kw("g_residual", lambda c, d: c.kwargs["g_residual"].cpu()),
        ValueError,
        r"^g_residual must be on the same device as x \(cuda",
        build=dict(residual=True),
    ),
    Case(
        "gpu-bwd-dx-on-cpu",
        "bwd",
        kw("dx", lambda c, d: sentinel((T, H), F32, "cpu")),
        ValueError,
        r"^dx must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-dw-on-cpu",
        "bwd",
        kw("dw", lambda c, d: sentinel((H,), F32, "cpu")),
        ValueError,
        r"^dw must be on the same device as x \(cuda",
    ),
    Case(
        "gpu-bwd-workspace-on-cpu",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(1 << 20, dtype=torch.uint8)),
        ValueError,
        r"^workspace must be on the same device as x \(cuda",
    ),
    # ---- workspace size and alignment
    Case(
        "gpu-bwd-workspace-too-small",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(16, dtype=torch.uint8, device=d)),
        ValueError,
        r"^workspace holds 16 bytes; this call needs at least \d+",
    ),
    Case(
        "gpu-bwd-workspace-misaligned",
        "bwd",
        kw("workspace", misaligned_workspace),
        ValueError,
        r"^workspace .*16-byte aligned",
    ),
    Case(
        "gpu-bwd-workspace-non-contiguous",
        "bwd",
        kw("workspace", lambda c, d: torch.zeros(1 << 16, dtype=torch.uint8, device=d)[::2]),
        ValueError,
        r"^workspace must be a contiguous",
    ),
]

CPU_CASES = FORWARD_CASES + BACKWARD_CASES + ENTRY_CASES


@pytest.mark.gpu
@pytest.mark.parametrize("case", ids(GPU_CASES + [c for c in CPU_CASES if not c.api.startswith("ws")]))
def test_bad_input_gpu(case):
    """The whole table again with CUDA tensors (where the device check would pass), plus the cases
    that need CUDA. Caller-owned CUDA outputs must stay untouched: nothing may be launched."""
    check_raises(case, "cuda")
    torch.cuda.synchronize()  # an asynchronous fault from a stray launch would surface here


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in CONTROL_CALLS])
def test_control_valid_arguments_run_on_gpu(name):
    """The same base calls succeed on the GPU and overwrite the sentinels of their outputs."""
    call = CONTROL_CALLS[name]("cuda")
    outputs = {k: v for k, v in call.kwargs.items() if k in OUTPUT_NAMES.get(call.api, ())}
    result = call.invoke()
    torch.cuda.synchronize()
    assert result is not None
    for label, t in outputs.items():
        assert not torch.any(t == -7.0), f"{label} still holds the sentinel"
        assert torch.isfinite(t).all(), f"{label} is not finite"


@pytest.mark.gpu
def test_workspace_helpers_on_gpu():
    nbytes = cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, "cuda")
    assert isinstance(nbytes, int) and nbytes > 0 and nbytes % 16 == 0
    assert (
        cake_rmsnorm_train_backward_workspace_bytes(0, 4096, "cuda") > 0
    )  # T = 0 still needs a valid buffer
    assert cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, "cuda", residual=True) > 0
    # A device index is a device, as for torch.
    assert cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, 0) == nbytes
    # Monotone in rows: a workspace for more rows serves fewer.
    sizes = [cake_rmsnorm_train_backward_workspace_bytes(t, 4096, "cuda") for t in (1, 129, 4096, 16231)]
    assert sizes == sorted(sizes)
    ws = cake_rmsnorm_train_backward_workspace(4096, 4096, "cuda")
    assert ws.dtype == torch.uint8 and ws.is_cuda and ws.numel() == nbytes and ws.is_contiguous()
    assert ws.data_ptr() % 16 == 0
    assert int(ws.count_nonzero().item()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_workspace_size_threshold_on_gpu(residual):
    """The error states the exact size a call needs: one byte less is refused (outputs untouched),
    exactly that many bytes works, and the size helper never asks for less."""
    rows, hidden = 129, 4096
    call = bwd_call("cuda", dtype=BF16, residual=residual, shape=(rows, hidden))
    call.kwargs["workspace"] = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"needs at least (\d+)") as info:
        call.invoke()
    import re

    needed = int(re.search(r"needs at least (\d+)", str(info.value)).group(1))
    assert needed > 16
    assert cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, "cuda", residual=residual) >= needed

    call.kwargs["workspace"] = torch.zeros(needed - 1, dtype=torch.uint8, device="cuda")
    snapshot = call.snapshot()
    with pytest.raises(ValueError, match=r"^workspace holds"):
        call.invoke()
    assert_untouched(snapshot)

    call.kwargs["workspace"] = torch.zeros(needed, dtype=torch.uint8, device="cuda")
    dx, dw = call.invoke()
    torch.cuda.synchronize()
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
