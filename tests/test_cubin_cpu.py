"""cake_cute.tools.cubin: parsing cuobjdump/nvdisasm output, cutting the fatbin out of an exported object,
and reporting on a cached kernel without compiling it again."""

import pytest

from cake_cute.runtime import cache as compile_cache
from cake_cute.runtime.specs import KernelSpec, ReduceSpec
from cake_cute.tools import cubin

SASS = """
        /*0230*/                   LDG.E.128 R16, desc[UR6][R2.64+0x1800] ;
        /*0240*/              @!P1 LDG.E.U16 R8, desc[UR6][R2.64] ;
        /*0250*/               @P0 LDG.E R4, desc[UR6][R2.64] ;
        /*0260*/                   STG.E.64 desc[UR6][R2.64], R36 ;
        /*0270*/                   STL [R1+0x4], R3 ;
        /*0280*/                   LDL R5, [R1+0x4] ;
        /*0290*/                   LD.E R6, desc[UR4][R2.64] ;
        /*02a0*/                   LDGSTS.E.BYPASS.128 [R7], desc[UR6][R2.64] ;
        /*02b0*/                   UBLKPF.L2 [UR18], UR4 ;
"""

RES_USAGE = """
 Function kernel_a:
  REG:62 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:604 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function kernel_b:
  REG:40 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:604 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

ELF = """
	Attribute:	EIATTR_REQNTID
	Format:	EIFMT_SVAL
	Value:	0x80 0x2 0x1
"""


@pytest.mark.parametrize(
    "opcode, bits",
    [
        ("LDG.E.128", 128),
        ("LDG.E.64", 64),
        ("LDG.E", 32),
        ("STG.E.U16", 16),
        ("LDG.E.S8", 8),
        ("LDG.E.128.CONSTANT", 128),
        ("LDGSTS.E.BYPASS.128", 128),
        ("LDG.E.LTC128B.128", 128),
    ],
)
def test_access_bits(opcode, bits):
    assert cubin.access_bits(opcode) == bits


def test_parse_sass_counts_by_width():
    report = cubin.parse_sass(SASS)
    assert report["ldg_counts"] == {16: 1, 32: 1, 128: 2}
    assert report["stg_counts"] == {64: 1}
    assert report["global_load_width_bits"] == 128
    assert report["global_store_width_bits"] == 64
    assert (report["local_loads"], report["local_stores"], report["generic_loads"]) == (1, 1, 1)
    assert report["l2_bulk_prefetches"] == 1


def test_parse_sass_tells_fused_squares_from_rounded_ones():
    """x * x fused into an add (FFMA, FFMA2) or rounded alone (FMUL, FMUL2, whatever the operands'
    modifiers); a product of two registers, or of one by a constant, is no square."""
    sass = """
        /*0100*/                   FFMA R64, R4, R4, RZ ;
        /*0110*/                   FFMA R69, R5.reuse, R5, R64 ;
        /*0120*/                   FMUL R7, R7, R7 ;
        /*0130*/                   FMUL2 R16, R35.F32, R35.F32 ;
        /*0140*/                   FMUL2 R10, R20.F32x2.HI_LO, R10.F32x2.HI_LO ;
        /*0150*/                   FMUL R24, R31, -1.4426950216293334961 ;
        /*0160*/                   FFMA R39, R22, R39, 0.14285714924335479736 ;
        /*0170*/                   FFMA R12, R1, R12, R3 ;
