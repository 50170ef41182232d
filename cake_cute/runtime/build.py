"""From a kernel spec to a compiled function (works without a GPU), and the registry of kernel kinds.

A kind is one ``KernelKind`` entry in ``KINDS``: its config constructor, its kernel object, and the
arguments it is compiled against (fake tensors with a symbolic number of rows and the strides and
alignment the launch guarantees). Adding a kernel means adding one entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..kernels.config import backward_config, finish_team, forward_config, reduce_config
from ..kernels.gated_config import gated_backward_config, gated_forward_config
from ..kernels.quant_config import QUANT_RECIPES, quant_forward_config
from ..kernels.tiling import VECTOR_BYTES
from ..vocab import cutlass_dtype
from .launch_plan import partial_row_stride
from .specs import GatedSpec, KernelSpec, ReduceSpec
from .views import vector_align_bytes


@dataclass(frozen=True)
class KernelKind:
    config: Callable[[Any], Any]  # spec -> its config value
    kernel: Callable[[Any, Any], Any]  # (spec, config) -> the kernel object or jit method cute.compile traces
    arguments: Callable[[Any, Any], tuple]  # (spec, config) -> its arguments, before the stream


def _rows_tensor(dtype, rows, hidden: int, vec: int):
    """A (rows, H) activation with a runtime row stride that is a multiple of the vector width."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(
        dtype,
        (rows, hidden),
        stride=(cute.sym_int64(divisibility=vec), 1),
        assumed_align=vec * dtype.width // 8,
    )


