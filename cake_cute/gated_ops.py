"""Functional entry points of the gated RMSNorm kernels (``kernels.gated_fwd``, ``kernels.gated_bwd``):
argument checks, the views the kernels read, and the launches.

Every argument is checked before anything is launched or written, the device last, so the argument
errors can be exercised without a GPU. Leading dimensions of x collapse into rows; rows may be
strided (a contiguous last dimension, a row stride and base aligned to the vector width), otherwise
they are copied once (``views.kernel_view``).
"""

from __future__ import annotations

import torch

from . import validation as v
from .calls import GatedCall, gated_call
from .compile_cache import kernel
from .device import DeviceFacts, device_arch, device_facts, on_device, resident_clusters
from .kernels.gated_config import GatedConfig, gated_backward_config
from .kernels.tiling import vector_width
from .launch_plan import partial_row_stride
from .views import aligned_vector, is_direct_output, kernel_view, new_output, rows_view
from .vocab import dtype_name


def rstd_shape(x: torch.Tensor, group_size: int) -> tuple[int, ...]:
    """rstd's shape: x's leading dims, then H / group_size when a row has several groups."""
    groups = x.shape[-1] // group_size
    return (*x.shape[:-1], *((groups,) if groups > 1 else ()))


def _check_output(name: str, t, shape, dtype, device, vec: int) -> None:
    """A caller-owned output: the expected shape, dtype and device, contiguous and vector aligned (the
    kernels write it directly)."""
    v.check_output(name, t, shape, dtype, device)
    if not is_direct_output(t, vec):
        raise ValueError(f"{name} must be contiguous with a {vec * t.element_size()}-byte aligned base")


def _output(given, like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """The caller's (checked) output, or a fresh one."""
    return new_output(like, shape, dtype) if given is None else given


def _variant(call: GatedCall) -> tuple:
    """The fields after the kind of the kernels' spec (``specs.GatedSpec``); checks the device."""
    x = call.x
    arch = device_arch(x.device)
    return (
        arch,
        dtype_name(x.dtype),
        dtype_name(call.w.dtype),
        x.shape[-1],
        call.group_size,
        call.norm_before_gate,
        call.weight_offset,
    )


def gated_rmsnorm_forward(
    x, z, w, eps=1e-6, *, group_size=None, norm_before_gate=True, weight_offset=0.0, out=None, rstd=None
):
    """Gated RMSNorm forward: ``y = x * rstd * (w + offset) * silu(z)`` (norm then gate) or
    ``y = rmsnorm_group(x * silu(z)) * (w + offset)`` (gate then norm), FP32 math, one rounding.

    Parameters
    ----------
    x, z : torch.Tensor
        [..., H] input and gate; bf16, fp16 or fp32, the same dtype, shape and device.
    w : torch.Tensor
        [H] weight, x's dtype or fp32.
    eps : float
        Added to the mean square; finite, >= 0.
    group_size : int, optional
        Columns per statistics group, dividing H, at most ``MAX_SEGMENT`` (default H).
    norm_before_gate : bool
        True (Qwen3-Next) or False: gate, then normalize per group (NemotronH, Mamba-2).
    weight_offset : float
        Added to w in FP32 (1.0 for a ``1 + w`` weight).
    out, rstd : torch.Tensor, optional
        Caller-owned outputs (contiguous, vector aligned) for y and rstd.

    Returns
    -------
    (y, rstd)
        y like x (contiguous), rstd FP32 of shape ``rstd_shape(x, group_size)``.

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong kind, dtype, shape or value, x not on a supported CUDA device
        (named in the message; nothing is launched).
    """
    return forward_of_call(gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset), out, rstd)


