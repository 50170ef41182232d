"""Functional entry points of the gated RMSNorm kernels: the views the kernels read, and the launches.
Leading dimensions of x collapse into rows; strided rows with a contiguous, aligned last dimension are
read in place, others copied once.
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
    """A caller-owned output: the expected shape, dtype and device, contiguous and vector aligned."""
    v.check_output(name, t, shape, dtype, device)
    if not is_direct_output(t, vec):
        raise ValueError(f"{name} must be contiguous with a {vec * t.element_size()}-byte aligned base")


def _output(given, like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    return new_output(like, shape, dtype) if given is None else given


def forward_spec(call: GatedCall) -> GatedSpec:
    """The forward kernel's spec of a call (the others replace its kind); checks the device."""
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
    ``y = rmsnorm_group(x * act(z)) * (w + offset)`` (gate then norm), FP32 math, one rounding.

    x and z are [..., H] of one dtype (bf16, fp16, fp32), shape and device, w [H] in x's dtype or fp32;
    ``group_size`` divides H (default H); ``activation`` is ``"silu"`` or ``"sigmoid"``; ``out`` and
    ``rstd`` are optional caller-owned outputs. Returns ``(y, rstd)``, rstd FP32 shaped
    ``rstd_shape(x, group_size)``. Raises TypeError / ValueError naming the argument, before any launch."""
    call = gated_call(x, z, w, eps, group_size, norm_before_gate, weight_offset, activation)
    return forward_of_call(call, out, rstd)


def forward_of_call(call: GatedCall, out=None, rstd=None):
    """``gated_rmsnorm_forward`` of a checked call: the caller-owned outputs checked, then the launch."""
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
    """Programs (along x) of the persistent gated backward: as many as are resident, at most one per row
    tile; dw's bits depend only on T, the GPU model and the variant."""
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
    """Gated RMSNorm backward: dx and dz in one pass (gate and normalized input recomputed from x, z, w
    and the forward's rstd), dw a fixed-order FP32 sum of per-program partial rows; bitwise
    reproducible.

    Takes g (like x), the forward's arguments and rstd, and optional caller-owned dx, dz and dw (dw [H]
    in FP32 or w's dtype). Returns ``(dx, dz, dw)``, dw FP32 unless given in w's dtype. Raises as
    ``gated_rmsnorm_forward``, and for g or rstd of the wrong dtype, shape or device."""
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
    """Caller-owned gradients of x and z, as (name, tensor or None) pairs: like x, contiguous, aligned."""
    x = call.x
    vec = vector_width(call.group_size, x.element_size())
    for name, given in named:
        if given is not None:
            _check_output(name, given, x.shape, x.dtype, x.device, vec)


def backward_programs_of(call: GatedCall, spec: GatedSpec) -> int:
    """``backward_programs`` of a checked call."""
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
    """Launch the backward of rows > 0 over ``programs`` programs: the backward kernel, and the reduction
    behind it unless the kernel sums dW in its own launch (which writes dw whether ``dw_wanted`` or not).
    The partial rows are carved from ``partial_space`` when given; the grid barrier's counter is the
    last slot of ``counter_space`` (a zeroed workspace), else one per stream. Runs on the current
    device."""
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
    """rstd of rows > 0, bitwise the forward's, for a backward whose caller kept none."""
    x, group_size = call.x, call.group_size
    hidden = spec.hidden
    vec = vector_width(group_size, x.element_size())
    rows = x.numel() // hidden
    statistics = replace(spec, kind="gated_rstd", w_dtype=spec.act_dtype, weight_offset=0.0)
    get_kernel(statistics)(
        kernel_view(x, vec), kernel_view(call.z, vec), rstd.view(rows, hidden // group_size), call.eps
    )


def most_backward_programs(rows: int, hidden: int, group_size: int, facts: DeviceFacts) -> int:
    """The most programs a gated backward of up to ``rows`` rows runs on this GPU, for any dtype."""
    return max(
        backward_programs(
            rows, gated_backward_config(facts.arch, act, hidden, group_size), hidden // group_size, facts
        )
        for act in DTYPE_NAMES
    )
