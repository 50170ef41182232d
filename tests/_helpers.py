"""Helpers shared by the correctness tests (imported as ``from ._helpers import ...``).

Nothing here touches CUDA at import time, so every test module collects on a machine without a GPU.
Test modules also import ``fixed_seed`` (an autouse fixture) so each test starts from its own fixed
seed even if conftest.py changes.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
EPS = 1e-6
DEFAULT_DEVICE = "cuda"  # where poison() / rand_weight() allocate unless told otherwise


def dtype_id(dtype) -> str:
    return DTYPE_IDS[dtype]


@pytest.fixture(autouse=True)
def fixed_seed(request):
    """Every test starts from its own fixed seed (a CRC of its node id: stable across runs)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


def poison(shape, dtype, device=None) -> torch.Tensor:
    """A caller-owned output pre-filled with NaN (floats) or 0xFF bytes (integers): any element the
    kernel fails to write is visible afterwards."""
    device = DEFAULT_DEVICE if device is None else device
    if dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.full(tuple(shape), 0xFF if dtype == torch.uint8 else -1, dtype=dtype, device=device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an existing tensor (any layout) with NaN / 0xFF in place and return it."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(0xFF if t.dtype == torch.uint8 else -1)
    return t


def sentinel(shape, dtype, device="cpu", value=-7.0) -> torch.Tensor:
    """A caller-owned buffer with a finite, recognizable value (for 'left untouched' checks)."""
    if dtype.is_floating_point:
        return torch.full(tuple(shape), value, dtype=dtype, device=device)
    return torch.full(tuple(shape), 0xAB, dtype=dtype, device=device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (any layout) as a flat uint8 tensor: NaN payloads and -0 included."""
    c = t.detach().contiguous().reshape(-1)
    if c.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return c.view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a, e = bits(actual), bits(expected.to(actual.device))
    if not torch.equal(a, e):
        n_bad = int((a != e).sum().item())
        diff = (actual.detach().double() - expected.detach().to(actual.device).double()).abs()
        largest = diff.nan_to_num(nan=float("inf")).max().item()
        raise AssertionError(f"{what}: not bitwise equal ({n_bad} differing bytes, max |diff| {largest:g})")


def fixed_order_dw(partials: torch.Tensor, row_lanes: int) -> torch.Tensor:
    """dW from FP32 partial rows ``[P, H]`` in the kernels' fixed order (``kernels.dw_reduce``), by
    FP32 torch additions: R = ``row_lanes`` lane sums of rows l, l + R, ... from +0, then the binary
    tree of strides R/2, ..., 1. What ``dw_reduce`` and the finish in the backward's launch must write,
    bit for bit (before the rounding to dW's dtype)."""
    lanes = torch.zeros(row_lanes, partials.shape[1], dtype=torch.float32, device=partials.device)
    for first in range(0, partials.shape[0], row_lanes):
        block = partials[first : first + row_lanes].float()
        lanes[: block.shape[0]] = lanes[: block.shape[0]] + block
    stride = row_lanes
    while stride > 1:
        stride //= 2
        lanes[:stride] = lanes[:stride] + lanes[stride : 2 * stride]
    return lanes[0]


def rand_weight(hidden: int, dtype, device=None) -> torch.Tensor:
    """A weight around 1 (never zero in practice), in ``dtype``."""
    device = DEFAULT_DEVICE if device is None else device
    return (torch.randn(hidden, device=device) * 0.5 + 1.0).to(dtype)


def grad_rel_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """Relative-norm error of a gradient that is a difference of terms (dx = rstd*(a - xhat*c) [+ g_h]).

    The denominator is ``max(||expected||, ||scale|| / 4)`` where ``scale`` is the elementwise sum of
    the magnitudes of the terms. For well-conditioned data ||expected|| dominates and this is exactly
    ``reference.rel_error``; it only differs when the terms cancel (H = 1, where a - xhat*c is
    a*eps/(h^2+eps), or an unlucky row where a is almost parallel to xhat): FP32 cannot resolve such a
    difference better than ~1e-7 of the terms, so the error is measured against the terms instead."""
    a = actual.detach().double().reshape(-1)
    e = expected.detach().double().reshape(-1)
    if e.numel() == 0:
        return 0.0
    denom = max(e.norm().item(), scale.detach().double().norm().item() / 4)
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def sum_rel_error(actual: torch.Tensor, expected: torch.Tensor, abs_sum: torch.Tensor, terms: int) -> float:
    """Relative-norm error of a sum over ``terms`` rows (dw = sum_t g*xhat).

    The denominator is ``max(||expected||, ||abs_sum|| / sqrt(terms))``: for random-sign terms the two
    are about equal (so this is ``rel_error``), but when a short sum cancels (T = 2, H = 1) the FP32
    rounding of the terms is measured against their size, as it must be."""
    a = actual.detach().double().reshape(-1)
    e = expected.detach().double().reshape(-1)
    if e.numel() == 0:
        return 0.0
    denom = max(e.norm().item(), abs_sum.detach().double().norm().item() / math.sqrt(max(terms, 1)))
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def foreign_cuda_kernels(fn):
    """Run ``fn`` under the profiler and return the names of the CUDA kernels it launched that are
    not PyTorch's own (``at::`` kernels) nor memcpy/memset. Returns None when the profiler does not see
    a PyTorch kernel in a positive control (the caller should skip rather than pass vacuously)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def run(f):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            f()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    probe = torch.zeros(16, device="cuda")
    if not run(lambda: probe.add_(1)):
        return None
    names = run(fn)
    return [n for n in names if "at::" not in n and not n.lower().startswith(("memcpy", "memset"))]


def peak_extra_bytes(fn) -> int:
    """Bytes PyTorch's allocator holds at the peak of ``fn()`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
_MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14}


def warm_up_before_capture(step, iters: int = 2) -> None:
    """Run ``step`` on a side stream before capture, as torch.cuda.graph asks; the first call of a
    kernel variant compiles or loads it, which must not happen inside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def ulp(values: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` (bf16 / fp16) at each of ``values`` (float64), subnormals included."""
    v = values.double().abs()
    _, exponent = torch.frexp(v)  # v = m * 2**exponent, 0.5 <= m < 1
    e = torch.clamp(exponent.to(torch.int64) - 1, min=_MIN_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(v), e - _MANTISSA_BITS[dtype])


def assert_within_one_ulp(actual: torch.Tensor, expected64: torch.Tensor, dtype, slack=None, what="output"):
    """Every element of a bf16/fp16 ``actual`` is within one ``dtype`` ulp of the exact ``expected64``
    (plus ``slack``, an elementwise float64 allowance for FP32 cancellation).

    FP32 math with a single rounding to ``dtype`` at the end (the SPEC's rule) lands within half an
    ulp plus the FP32 error (~1e-6 relative, far below bf16/fp16's 1e-3..1e-4 ulp), so one full ulp is a
    safe bound; it catches a systematic error that the relative-norm tolerance would let through."""
    a = actual.detach().double().reshape(-1)
    e = expected64.detach().double().reshape(-1)
    if e.numel() == 0:
        return
    bound = ulp(e, dtype)
    if slack is not None:
        bound = bound + slack.detach().double().reshape(-1)
    excess = (a - e).abs() - bound
    bad = ~(excess <= 0)  # NaN counts as bad
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0].item())
        raise AssertionError(
            f"{what}: {int(bad.sum().item())} of {e.numel()} elements off by more than one {dtype} ulp; "
            f"first at flat index {i}: got {a[i].item()!r}, exact {e[i].item()!r}, bound {bound[i].item()!r}"
        )