def _vector(dtype, length, align_elems: int):
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(
        dtype, (length,), stride=(1,), assumed_align=vector_align_bytes(align_elems, dtype.width // 8)
    )


def _partials(hidden: int):
    """The (P, H) FP32 partial rows with their padded row stride; P is a runtime value."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int(), hidden),
        stride=(partial_row_stride(hidden), 1),
        assumed_align=VECTOR_BYTES,
    )


def _forward_arguments(spec: KernelSpec, config) -> tuple:
    import cutlass
    import cutlass.cute as cute

    act, H, vec, rows = cutlass_dtype(spec.act_dtype), spec.hidden, config.tiling.vec, cute.sym_int()
    w = _vector(cutlass_dtype(spec.w_dtype), H, vec)
    rstd = _vector(cutlass.Float32, rows, 1)
    x, y = (_rows_tensor(act, rows, H, vec) for _ in range(2))
    res, h_out = (_rows_tensor(act, rows, H, vec) for _ in range(2)) if spec.residual else (None, None)
    return x, res, w, y, h_out, rstd, cutlass.Float32(1e-6)


def _backward_arguments(spec: KernelSpec, config) -> tuple:
    """g, h, w, rstd, g_residual, dx, the partial rows, [dw, counter,] the programs, g's other parts."""
    import cutlass
    import cutlass.cute as cute

    act, H, vec, rows = cutlass_dtype(spec.act_dtype), spec.hidden, config.tiling.vec, cute.sym_int()
    w = _vector(cutlass_dtype(spec.w_dtype), H, vec)
    rstd = _vector(cutlass.Float32, rows, 1)
    g, h, dx = (_rows_tensor(act, rows, H, vec) for _ in range(3))
    g_res = _rows_tensor(act, rows, H, vec) if spec.residual else None
    g_parts = (_rows_tensor(act, rows, H, vec) for _ in range(spec.g_parts - 1))
    return g, h, w, rstd, g_res, dx, _partials(H), *_finish_arguments(spec), cutlass.Int32(1), *g_parts


def _finish_arguments(spec) -> tuple:
    """dw and the grid barrier's Int32 counter of a backward that finishes dW in its launch, else ()."""
    import cutlass

    if not spec.dw_dtype:
        return ()
    return _vector(cutlass_dtype(spec.dw_dtype), spec.hidden, 1), _vector(cutlass.Int32, 1, 1)


def _finish(spec, threads: int):
    """The ``ColumnSum`` of a backward that finishes dW in its launch, else None."""
    from ..kernels.dw_reduce import ColumnSum

    if not spec.dw_dtype:
        return None
    reduce = reduce_config(spec.arch, spec.dw_dtype, spec.hidden)
    return ColumnSum(reduce, finish_team(reduce, threads), cutlass_dtype(spec.dw_dtype))


def _reduce_arguments(spec: ReduceSpec, config) -> tuple:
    return _partials(spec.hidden), _vector(cutlass_dtype(spec.out_dtype), spec.hidden, 1)


def _quant_arguments(spec: KernelSpec, config, emit_y: bool) -> tuple:
    """The forward's arguments, the e4m3 bytes and scales before eps, the programs after it (persistent)."""
    import cutlass
    import cutlass.cute as cute

    x, res, w, y, h_out, rstd, eps = _forward_arguments(spec, config)
    rows, blocks = x.shape[0], -(-spec.hidden // config.block)
    q = _rows_tensor(cutlass.Uint8, rows, spec.hidden, config.tiling.vec)
    scale_dtype = cutlass.Float32 if config.fp32_scales else cutlass.Uint8
    scales = cute.runtime.make_fake_tensor(scale_dtype, (rows, blocks), stride=(blocks, 1), assumed_align=4)
    programs = (cutlass.Int32(1),) if config.programs_per_sm else ()
    return x, res, w, y if emit_y else None, h_out, rstd, q, scales, eps, *programs


def _quant_kernel(spec: KernelSpec, config, emit_y: bool):
    from ..kernels.rmsnorm_fwd_quant import RMSNormForwardQuant
    from ..kernels.rmsnorm_fwd_quant_persistent import RMSNormForwardQuantPersistent

    kernel_class = RMSNormForwardQuantPersistent if config.programs_per_sm else RMSNormForwardQuant
    dtypes = cutlass_dtype(spec.act_dtype), cutlass_dtype(spec.w_dtype)
    return kernel_class(config, *dtypes, spec.residual, spec.weight_offset, emit_y)


def quant_kind(recipe: str, emit_y: bool, persistent: bool = False) -> str:
    """The kind of the forward to block-scaled FP8 with ``recipe``, ``emit_y`` and ``persistent``."""
    return f"fwd_{recipe}" + ("_y" if emit_y else "") + ("_persistent" if persistent else "")


def _quant_entry(recipe: str, emit_y: bool, persistent: bool) -> KernelKind:
    return KernelKind(
        lambda s: quant_forward_config(s.arch, s.act_dtype, s.hidden, recipe, persistent),
        partial(_quant_kernel, emit_y=emit_y),
        partial(_quant_arguments, emit_y=emit_y),
    )


def _forward_kernel(spec: KernelSpec, config):
    from ..kernels.rmsnorm_fwd import RMSNormForward

    dtypes = cutlass_dtype(spec.act_dtype), cutlass_dtype(spec.w_dtype)
    return RMSNormForward(config, *dtypes, spec.residual, spec.weight_offset)


def _backward_kernel(spec: KernelSpec, config):
    from ..kernels.rmsnorm_bwd import RMSNormBackward

    dtypes = cutlass_dtype(spec.act_dtype), cutlass_dtype(spec.w_dtype)
    finish = _finish(spec, config.tiling.threads_per_cta)
    backward = RMSNormBackward(
        config, *dtypes, spec.residual, spec.weight_offset, spec.g_parts, spec.memory_efficient, finish
    )
    return backward.entry_point()


def _reduce_kernel(spec: ReduceSpec, config):
    from ..kernels.dw_reduce import DWReduce

    return DWReduce(config, cutlass_dtype(spec.out_dtype))


def _gated_kernel(spec: GatedSpec, config):
    from ..kernels.gated_bwd import GatedRMSNormBackward
    from ..kernels.gated_fwd import GatedRMSNormForward, GatedRMSNormStatistics

    kernel_class = {
        "gated_fwd": GatedRMSNormForward,
        "gated_rstd": GatedRMSNormStatistics,
        "gated_bwd": GatedRMSNormBackward,
    }[spec.kind]
    dtypes = cutlass_dtype(spec.act_dtype), cutlass_dtype(spec.w_dtype)
    form = (spec.weight_offset, spec.hidden // spec.group_size, spec.norm_before_gate, spec.activation)
    if spec.kind != "gated_bwd":
        return kernel_class(config, *dtypes, *form)
    finish = _finish(spec, config.tiling.threads_per_cta)
    return kernel_class(config, *dtypes, *form, finish).entry_point()


def _gated_rstd(rows, groups: int):
    """rstd of the gated kernels: FP32 (T, H / group_size), one per row and group, contiguous."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass.Float32, (rows, groups), stride=(groups, 1), assumed_align=4)


def _gated_arguments(spec: GatedSpec, config) -> tuple:
    """The gated kernels' arguments: forward, statistics (no w, y) or backward (with the partial rows)."""
    import cutlass
    import cutlass.cute as cute

    act, H, vec, rows = cutlass_dtype(spec.act_dtype), spec.hidden, config.tiling.vec, cute.sym_int()
    w = _vector(cutlass_dtype(spec.w_dtype), H, vec)
    rstd = _gated_rstd(rows, H // spec.group_size)
    if spec.kind == "gated_fwd":
        x, z, y = (_rows_tensor(act, rows, H, vec) for _ in range(3))
        return x, z, w, y, rstd, cutlass.Float32(1e-6)
    if spec.kind == "gated_rstd":
        x, z = (_rows_tensor(act, rows, H, vec) for _ in range(2))
        return x, z, rstd, cutlass.Float32(1e-6)
    g, x, z, dx, dz = (_rows_tensor(act, rows, H, vec) for _ in range(5))
    return g, x, z, w, rstd, dx, dz, _partials(H), *_finish_arguments(spec), cutlass.Int32(1)


KINDS: dict[str, KernelKind] = {
    "fwd": KernelKind(
        lambda s: forward_config(s.arch, s.act_dtype, s.hidden),
        _forward_kernel,
        _forward_arguments,
    ),
    "bwd": KernelKind(
        lambda s: backward_config(
            s.arch, s.act_dtype, s.w_dtype, s.hidden, s.residual, s.g_parts, s.memory_efficient
        ),
        _backward_kernel,
        _backward_arguments,
    ),
    "gated_fwd": KernelKind(
        lambda s: gated_forward_config(s.act_dtype, s.hidden, s.group_size),
        _gated_kernel,
        _gated_arguments,
    ),
    "gated_rstd": KernelKind(
        lambda s: gated_forward_config(s.act_dtype, s.hidden, s.group_size),
        _gated_kernel,
        _gated_arguments,
    ),
    "gated_bwd": KernelKind(
        lambda s: gated_backward_config(s.arch, s.act_dtype, s.hidden, s.group_size),
        _gated_kernel,
        _gated_arguments,
    ),
    "dw": KernelKind(
        lambda s: reduce_config(s.arch, s.out_dtype, s.hidden), _reduce_kernel, _reduce_arguments
    ),
    **{
        quant_kind(r, y, p): _quant_entry(r, y, p)
        for r in QUANT_RECIPES
        for y in (False, True)
        for p in (False, True)
    },
}


def config_for(spec):
    """The config value ``spec``'s kernel is compiled with (part of the compile-cache key)."""
    return KINDS[spec.kind].config(spec)


def compile_kernel(spec):
    import cutlass.cute as cute

    kind = KINDS[spec.kind]
    config = kind.config(spec)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kind.kernel(spec, config),
        *kind.arguments(spec, config),
        stream,
        options=f"--enable-tvm-ffi --gpu-arch {spec.arch}",
    )
