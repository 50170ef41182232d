"""Launch planning: how many programs a backward of T rows runs, how many FP32 partial rows of dW it
writes and whether it sums them in its own launch, whether a forward to FP8 of T rows runs persistent
programs, and the vector width every kernel of an H assumes.

Configs depend on (arch, dtypes, H) only; T decides just the number of programs, which never changes
a row's arithmetic. A backward of g in parts launches the one-g program count, so its dw is bitwise
the one-g dw of the summands' rounded sum, and needs the same workspace.
"""

from __future__ import annotations

from functools import cache, lru_cache

from ..kernels.config import backward_config, on_override_change
from ..kernels.quant_config import persistent_programs_per_sm, quant_forward_config
from ..kernels.tiling import VECTOR_BYTES, vector_width
from ..vocab import dtype_bytes
from .device import DeviceFacts, resident_clusters


def partial_row_stride(hidden: int) -> int:
    """FP32 partial rows are padded to whole vector accesses, so every row starts aligned."""
    columns = VECTOR_BYTES // 4
    return -(-hidden // columns) * columns


# A workspace ends with the grid barrier's Int32 counter of a backward that sums dW in its own launch
# (``kernels.dw_finish``), in a slot of 16 bytes (whatever precedes it stays aligned).
COUNTER_BYTES = 16


def partial_rows_bytes(partial_rows: int, hidden: int) -> int:
    return partial_rows * partial_row_stride(hidden) * 4


def workspace_bytes(partial_rows: int, hidden: int) -> int:
    """Bytes a backward's workspace holds: its partial rows, then the counter slot."""
    return partial_rows_bytes(partial_rows, hidden) + COUNTER_BYTES


def resident_programs(config, device: DeviceFacts) -> int:
    """Programs (clusters) of a backward ``config`` resident on ``device`` at once."""
    tiling = config.tiling
    return resident_clusters(
        device.index,
        device.capability,
        tiling.threads_per_cta,
        tiling.cluster_n,
        config.ctas_per_sm,
        device.sm_count,
    )


# From this many row tiles on, when all of them fit on the GPU at once, programs take two tiles each:
# that halves the partial rows dw_reduce reads, which outweighs one more row of latency per program
# at large T but not at small T (measured at the training shapes).
PAIR_TILES_FROM = 64


@lru_cache(maxsize=4096)
def backward_programs(
    rows: int,
    hidden: int,
    act_dtype: str,
    w_dtype: str,
    residual: bool,
    device: DeviceFacts,
) -> int:
    """Programs (clusters) of the persistent backward: as many as are resident, at most one per row tile
    (two tiles each from ``PAIR_TILES_FROM`` tiles up to a full GPU). The partition of rows, and so dw's
    bits, depends only on T, the GPU model and the variant; a backward of g in summands launches the
    one-g count."""
    config = backward_config(device.arch, act_dtype, w_dtype, hidden, residual)
    tiles = -(-rows // config.tiling.rows_per_cta)
    if tiles <= 1:
        return 1
    resident = resident_programs(config, device)
    if PAIR_TILES_FROM <= tiles <= resident:
        return -(-tiles // 2)
    return min(tiles, resident)


def most_partial_rows(
    rows: int, hidden: int, act_dtype: str, w_dtype: str, residual: bool, device: DeviceFacts
) -> int:
    """The most partial rows any backward of up to ``rows`` rows writes: the largest program count, at
    ``rows`` or just below ``PAIR_TILES_FROM`` tiles."""
    rows_per_cta = backward_config(device.arch, act_dtype, w_dtype, hidden, residual).tiling.rows_per_cta
    below_pairing = (PAIR_TILES_FROM - 1) * rows_per_cta
    return max(
        backward_programs(r, hidden, act_dtype, w_dtype, residual, device)
        for r in {max(rows, 1), max(min(rows, below_pairing), 1)}
    )


def finishes_dw_in_launch(
    rows: int,
    hidden: int,
    act_dtype: str,
    w_dtype: str,
    residual: bool,
    g_parts: int,
    device: DeviceFacts,
) -> bool:
    """Whether its config sums dW in the launch and every program is resident, as the grid barrier needs."""
    config = backward_config(device.arch, act_dtype, w_dtype, hidden, residual, g_parts)
    if not config.dw_in_launch:
        return False
    if g_parts == 1:
        return True
    return backward_programs(rows, hidden, act_dtype, w_dtype, residual, device) <= resident_programs(
        config, device
    )


# Up to this many bytes of x per call the forward to FP8 runs persistent programs (2^26 2-byte or 2^25
# FP32 elements); above it the one-tile grid, which keeps more bytes in flight, measured faster.
PERSISTENT_FP8_MAX_BYTES = 1 << 27


@lru_cache(maxsize=4096)
def fp8_persistent_programs(hidden: int, act_dtype: str, residual: bool, device: DeviceFacts) -> int:
    """The most programs of the persistent forward to FP8 on this GPU, 0 where it does not apply."""
    if not has_persistent_fp8_kernel(device.arch, act_dtype, hidden, residual):
        return 0
    per_sm = quant_forward_config(device.arch, act_dtype, hidden, "mxfp8", persistent=True).programs_per_sm
    return per_sm * device.sm_count


def has_persistent_fp8_kernel(arch: str, act_dtype: str, hidden: int, residual: bool) -> bool:
    """Whether forwards to FP8 of this variant run persistent programs at some T."""
    tiling = quant_forward_config(arch, act_dtype, hidden, "mxfp8").tiling
    return not residual and persistent_programs_per_sm(tiling, act_dtype) > 0


def fp8_persistent_rows(hidden: int, act_dtype: str) -> int:
    """The most rows of H = ``hidden`` in ``act_dtype`` a forward to FP8 runs with persistent programs."""
    return PERSISTENT_FP8_MAX_BYTES // (hidden * dtype_bytes(act_dtype))


def fp8_forward_rule(hidden: int, act_dtype: str, residual: bool, device: DeviceFacts) -> tuple[int, int]:
    """The FP8 forward's launch rule ``(most persistent rows, programs)``, which the native path applies
    too."""
    return fp8_persistent_rows(hidden, act_dtype), fp8_persistent_programs(
        hidden, act_dtype, residual, device
    )


def fp8_forward_programs(rows: int, hidden: int, act_dtype: str, residual: bool, device: DeviceFacts) -> int:
    """Programs of a forward to FP8 of ``rows`` rows (0: one CTA per row tile); both kernels compute a row
    alike."""
    most_rows, programs = fp8_forward_rule(hidden, act_dtype, residual, device)
    return programs if rows <= most_rows else 0


@cache
def vector_elems(hidden: int, act_dtype: str) -> int:
    """Elements per vector access for this H, the alignment every kernel (and override) assumes."""
    return vector_width(hidden, dtype_bytes(act_dtype))


@on_override_change
def _clear_launch_plans() -> None:
    backward_programs.cache_clear()
    fp8_persistent_programs.cache_clear()