# ------------------------------------------------------------------------------ kernel prewarm (GPU)

# 65537 and 131073: odd rows too wide for one CTA (cluster rows; without a ring in fp32 / bf16 and fp16).
SUITE_HIDDEN = (
    *(1, 7, 64, 512, 1000, 1024, 4096, 4097, 5120, 7168, 8192, 16384),
    *(65536, 65537, 131072, 131073, 262144),
)


def suite_specs(arch: str):
    """Every kernel variant the GPU tests launch (so a cold cache compiles them in parallel up
    front instead of one by one inside the tests)."""
    from cake_cute.runtime.specs import ReduceSpec
    from cake_cute.tools.warmup import variant_specs

    names = ("bf16", "fp16", "fp32")
    specs = variant_specs([arch], names, SUITE_HIDDEN, (False, True), ("same",))
    specs += variant_specs([arch], ("bf16", "fp16"), (7, 4096, 4097, 65536), (False, True), ("fp32",))
    specs += variant_specs([arch], names, (1000, 4096, 65536), (False, True), ("same",), weight_offset=1.0)
    specs += variant_specs([arch], ("fp32",), (8, 33), (False, True), ("same",))
    specs += [ReduceSpec(arch, n, h) for n in names for h in (4096, 5120)]
    return list(dict.fromkeys(specs))


