"""Every kernel variant compiles for sm_90a and sm_100a without a GPU, and its machine code shows no
spills and no global atomics (every variant, whatever its row width) and 128-bit global accesses wherever
a row is a multiple of 16 bytes.

The whole matrix is compiled once per session by the warmup code path (two worker processes) into a
temporary cache, then each variant's cubin is read back with cuobjdump and disassembled with nvdisasm.
The backwards that read g as 2 or 3 summands (``g_parts``) are a matrix of their own, compiled only
when one of their tests runs (``-k _g2`` or ``-k _g3`` selects them).
"""

from collections import Counter

import pytest

from cake_cute.runtime.build import config_for
from cake_cute.runtime.specs import KernelSpec
from cake_cute.tools.cubin import spill_free
from cake_cute.tools.kernel_report import collect_reports
from cake_cute.tools.warmup import variant_specs, warm
from cake_cute.vocab import dtype_bytes

ARCHS = ("sm_90a", "sm_100a")
DTYPES = ("bf16", "fp16", "fp32")
HIDDEN = (1, 7, 512, 1024, 4096, 4097, 7168, 8192, 65536, 262144)
JOBS = 2

SPECS = list(
    dict.fromkeys(
        variant_specs(ARCHS, DTYPES, HIDDEN, (False, True), ("same",))
        + variant_specs(ARCHS, ("bf16",), (4096,), (False, True), ("fp32",))
        + variant_specs(ARCHS, ("fp16",), (4097,), (False,), ("fp32",))
    )
)
# Backwards of g in parts: every H for bf16, the edges for fp16 and fp32, FP32 w next to bf16 rows.
PARTS_ROWS = {
    ("bf16", "bf16"): (1, 7, 1024, 4096, 4097, 8192, 65536, 131072),
    ("fp16", "fp16"): (7, 4097),
    ("fp32", "fp32"): (1, 1024, 65536, 131072),
    ("bf16", "fp32"): (4096, 8192),
}
PARTS_SPECS = [
    KernelSpec("bwd", arch, act, w, hidden, residual=residual, g_parts=g_parts)
    for (act, w), hiddens in PARTS_ROWS.items()
    for hidden in hiddens
    for arch in ARCHS
    for residual in (False, True)
    for g_parts in (2, 3)
]
PARTS = frozenset(PARTS_SPECS)


def _is_vectorizable(spec) -> bool:
    """A row is a whole number of 16-byte vectors (the dW reduction reads FP32 partial rows)."""
    element_bytes = 4 if spec.kind == "dw" else dtype_bytes(spec.act_dtype)
    return spec.hidden * element_bytes % 16 == 0


def _compile(specs, tmp_path_factory):
    """{spec: cubin report} for every variant that compiled, and {spec: error} for the others."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path_factory.mktemp("kernel_cache")))
        result = warm(specs, jobs=JOBS)
        ok = [o.spec for o in result.compiled] + result.cached
        reports = dict(zip(ok, collect_reports(ok, jobs=JOBS)))
    return reports, {o.spec: o.error for o in result.failed}


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    return _compile(SPECS, tmp_path_factory)


@pytest.fixture(scope="session")
def compiled_parts(tmp_path_factory):
    return _compile(PARTS_SPECS, tmp_path_factory)


def _report(request, spec):
    """The cubin report of ``spec``, compiling its matrix (the main one, or g in parts) first."""
    reports, errors = request.getfixturevalue("compiled_parts" if spec in PARTS else "compiled")
    if spec in errors:
        pytest.fail(f"{spec.name()} did not compile:\n{errors[spec]}")
    return reports[spec]


def test_matrix_size():
    """Forward and backward: 2 archs x 3 dtypes x 10 H x 2 modes, plus 4 + 2 with an FP32 weight; the
    reduction: 2 archs x 10 H x 3 output dtypes. 218 of them have rows of whole 16-byte vectors. The
    backwards of g in parts: 16 (dtypes, H) x 2 archs x 2 modes x 2 part counts, 80 of whole vectors."""
    assert Counter(s.kind for s in SPECS) == {"fwd": 126, "bwd": 126, "dw": 60}
    assert sum(map(_is_vectorizable, SPECS)) == 218
    assert len(set(PARTS_SPECS)) == len(PARTS_SPECS) == 128
    assert sum(map(_is_vectorizable, PARTS_SPECS)) == 80


ALL_SPECS = SPECS + PARTS_SPECS


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name())
def test_no_spills(request, spec):
    report = _report(request, spec)
    assert spill_free(report) and report["local_loads"] == report["local_stores"] == 0, (
        f"{spec.name()}: stack {report['stack_bytes']} B, local {report['local_bytes']} B, "
        f"LDL/STL {report['local_loads']}/{report['local_stores']}, {report['registers']} registers"
    )


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if _is_vectorizable(s)], ids=lambda s: s.name())
def test_128_bit_global_access(request, spec):
    report = _report(request, spec)
    assert report["global_load_width_bits"] == 128, f"{spec.name()}: loads {report['ldg_counts']}"
    if spec.kind != "dw":  # dw writes one H-vector of scalars; its width does not matter
        assert report["global_store_width_bits"] == 128, f"{spec.name()}: stores {report['stg_counts']}"


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name())
def test_no_global_atomics(request, spec):
    """The deterministic guarantee, read from the machine code: no kernel has a global atomic (RED/ATOM),
    so no result depends on the order in which CTAs finish."""
    report = _report(request, spec)
    assert report["global_atomics"] == 0, f"{spec.name()} has {report['global_atomics']} global atomics"


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name())
def test_report_matches_config(request, spec):
    report = _report(request, spec)
    config = config_for(spec)
    if spec.kind == "dw":
        assert (report["threads"], report["cluster_n"]) == (config.threads, 1)
    else:
        assert report["threads"] == config.tiling.threads_per_cta
        assert report["cluster_n"] == config.tiling.cluster_n


@pytest.mark.parametrize(
    "spec",
    [s for s in PARTS_SPECS if config_for(s).dw_in_smem and _is_vectorizable(s)],
    ids=lambda s: s.name(),
)
def test_parts_without_a_ring_prefetch_every_part(request, spec):
    """Without a ring, the next row's parts of g, its h (and g_residual) get one bulk L2 prefetch each."""
    assert _report(request, spec)["l2_bulk_prefetches"] == spec.g_parts + 1 + spec.residual
