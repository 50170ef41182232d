"""FlashInfer's SiLU-gated training names (``flashinfer.cake_rmsnorm_silu_gate_train``) on the gated
kernels' norm-then-gate form, so code written against that module switches by its import.

FlashInfer's functional forward returns no rstd, so its backward first runs a statistics kernel (the
forward's tiling and row sums: rstd bitwise the forward's); dx, dz and dw are then bitwise what the
autograd backward gives. Errors name FlashInfer's arguments (``weight``, ``grad_out``, ...).
"""

from __future__ import annotations

import torch

from .. import validation as v
from ..calls import gated_call
from ..kernels.gated_config import MAX_SEGMENT
from ..runtime.device import device_arch, device_facts, on_device
from ..runtime.launch_plan import workspace_bytes
from ..runtime.views import finish, new_output, vector_output
from . import autograd  # noqa: F401  (registers the custom ops the Function calls)
from .ops import (
    backward_programs_of,
    check_gradient_outputs,
    forward_of_call,
    forward_spec,
    launch_backward,
    launch_statistics,
    most_backward_programs,
)

__all__ = [
    "CakeRMSNormSiLUGateFunction",
    "cake_rmsnorm_silu_gate",
    "cake_rmsnorm_silu_gate_train_backward",
    "cake_rmsnorm_silu_gate_train_backward_workspace",
    "cake_rmsnorm_silu_gate_train_backward_workspace_bytes",
    "cake_rmsnorm_silu_gate_train_forward",
]

# FlashInfer's rows: head_dim 128.
FLASHINFER_HIDDEN = 128