def forward_of_call(call: GatedCall, out=None, rstd=None):
    """``gated_rmsnorm_forward`` of arguments ``gated_call`` accepted: the caller-owned outputs checked,
    then the launch."""
    x, z, w, group_size = call.x, call.z, call.w, call.group_size
    vec = vector_width(group_size, x.element_size())
    if out is not None:
        _check_output("out", out, x.shape, x.dtype, x.device, vec)
    if rstd is not None:
        _check_output("rstd", rstd, rstd_shape(x, group_size), torch.float32, x.device, 1)
    fields = _variant(call)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    y = _output(out, x)
    rstd = _output(rstd, x, rstd_shape(x, group_size), torch.float32)
    if rows > 0:
        fn = kernel("gated_fwd", *fields)
        with on_device(x.device):
            fn(
                kernel_view(x, vec),
                kernel_view(z, vec),
                aligned_vector(w, vec),
                rows_view(y, hidden),
                rstd.view(rows, hidden // group_size),
                call.eps,
            )
    return y, rstd


def backward_programs(rows: int, config: GatedConfig, groups: int, facts: DeviceFacts) -> int:
    """Programs (along x; the grid has ``groups`` CTAs, or clusters of a wide segment's CTAs, along y)
    of the persistent gated backward: as many as are resident with the groups' beside them, never
    more than there are row tiles. The partition of rows -- and so dw's bits -- depends only on T,
    the GPU model and the variant."""
    tiling = config.tiling
    tiles = -(-rows // tiling.rows_per_cta)
    resident = resident_clusters(
        facts.index,
        facts.capability,
        tiling.threads_per_cta,
        tiling.cluster_n,
        config.ctas_per_sm,
        facts.sm_count,
    )
    return max(1, min(tiles, resident // groups))


def gated_rmsnorm_backward(
    g, x, z, w, rstd, *, group_size=None, norm_before_gate=True, weight_offset=0.0, dx=None, dz=None, dw=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated RMSNorm backward: dx and dz in one pass (the gate and the normalized input recomputed
    from x, z, w and the forward's rstd), dw as a fixed-order FP32 sum of per-program partial rows.
    Bitwise reproducible; a row's dx and dz do not depend on the other rows.

    Parameters
    ----------
    g : torch.Tensor
        Gradient of y, x's dtype, shape and device.
    x, z, w, group_size, norm_before_gate, weight_offset
        As given to ``gated_rmsnorm_forward``.
    rstd : torch.Tensor
        The forward's rstd: FP32 of shape ``rstd_shape(x, group_size)``.
    dx, dz, dw : torch.Tensor, optional
        Caller-owned outputs (contiguous, vector aligned; dw FP32 [H]).

    Returns
    -------
    (dx, dz, dw)
        dx and dz like x (contiguous), dw FP32 [H].

    Raises
    ------
    TypeError, ValueError
        As ``gated_rmsnorm_forward``, and g or rstd of the wrong dtype, shape or device.
    """
    call = gated_call(x, z, w, None, group_size, norm_before_gate, weight_offset)
    group_size = call.group_size
    v.check_like("g", g, x)
    v.check_output("rstd", rstd, rstd_shape(x, group_size), torch.float32, x.device)
    vec = vector_width(group_size, x.element_size())
    for name, given in (("dx", dx), ("dz", dz)):
        if given is not None:
            _check_output(name, given, x.shape, x.dtype, x.device, vec)
    if dw is not None:
        _check_output("dw", dw, (x.shape[-1],), torch.float32, x.device, 1)
    fields = _variant(call)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    dx, dz, dw = _output(dx, x), _output(dz, x), _output(dw, x, (hidden,), torch.float32)
    if rows == 0:
        return dx, dz, dw.zero_()
    groups = hidden // group_size
    config = gated_backward_config(fields[0], fields[1], hidden, group_size)
    programs = backward_programs(rows, config, groups, device_facts(x.device))
    stride = partial_row_stride(hidden)
    partials = torch.empty((programs, stride), dtype=torch.float32, device=x.device)[:, :hidden]
    backward, reduce = kernel("gated_bwd", *fields), kernel("dw", fields[0], "fp32", hidden)
    with on_device(x.device):
        backward(
            kernel_view(g, vec),
            kernel_view(x, vec),
            kernel_view(z, vec),
            aligned_vector(w, vec),
            rstd.reshape(rows, groups).contiguous(),
            rows_view(dx, hidden),
            rows_view(dz, hidden),
            partials,
            programs,
        )
        reduce(partials, dw)
    return dx, dz, dw
