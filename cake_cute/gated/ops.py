"""Functional entry points of the gated RMSNorm kernels (``kernels.gated_fwd``, ``kernels.gated_bwd``):
argument checks, the views the kernels read, and the launches.

Every argument is checked before anything is launched or written, the device last, so the argument
errors can be exercised without a GPU. Leading dimensions of x collapse into rows; rows may be
strided (a contiguous last dimension, a row stride and base aligned to the vector width), otherwise
they are copied once (``views.kernel_view``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import validation as v
from ..calls import GatedCall, gated_call
from ..kernels.gated_config import GatedConfig, gated_backward_config
from ..kernels.tiling import vector_width
from ..runtime.cache import get_kernel
from ..runtime.device import DeviceFacts, device_arch, device_facts, on_device, resident_clusters
from ..runtime.specs import GatedSpec, ReduceSpec
from ..runtime.views import (
    aligned_vector,
    barrier_counter,
    is_direct_output,
    kernel_view,
    new_output,
    partial_rows_view,
    rows_view,
)
from ..vocab import DTYPE_NAMES, SILU, dtype_name


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


def forward_spec(call: GatedCall) -> GatedSpec:
    """The forward kernel's spec of a call; the backward's and the statistics' are this one with another
    kind (``dataclasses.replace``). Checks the device."""
    x = call.x
    return GatedSpec(
        "gated_fwd",
        device_arch(x.device),
        dtype_name(x.dtype),
        dtype_name(call.w.dtype),
        x.shape[-1],
        group_size=call.group_size,
        norm_before_gate=call.norm_before_gate,
        weight_offset=call.weight_offset,
        activation=call.activation,
    )


def gated_rmsnorm_forward(
    x,
    z,
    w,
    eps=1e-6,
    *,
    group_size=None,
    norm_before_gate=True,
    weight_offset=0.0,
    activation=SILU,
    out=None,
    rstd=None,
):
    """Gated RMSNorm forward: ``y = x * rstd * (w + offset) * act(z)`` (norm then gate) or
    ``y = rmsnorm_group(x * act(z)) * (w + offset)`` (gate then norm), FP32 math, one rounding; act is
    SiLU or sigmoid.

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
    activation : str
        The gate's activation: ``"silu"`` (Qwen3-Next, Mamba-2) or ``"sigmoid"`` (Kimi Linear).
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
    call = gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
    return forward_of_call(call, out, rstd)