"""
    report = cubin.parse_sass(sass)
    assert (report["fused_squares"], report["rounded_squares"]) == (2, 2)


# Kernels that compute a row's rstd, where the compiler left alone once rounded some squares on their own:
# the FP32 statistics kernel (its forward fused them), the sm_100a forward of 7-wide gated rows (one
# packed FMUL2), and a plain and an FP8 forward for good measure.
RSTD_KERNELS = [
    ("gated_rstd", "sm_90a", "fp32", 64),
    ("gated_fwd", "sm_90a", "fp32", 64),
    ("gated_fwd", "sm_100a", "bf16", 7),
    ("fwd", "sm_100a", "fp32", 5120),
    ("fwd_mxfp8", "sm_90a", "bf16", 4096),
]


@pytest.mark.parametrize("kind, arch, act, hidden", RSTD_KERNELS)
def test_every_square_of_a_sum_of_squares_is_fused(tmp_path, monkeypatch, kind, arch, act, hidden):
    """Every kernel's sum of squares is one FMA chain (``kernels.common.sum_of_squares``): no square is
    rounded on its own, so the statistics kernel's rstd, the forward's and the FP8 forward's are one
    value. FP32 rows of 64: 16 elements per lane, 16 fused squares in the forward and the statistics."""
    from cake_cute.runtime.specs import GatedSpec

    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    if kind.startswith("gated"):
        spec = GatedSpec(kind, arch, act, act, hidden, hidden, True)
    else:
        spec = KernelSpec(kind, arch, act, act, hidden, residual=kind == "fwd")
    report = cubin.kernel_report(spec)
    assert report["rounded_squares"] == 0
    assert report["fused_squares"] >= (16 if (act, hidden) == ("fp32", 64) else 1)


@pytest.mark.parametrize(
    "act, hidden, prefetches",
    [("fp32", 131072, 2), ("fp32", 65537, 0), ("bf16", 4096, 0)],
)
def test_only_128_bit_rows_without_a_ring_bulk_prefetch(tmp_path, monkeypatch, act, hidden, prefetches):
    """The backward without a ring prefetches g and h of the next row into the L2 with
    cp.async.bulk.prefetch, which needs 16-byte aligned addresses and sizes: 128-bit vector tilings
    only (fp32 H = 65537 has no ring either, but one-element vectors); ring tilings never."""
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    spec = KernelSpec("bwd", "sm_90a", act, act, hidden)
    assert cubin.kernel_report(spec)["l2_bulk_prefetches"] == prefetches


def test_parse_resources_takes_the_worst_function():
    report = cubin.parse_resources(RES_USAGE)
    assert report == {
        "functions": 2,
        "registers": 62,
        "stack_bytes": 16,
        "shared_bytes": 1024,
        "local_bytes": 8,
    }
    assert not cubin.spill_free(report)


def test_parse_threads():
    assert cubin.parse_threads(ELF) == 256
    assert cubin.parse_threads("no attribute") is None


def test_fatbin_from_object_rejects_other_files():
    with pytest.raises(ValueError, match="ELF"):
        cubin.fatbin_from_object(b"not an object file")


def test_missing_tool_names_the_package(monkeypatch):
    monkeypatch.setattr(cubin, "WHEEL_BIN_DIRS", ())
    monkeypatch.setenv("PATH", "")
    with pytest.raises(cubin.ToolNotFoundError, match="pip install nvidia-cuda-cuobjdump"):
        cubin.find_tool("cuobjdump")


def test_report_of_a_cached_kernel_compiles_nothing(tmp_path, monkeypatch):
    """The report reads the cached object file: a warm cache is reported on without a compile."""
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    spec = KernelSpec("fwd", "sm_90a", "bf16", "bf16", 4096)
    compile_cache.get_kernel(spec)
    before = compile_cache.compile_count
    monkeypatch.setattr(compile_cache, "_memory", {})
    report = cubin.kernel_report(spec)
    assert compile_cache.compile_count == before
    assert report["name"] == spec.name()
    assert report["global_load_width_bits"] == 128 and report["threads"] == 128 and report["cluster_n"] == 1
    assert report["registers"] > 0


def test_fatbin_holds_one_cubin_for_the_spec_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    spec = ReduceSpec("sm_100a", "fp32", 4096)
    compile_cache.get_kernel(spec)
    fatbin = cubin.fatbin_from_object(compile_cache.object_path(spec).read_bytes())
    workdir = tmp_path / "x"
    workdir.mkdir()
    (workdir / "k.fatbin").write_bytes(fatbin)
    listing = cubin._run_tool("cuobjdump", "-lelf", "k.fatbin", cwd=str(workdir))
    assert listing.count(".cubin") == 1 and "sm_100a" in listing


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize(("hidden", "threads"), [(64, 1024), (4096, 256)])
def test_dw_reduce_loads_its_rows_in_flight_before_adding(tmp_path, monkeypatch, arch, hidden, threads):
    """dw_reduce: a lane's ``rows_in_flight`` partial rows are loaded back to back (one 128-bit load
    each, 8 by default, 1 when asked for one) before they are added; no spill, and 1024-thread CTAs
    hold at most 64 registers."""
    from cake_cute.kernels.config import overridden

    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    spec = ReduceSpec(arch, "bf16", hidden)
    batched = cubin.kernel_report(spec)
    with overridden("dw", arch, "bf16", hidden, rows_in_flight=1):
        one_row = cubin.kernel_report(spec)
    assert batched["ldg_counts"] == {128: 8} and one_row["ldg_counts"] == {128: 1}
    assert batched["threads"] in (None, threads)
    assert cubin.spill_free(batched) and batched["registers"] <= 64


def test_data_atomics_are_the_floating_point_ones():
    """Atomics on floating-point values sum data in an order the hardware picks; the integer atomics of
    a grid barrier's counter do not, and are counted apart."""
    assert cubin.is_data_atomic("REDG.E.ADD.F32.FTZ.RN.STRONG.GPU")
    assert cubin.is_data_atomic("ATOMG.E.ADD.F32x4.FTZ.RN.STRONG.GPU")
    assert cubin.is_data_atomic("ATOMG.E.ADD.BF16x2.RN.STRONG.GPU")
    assert not cubin.is_data_atomic("ATOMG.E.ADD.STRONG.GPU")
    sass = "\n".join(
        f"        /*00{i}0*/                   {op} ;"
        for i, op in enumerate(
            ("ATOMG.E.ADD.STRONG.GPU PT, RZ, desc[UR4][R2.64], R5", "REDG.E.ADD.F32.FTZ.RN.STRONG.GPU")
        )
    )
    parsed = cubin.parse_sass(sass)
    assert (parsed["global_atomics"], parsed["data_atomics"]) == (2, 1)
