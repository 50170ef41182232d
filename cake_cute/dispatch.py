"""The one place that turns (arch, dtypes, H, T) into a kernel configuration, a compile and a launch plan.

Tiling depends on (arch, dtypes, H) only (``kernels.config``); T decides just the number of backward
programs, which never changes a row's arithmetic.
"""

from __future__ import annotations

from functools import cache, lru_cache

from .compile_cache import KernelSpec
from .kernels.config import (
    QUANT_RECIPES,
    backward_ctas_per_sm,
    backward_min_ctas_per_sm,
    backward_stages,
    backward_tiling,
    forward_min_ctas_per_sm,
    forward_tiling,
    quant_tiling,
)
from .occupancy import resident_clusters
from .validation import DeviceFacts, vector_align_bytes

DTYPE_NAMES = ("bf16", "fp16", "fp32")


def _cutlass_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}[name]


def partial_row_stride(hidden: int) -> int:
    """FP32 partial rows are padded to 4 columns so every row starts 16-byte aligned."""
    return -(-hidden // 4) * 4


def partial_rows_bytes(partial_rows: int, hidden: int) -> int:
    """Bytes of ``partial_rows`` padded FP32 partial rows (what a workspace must hold for them)."""
    return partial_rows * partial_row_stride(hidden) * 4


# From this many row tiles on, when all of them fit on the GPU at once, programs take two tiles each:
# that halves the partial rows dw_reduce reads, which outweighs one more row of latency per program
# (H200, H = 4096, T = 256: 7.2 -> 6.3 µs; at T = 16 pairing loses, 4.3 -> 5.1 µs; measured in
# perf/results/2026-11-30-h200-atomic-dw-experiment/tune_programs-c420c68.log).
PAIR_TILES_FROM = 64


@lru_cache(maxsize=4096)
def backward_programs(
    rows: int, hidden: int, act_dtype: str, w_dtype: str, residual: bool, device: DeviceFacts
) -> int:
    """Programs (clusters) of the persistent backward: as many as are resident at once, never more
    than there are row tiles (two tiles each from ``PAIR_TILES_FROM`` tiles up to a full GPU). The
    partition of rows -- and so dw's bits -- is fixed by this number, which depends only on T, the GPU
    model and the variant (dtypes, H, mode)."""
    tiling = backward_tiling(hidden, act_dtype)
    tiles = -(-rows // tiling.rows_per_cta)
    if tiles <= 1:
        return 1
    resident = resident_clusters(
        device.index,
        device.capability,
        tiling.threads_per_cta,
        tiling.cluster_n,
        backward_ctas_per_sm(tiling, device.arch, act_dtype, w_dtype, residual),
        device.sm_count,
    )
    if PAIR_TILES_FROM <= tiles <= resident:
        return -(-tiles // 2)
    return min(tiles, resident)


@lru_cache(maxsize=4096)
def backward_launch(
    rows: int, hidden: int, act_dtype: str, w_dtype: str, residual: bool, device: DeviceFacts
) -> tuple[int, int]:
    """(programs, FP32 partial rows of dW the backward writes: one per row group of each program)."""
    programs = backward_programs(rows, hidden, act_dtype, w_dtype, residual, device)
    return programs, programs * backward_tiling(hidden, act_dtype).rows_per_cta


def most_partial_rows(
    rows: int, hidden: int, act_dtype: str, w_dtype: str, residual: bool, device: DeviceFacts
) -> int:
    """The most partial rows any backward of up to ``rows`` rows writes (what a workspace for ``rows``
    must hold): the program count grows with T except where pairing starts, so the largest count is
    at ``rows`` or just below ``PAIR_TILES_FROM`` tiles."""
    below_pairing = (PAIR_TILES_FROM - 1) * backward_tiling(hidden, act_dtype).rows_per_cta
    return max(
        backward_launch(r, hidden, act_dtype, w_dtype, residual, device)[1]
        for r in {max(rows, 1), max(min(rows, below_pairing), 1)}
    )


def quant_kind(recipe: str, emit_y: bool) -> str:
    """The kernel kind of the quantizing forward for ``recipe`` (with the act-dtype y when ``emit_y``)."""
    return f"fwd_{recipe}" + ("_y" if emit_y else "")


# kind -> (recipe, emit_y) of every quantizing forward.
QUANT_KINDS = {quant_kind(r, y): (r, y) for r in QUANT_RECIPES for y in (False, True)}


def tiling_for(spec: KernelSpec):
    if spec.kind in QUANT_KINDS:
        return quant_tiling(spec.hidden, spec.act_dtype, QUANT_RECIPES[QUANT_KINDS[spec.kind][0]][0])
    if spec.kind == "fwd":
        return forward_tiling(spec.hidden, spec.act_dtype)
    if spec.kind == "bwd":
        return backward_tiling(spec.hidden, spec.act_dtype)
    return None


def _fake_rows_tensor(cute, dtype, rows, hidden: int, vec: int):
    """A (rows, H) activation with a runtime row stride that is a multiple of the vector width."""
    return cute.runtime.make_fake_tensor(
        dtype,
        (rows, hidden),
        stride=(cute.sym_int64(divisibility=vec), 1),
        assumed_align=vec * dtype.width // 8,
    )


def _fake_vector(cute, dtype, length, align_elems: int):
    return cute.runtime.make_fake_tensor(
        dtype, (length,), stride=(1,), assumed_align=vector_align_bytes(align_elems, dtype.width // 8)
    )


def _fake_partials(cute, f32, hidden: int):
    """The (P, H) FP32 partial rows with their padded row stride; P is a runtime value."""
    return cute.runtime.make_fake_tensor(
        f32, (cute.sym_int(), hidden), stride=(partial_row_stride(hidden), 1), assumed_align=16
    )


def compile_kernel(spec: KernelSpec):
    """Trace and compile one variant for ``spec.arch`` (works without a GPU)."""
    import cutlass
    import cutlass.cute as cute

    from .kernels.dw_reduce import DWReduce
    from .kernels.rmsnorm_bwd import RMSNormBackward
    from .kernels.rmsnorm_fwd import RMSNormForward

    act = _cutlass_dtype(spec.act_dtype)
    wdt = _cutlass_dtype(spec.w_dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {spec.arch}"
    H = spec.hidden
    rows = cute.sym_int()
    if spec.kind == "dw":
        partials = _fake_partials(cute, cutlass.Float32, H)
        dw = _fake_vector(cute, act, H, 1)
        return cute.compile(DWReduce(H, act), partials, dw, stream, options=options)

    tiling = tiling_for(spec)
    vec = tiling.vec
    w = _fake_vector(cute, wdt, H, vec)
    rstd = _fake_vector(cute, cutlass.Float32, rows, 1)
    if spec.kind in QUANT_KINDS:
        return _compile_quant(cute, cutlass, spec, tiling, act, wdt, w, rstd, rows, stream, options)
    if spec.kind == "fwd":
        x, y = (_fake_rows_tensor(cute, act, rows, H, vec) for _ in range(2))
        res, h_out = (
            (_fake_rows_tensor(cute, act, rows, H, vec) for _ in range(2)) if spec.residual else (None, None)
        )
        min_ctas = forward_min_ctas_per_sm(tiling, spec.arch)
        kernel = RMSNormForward(tiling, act, wdt, spec.residual, spec.weight_offset, min_ctas)
        return cute.compile(kernel, x, res, w, y, h_out, rstd, cutlass.Float32(1e-6), stream, options=options)

    g, h, dx = (_fake_rows_tensor(cute, act, rows, H, vec) for _ in range(3))
    g_res = _fake_rows_tensor(cute, act, rows, H, vec) if spec.residual else None
    min_ctas = backward_min_ctas_per_sm(tiling, spec.arch)
    partials = _fake_partials(cute, cutlass.Float32, H)
    stages = backward_stages(tiling, spec.act_dtype, spec.residual)
    kernel = RMSNormBackward(tiling, act, wdt, spec.residual, spec.weight_offset, min_ctas, stages)
    return cute.compile(kernel, g, h, w, rstd, g_res, dx, partials, cutlass.Int32(1), stream, options=options)


def _compile_quant(cute, cutlass, spec, tiling, act, wdt, w, rstd, rows, stream, options):
    """The quantizing forward: e4m3 bytes like x, scales (T, ceil(H / block)) E8M0 bytes or FP32."""
    from .kernels.rmsnorm_fwd_quant import RMSNormForwardQuant

    recipe, emit_y = QUANT_KINDS[spec.kind]
    block, fp32_scales = QUANT_RECIPES[recipe]
    H, vec = spec.hidden, tiling.vec
    x = _fake_rows_tensor(cute, act, rows, H, vec)
    y = _fake_rows_tensor(cute, act, rows, H, vec) if emit_y else None
    res, h_out = (
        (_fake_rows_tensor(cute, act, rows, H, vec) for _ in range(2)) if spec.residual else (None, None)
    )
    q = _fake_rows_tensor(cute, cutlass.Uint8, rows, H, vec)
    blocks = -(-H // block)
    scale_dtype = cutlass.Float32 if fp32_scales else cutlass.Uint8
    scales = cute.runtime.make_fake_tensor(scale_dtype, (rows, blocks), stride=(blocks, 1), assumed_align=4)
    kernel = RMSNormForwardQuant(
        tiling,
        act,
        wdt,
        spec.residual,
        spec.weight_offset,
        forward_min_ctas_per_sm(tiling, spec.arch),
        block,
        fp32_scales,
        emit_y,
    )
    eps = cutlass.Float32(1e-6)
    return cute.compile(kernel, x, res, w, y, h_out, rstd, q, scales, eps, stream, options=options)


@cache
def vector_elems(hidden: int, act_dtype: str) -> int:
    """Elements per vector access for this H (the alignment, in elements, the kernels assume)."""
    return forward_tiling(hidden, act_dtype).vec