PREWARM_MIN_TESTS = 50


@pytest.fixture(scope="session")
def prewarm_kernels(request):
    """Compile the suite's kernels into the disk cache with parallel workers (cake_cute.tools.warmup), once
    per session, when at least PREWARM_MIN_TESTS GPU tests are selected (a cold cache otherwise costs
    1-2 s per variant, one after the other, inside the tests). Variants already on disk cost a stat.
    Best effort: CAKE_CUTE_TEST_PREWARM=0 skips it, =1 forces it; a variant that fails to compile here
    is compiled again (and its error reported) by the test that needs it."""
    import io
    import os
    import warnings

    mode = os.environ.get("CAKE_CUTE_TEST_PREWARM", "auto")
    selected = sum(1 for item in request.session.items if "gpu" in item.keywords)
    if mode == "0" or not torch.cuda.is_available() or (mode != "1" and selected < PREWARM_MIN_TESTS):
        yield
        return
    try:
        from cake_cute.tools.warmup import local_archs, warm

        specs = [s for arch in local_archs() for s in suite_specs(arch)]
        result = warm(specs, jobs=min(16, os.cpu_count() or 1), progress=io.StringIO())
        if result.failed:
            warnings.warn(
                f"prewarm: {len(result.failed)} variants failed to compile, e.g. "
                f"{result.failed[0].spec.name()}: {result.failed[0].error}",
                stacklevel=2,
            )
    except Exception as exc:  # never let the optimization break the suite
        warnings.warn(f"prewarm skipped: {exc!r}", stacklevel=2)
    yield


# From H = 65536 on, the GPU tests cap T: the FP64 reference of 16231 x 65536 rows alone needs GBs.
WIDE = 65536
# (dtype, H) of the batch-invariance tests: vectorized, ragged, tiny, non-power-of-two, cluster, widest.
INVARIANCE_SHAPES = [
    (torch.bfloat16, 4096),
    (torch.float16, 4097),
    (torch.float32, 7),
    (torch.bfloat16, 1000),
    (torch.bfloat16, 65536),
    (torch.float32, 262144),
]


def suite_grid(rows) -> list:
    """``(dtype, hidden, residual, T)`` params over DTYPES x SUITE_HIDDEN x residual x ``rows_for(hidden,
    rows)``, T innermost so that consecutive tests reuse one compiled kernel."""
    return [
        pytest.param(
            dtype,
            hidden,
            residual,
            t,
            id=f"{DTYPE_IDS[dtype]}-H{hidden}-{'res' if residual else 'plain'}-T{t}",
        )
        for dtype in DTYPES
        for hidden in SUITE_HIDDEN
        for residual in (False, True)
        for t in rows_for(hidden, rows)
    ]


def rows_for(hidden: int, rows) -> list[int]:
    """The row counts tested at ``hidden``: ``rows``, capped at 129 for wide rows, duplicates dropped."""
    return list(dict.fromkeys(t if hidden < WIDE else min(t, 129) for t in rows))


def saved_by(fn):
    """(what ``fn()`` returns, the tensors autograd saved for the backward while it ran)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def scaled_then_gated(x, z, w, eps):
    """torchtitan's Qwen3.5 ``RMSNormGated`` (and Megatron-core's Gated DeltaNet norm and gate), the
    ``"scale_then_round"`` form: the normalized values times the FP32 weight rounded to x's dtype,
    times the FP32 SiLU of the gate, rounded again."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((w.float() * h).to(x.dtype) * torch.nn.functional.silu(z.float())).to(x.dtype)