class CakeRMSNormSiLUGateFunction(torch.autograd.Function):
    """``y = round(x * rstd * weight * silu(z))`` as a ``torch.autograd.Function`` under FlashInfer's
    name: ``CakeRMSNormSiLUGateFunction.apply(x, z, weight, eps=1e-6)``.

    Parameters
    ----------
    x, z : torch.Tensor
        ``[..., H]`` input and gate (at least 2-D), bf16, fp16 or fp32, one dtype, shape and device;
        CUDA (the kernels) or CPU; DTensors sharded on any dimension but the last, or replicated.
    weight : torch.Tensor
        ``[H]`` in x's dtype or fp32.
    eps : float
        Added to the mean square; finite, >= 0.

    Returns
    -------
    torch.Tensor
        y like x. The backward gives x and z their gradients in x's dtype and weight its FP32
        fixed-order sum rounded once to weight's dtype.

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong kind, dtype, shape or value, named, before anything runs.
    """

    @staticmethod
    def forward(ctx, x, z, weight, eps=1e-6):
        call = gated_call(x, z, weight, eps, None, True, 0.0, weight_name="weight")
        y, rstd = torch.ops.cake_cute.gated_rmsnorm_fwd(*call)
        ctx.save_for_backward(x, z, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, z, weight, rstd = ctx.saved_tensors
        dx, dz, dw = torch.ops.cake_cute.gated_rmsnorm_bwd(g, x, z, weight, rstd)
        return dx, dz, dw, None


def cake_rmsnorm_silu_gate(x, z, weight, eps=1e-6):
    """``CakeRMSNormSiLUGateFunction.apply(x, z, weight, eps)``: its parameters, result and errors."""
    return CakeRMSNormSiLUGateFunction.apply(x, z, weight, eps)


def cake_rmsnorm_silu_gate_train_forward(x, z, weight, eps=1e-6, *, out=None):
    """The SiLU-gated norm's forward: ``y = round(x * rstd * weight * silu(z))``, FP32 math, one rounding.

    Parameters
    ----------
    x, z, weight, eps
        As for ``CakeRMSNormSiLUGateFunction``; x on a supported CUDA device.
    out : torch.Tensor, optional
        Caller-owned y: x's shape and dtype, contiguous, vector aligned.

    Returns
    -------
    torch.Tensor
        y (``out`` when given).

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong kind, dtype, shape or value (named), x on the CPU or an unsupported
        GPU; raised before anything is launched or written.
    """
    call = gated_call(x, z, weight, eps, None, True, 0.0, weight_name="weight")
    y, _rstd = forward_of_call(call, out)
    return y


def _padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 16-byte vectors, so the next region starts aligned."""
    return -(-nbytes // 16) * 16


def _scratch_bytes(rows: int, hidden: int) -> int:
    """The workspace's first regions: rstd, then an FP32 dw to accumulate into."""
    return _padded(4 * rows) + _padded(4 * hidden)


def _carve(workspace, rows: int, hidden: int) -> tuple:
    """(rstd, the FP32 dw, the uint8 rest for the partial rows) of a workspace."""
    dw_start = _padded(4 * rows)
    rstd = workspace[: 4 * rows].view(torch.float32)
    dw32 = workspace[dw_start : dw_start + 4 * hidden].view(torch.float32)
    return rstd, dw32, workspace[_scratch_bytes(rows, hidden) :]


def cake_rmsnorm_silu_gate_train_backward_workspace_bytes(
    rows, device, *, deterministic=True, hidden=FLASHINFER_HIDDEN
) -> int:
    """Bytes of the workspace a ``cake_rmsnorm_silu_gate_train_backward`` of up to ``rows`` rows needs:
    rstd, an FP32 dw, the partial rows of dW (their number follows the SM count) and the grid barrier's
    counter (zero before the first call, as every call leaves it), for any activation dtype.

    Parameters
    ----------
    rows : int
        The most rows (``x.numel() // H``) a backward using it will have; >= 0.
    device : torch.device, str or int
        The CUDA device the backward runs on.
    deterministic : bool
        FlashInfer's flag; every backward here is deterministic, so both give one size.
    hidden : int
        The row width H, in [1, ``gated_config.MAX_SEGMENT``].

    Returns
    -------
    int
        Bytes.

    Raises
    ------
    TypeError
        rows or hidden not an int, deterministic not a bool.
    ValueError
        rows or hidden out of range; device names no CUDA device, or an unsupported one.
    """
    v.check_count("rows", rows, 0)
    v.check_bool("deterministic", deterministic)
    v.check_count("hidden", hidden, 1, MAX_SEGMENT)
    device = v.check_cuda_device(device)
    device_arch(device)
    facts = device_facts(device)
    programs = most_backward_programs(rows, hidden, hidden, facts)
    return _scratch_bytes(rows, hidden) + workspace_bytes(programs, hidden)


def cake_rmsnorm_silu_gate_train_backward_workspace(
    rows, device, *, deterministic=True, hidden=FLASHINFER_HIDDEN
) -> torch.Tensor:
    """A zero-filled workspace for ``cake_rmsnorm_silu_gate_train_backward`` calls of up to ``rows`` rows;
    one buffer serves any sequence of calls on its stream.

    Parameters
    ----------
    rows, device, deterministic, hidden
        As for ``cake_rmsnorm_silu_gate_train_backward_workspace_bytes``.

    Returns
    -------
    torch.Tensor
        A contiguous 1-D ``uint8`` tensor on ``device`` with a 16-byte aligned base.

    Raises
    ------
    TypeError, ValueError
        The errors of ``cake_rmsnorm_silu_gate_train_backward_workspace_bytes``.
    """
    nbytes = cake_rmsnorm_silu_gate_train_backward_workspace_bytes(
        rows, device, deterministic=deterministic, hidden=hidden
    )
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _check_weight_gradient(grad_weight, weight, accumulate: bool, compute: bool) -> None:
    """grad_weight: [H] in weight's dtype or FP32 on its device; required to accumulate into, refused
    without a weight gradient."""
    v.check_bool("accumulate_grad_weight", accumulate)
    v.check_bool("compute_grad_weight", compute)
    if not compute and (grad_weight is not None or accumulate):
        raise ValueError("grad_weight and accumulate_grad_weight=True need compute_grad_weight=True")
    if accumulate and grad_weight is None:
        raise ValueError("accumulate_grad_weight=True needs grad_weight (the gradient to add to)")
    if grad_weight is not None:
        v.check_weight(grad_weight, weight, "grad_weight")  # [H] in weight's dtype or FP32, on its device


def cake_rmsnorm_silu_gate_train_backward(
    grad_out,
    x,
    z,
    weight,
    eps=1e-6,
    *,
    grad_x=None,
    grad_z=None,
    grad_weight=None,
    accumulate_grad_weight=False,
    compute_grad_weight=True,
    workspace=None,
):
    """The SiLU-gated norm's backward: dx, dz and the weight gradient of
    ``y = round(x * rstd * weight * silu(z))``, rstd recomputed from x (bitwise the forward's).

    With n = x * rstd, s = sigmoid(z), a = grad_out * weight * silu(z), in FP32:
    ``dx = round(rstd * (a - n * mean(a * n)))``,
    ``dz = round(grad_out * n * weight * s * (1 + z * (1 - s)))``,
    ``dw = sum over rows of grad_out * n * silu(z)``, a fixed-order FP32 sum rounded once.

    Parameters
    ----------
    grad_out, x, z : torch.Tensor
        ``[..., H]`` of one shape, dtype (bf16, fp16 or fp32) and CUDA device.
    weight : torch.Tensor
        ``[H]`` in x's dtype or fp32.
    eps : float
        The forward's epsilon.
    grad_x, grad_z : torch.Tensor, optional
        Caller-owned gradients of x and z: like x, contiguous, vector aligned.
    grad_weight : torch.Tensor, optional
        Caller-owned ``[H]`` weight gradient in weight's dtype or fp32, returned as dw.
    accumulate_grad_weight : bool
        Add the weight gradient to ``grad_weight`` (required): their FP32 sum, rounded once.
    compute_grad_weight : bool
        False: no weight gradient (dw is None).
    workspace : torch.Tensor, optional
        A ``cake_rmsnorm_silu_gate_train_backward_workspace``; with it and the outputs given, the call
        allocates nothing (CUDA graph capture).

    Returns
    -------
    (dx, dz, dw)
        dx and dz like x, dw in weight's dtype (the caller's tensors when given), or None.

    Raises
    ------
    TypeError, ValueError
        A bad argument (named), a too small or misaligned workspace, x off a supported GPU; before
        anything is launched or written.
    """
    call = gated_call(x, z, weight, eps, None, True, 0.0, weight_name="weight")
    v.check_like("grad_out", grad_out, x)
    check_gradient_outputs(call, ("grad_x", grad_x), ("grad_z", grad_z))
    _check_weight_gradient(grad_weight, weight, accumulate_grad_weight, compute_grad_weight)
    if workspace is not None:
        v.check_workspace(workspace, x.device)
    spec = forward_spec(call)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    dx = new_output(x) if grad_x is None else grad_x
    dz = new_output(x) if grad_z is None else grad_z
    dw = None
    if compute_grad_weight:
        dw = new_output(weight) if grad_weight is None else grad_weight
    if rows == 0:
        if dw is not None and not accumulate_grad_weight:
            dw.zero_()
        return dx, dz, dw
    programs = backward_programs_of(call, spec)
    needed = _scratch_bytes(rows, hidden) + workspace_bytes(programs, hidden)
    counter_space = workspace  # the caller's is zeroed; a fresh one's counter is not (the stream's serves)
    if workspace is None:
        workspace = torch.empty(needed, dtype=torch.uint8, device=x.device)
    else:
        v.check_workspace_size(workspace, needed)
    rstd, dw32, partial_space = _carve(workspace, rows, hidden)
    # The FP32 sum to add to grad_weight, or a stand-in when no weight gradient is asked for (a backward
    # that finishes dW in its launch writes one anyway), goes to the workspace's; else dw (or a
    # contiguous copy of it) is written.
    written, caller = dw32, None
    if dw is not None and not accumulate_grad_weight:
        written, caller = vector_output(dw, hidden, dw.dtype, dw.device)
    with on_device(x.device):
        launch_statistics(call, spec, rstd)
        launch_backward(
            call,
            spec,
            grad_out,
            rstd,
            dx,
            dz,
            written,
            programs,
            partial_space,
            counter_space,
            dw is not None,
        )
        if accumulate_grad_weight:
            dw.add_(dw32)
        elif dw is not None:
            finish(written, caller)
    return dx, dz, dw