def forward_of_call(call: GatedCall, out=None, rstd=None):
    """``gated_rmsnorm_forward`` of arguments ``gated_call`` accepted: the caller-owned outputs checked,
    then the launch."""
    x, z, w, group_size = call.x, call.z, call.w, call.group_size
    vec = vector_width(group_size, x.element_size())
    if out is not None:
        _check_output("out", out, x.shape, x.dtype, x.device, vec)
    if rstd is not None:
        _check_output("rstd", rstd, rstd_shape(x, group_size), torch.float32, x.device, 1)
    spec = forward_spec(call)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    y = _output(out, x)
    rstd = _output(rstd, x, rstd_shape(x, group_size), torch.float32)
    if rows > 0:
        fn = get_kernel(spec)
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
    g,
    x,
    z,
    w,
    rstd,
    *,
    group_size=None,
    norm_before_gate=True,
    weight_offset=0.0,
    activation=SILU,
    dx=None,
    dz=None,
    dw=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated RMSNorm backward: dx and dz in one pass (the gate and the normalized input recomputed
    from x, z, w and the forward's rstd), dw as a fixed-order FP32 sum of per-program partial rows.
    Bitwise reproducible; a row's dx and dz do not depend on the other rows.

    Parameters
    ----------
    g : torch.Tensor
        Gradient of y, x's dtype, shape and device.
    x, z, w, group_size, norm_before_gate, weight_offset, activation
        As given to ``gated_rmsnorm_forward``.
    rstd : torch.Tensor
        The forward's rstd: FP32 of shape ``rstd_shape(x, group_size)``.
    dx, dz, dw : torch.Tensor, optional
        Caller-owned outputs (contiguous, vector aligned; dw [H] in FP32 or w's dtype, the FP32 sum
        rounded once into it).

    Returns
    -------
    (dx, dz, dw)
        dx and dz like x (contiguous), dw [H] (FP32 unless a dw of w's dtype is given).

    Raises
    ------
    TypeError, ValueError
        As ``gated_rmsnorm_forward``, and g or rstd of the wrong dtype, shape or device.
    """
    call = gated_call(x, z, w, None, group_size, norm_before_gate, weight_offset, activation)
    v.check_like("g", g, x)
    v.check_output("rstd", rstd, rstd_shape(x, call.group_size), torch.float32, x.device)
    check_gradient_outputs(call, ("dx", dx), ("dz", dz))
    if dw is not None:
        v.check_tensor("dw", dw, dtypes=(torch.float32, w.dtype), device=x.device)
        _check_output("dw", dw, (x.shape[-1],), dw.dtype, x.device, 1)
    spec = forward_spec(call)
    hidden = x.shape[-1]
    dx, dz, dw = _output(dx, x), _output(dz, x), _output(dw, x, (hidden,), torch.float32)
    if x.numel() == 0:
        return dx, dz, dw.zero_()
    programs = backward_programs_of(call, spec)
    with on_device(x.device):
        launch_backward(call, spec, g, rstd, dx, dz, dw, programs)
    return dx, dz, dw


def check_gradient_outputs(call: GatedCall, *named) -> None:
    """Caller-owned gradients of x and z, as (name, tensor or None) pairs: x's shape, dtype and device,
    contiguous and vector aligned (the backward writes them directly)."""
    x = call.x
    vec = vector_width(call.group_size, x.element_size())
    for name, given in named:
        if given is not None:
            _check_output(name, given, x.shape, x.dtype, x.device, vec)


def backward_programs_of(call: GatedCall, spec: GatedSpec) -> int:
    """``backward_programs`` of a call ``gated_call`` accepted, whose device ``forward_spec`` checked."""
    x, group_size = call.x, call.group_size
    hidden = x.shape[-1]
    config = gated_backward_config(spec.arch, spec.act_dtype, hidden, group_size)
    return backward_programs(x.numel() // hidden, config, hidden // group_size, device_facts(x.device))


def launch_backward(
    call: GatedCall,
    spec: GatedSpec,
    g,
    rstd,
    dx,
    dz,
    dw,
    programs: int,
    partial_space=None,
    counter_space=None,
    dw_wanted: bool = True,
) -> None:
    """The backward of rows > 0 into dx, dz (caller-owned or fresh, contiguous) and dw (contiguous [H],
    FP32 or a 2-byte dtype: the fixed-order FP32 sum of the partial rows rounded once) with the
    forward's ``rstd`` over ``programs`` programs (``backward_programs_of``): the backward kernel, and
    the reduction behind it unless the kernel sums dW in its own launch (``GatedConfig.dw_in_launch``),
    which writes dw whether ``dw_wanted`` or not (without it no reduction is launched).
    The FP32 partial rows are carved from the start of the uint8 ``partial_space`` when given (which
    must hold ``launch_plan.partial_rows_bytes`` of them); the grid barrier's counter is the last slot
    of the caller's uint8 ``counter_space`` (a zeroed workspace), else one per stream
    (``views.barrier_counter``). The launches run on the current device: callers enter ``on_device``
    once around a call's launches."""
    x, group_size = call.x, call.group_size
    hidden = x.shape[-1]
    rows, groups = x.numel() // hidden, hidden // group_size
    vec = vector_width(group_size, x.element_size())
    partials = partial_rows_view(partial_space, programs, hidden, x.device)
    in_launch = gated_backward_config(spec.arch, spec.act_dtype, hidden, group_size).dw_in_launch
    finish = (dw, barrier_counter(counter_space, x.device)) if in_launch else ()
    backward = replace(spec, kind="gated_bwd", dw_dtype=dtype_name(dw.dtype) if in_launch else "")
    get_kernel(backward)(
        kernel_view(g, vec),
        kernel_view(x, vec),
        kernel_view(call.z, vec),
        aligned_vector(call.w, vec),
        rstd.reshape(rows, groups).contiguous(),
        rows_view(dx, hidden),
        rows_view(dz, hidden),
        partials,
        *finish,
        programs,
    )
    if dw_wanted and not in_launch:
        get_kernel(ReduceSpec(spec.arch, dtype_name(dw.dtype), hidden))(partials, dw)


def launch_statistics(call: GatedCall, spec: GatedSpec, rstd: torch.Tensor) -> None:
    """rstd (FP32, contiguous, ``rstd_shape``) of rows > 0 as the forward computes it, bitwise: for a
    backward whose caller kept none. The kernel reads no weight, so its variant names x's dtype for
    w's and no offset; z is read only in the gate-then-norm form."""
    x, group_size = call.x, call.group_size
    hidden = spec.hidden
    vec = vector_width(group_size, x.element_size())
    rows = x.numel() // hidden
    statistics = replace(spec, kind="gated_rstd", w_dtype=spec.act_dtype, weight_offset=0.0)
    get_kernel(statistics)(
        kernel_view(x, vec), kernel_view(call.z, vec), rstd.view(rows, hidden // group_size), call.eps
    )


def most_backward_programs(rows: int, hidden: int, group_size: int, facts: DeviceFacts) -> int:
    """The most programs (partial rows of dW) a gated backward of up to ``rows`` rows runs on this GPU,
    whatever the activation dtype."""
    return max(
        backward_programs(
            rows, gated_backward_config(facts.arch, act, hidden, group_size), hidden // group_size, facts
        )
        for act in DTYPE_NAMES
    )
