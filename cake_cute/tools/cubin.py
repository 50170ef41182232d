"""What a compiled kernel looks like on the GPU: registers, spills, shared memory, access widths, read
from the cubin with ``cuobjdump`` and ``nvdisasm``, so a machine without a GPU can assert that no
kernel spills and that the vector paths issue 128-bit accesses.

The cubin comes from the object file the compile cache keeps: a TVM-FFI export is a host ELF object
whose device code is a fatbin in the symbol ``kernels_binary``, which ``cuobjdump`` reads once cut out.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from ..runtime.cache import Spec, get_kernel, is_cached_on_disk, object_path

FATBIN_SYMBOL = b"kernels_binary"
FATBIN_MAGIC = 0xBA55ED50
# Where the pip wheels put the tools: nvidia-cuda-{cuobjdump,nvdisasm} (CUDA 13), then their -cu12 wheels.
WHEEL_BIN_DIRS = ("cu13/bin", "cuda_cuobjdump/bin", "cuda_nvdisasm/bin")
INSTALL_HINT = (
    "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (or put the CUDA toolkit's bin on PATH)"
)

_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
# A product of a register with itself: FMUL / FMUL2 (rounded) or FFMA / FFMA2 (added unrounded), the
# operands' modifiers (.reuse, the packed lanes' .F32 / .F32x2.HI_LO) stripped.
_SQUARE = re.compile(r"\b(FMUL2?|FFMA2?)\s+R\d+,\s*(-?R\d+)[.\w]*,\s*(-?R\d+)[.\w]*")
_RES_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_REQNTID = re.compile(r"EIATTR_REQNTID\s+Format:\s+\w+\s+Value:\s+(0x[0-9a-f]+) (0x[0-9a-f]+) (0x[0-9a-f]+)")
_SUFFIX_BITS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16}
_ATOMICS = ("REDG", "ATOMG", "RED", "ATOM")
_FLOAT_TYPES = ("F16", "BF16", "F32", "F64")


class ToolNotFoundError(RuntimeError):
    """cuobjdump or nvdisasm is not installed."""


def find_tool(name: str) -> Path:
    """The wheel's copy first (it matches the DSL's CUDA 13 cubins), then PATH."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    for root in roots:
        for sub in WHEEL_BIN_DIRS:
            candidate = Path(root) / sub / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ToolNotFoundError(f"{name} not found; install it with: {INSTALL_HINT}")


def fatbin_from_object(data: bytes) -> bytes:
    """The fatbin stored in the ``kernels_binary`` symbol of an exported (x86-64 ELF) object file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF object")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Section header: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, sh_type, _, _, sym_off, sym_size, link, _, _, _ in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        str_off = sections[link][4]
        for entry in range(sym_off, sym_off + sym_size, 24):
            name, _, _, shndx, value, size = struct.unpack_from("<IBBHQQ", data, entry)
            start = str_off + name
            if data[start : data.index(b"\0", start)] == FATBIN_SYMBOL:
                begin = sections[shndx][4] + value
                blob = data[begin : begin + size]
                if len(blob) < 4 or struct.unpack_from("<I", blob)[0] != FATBIN_MAGIC:
                    raise ValueError("the kernels_binary symbol does not hold a fatbin")
                return blob
    raise ValueError("no kernels_binary symbol: not an object exported by the CuTe DSL")


def _run_tool(name: str, *args: str, cwd: str) -> str:
    result = subprocess.run([str(find_tool(name)), *args], capture_output=True, text=True, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(
            f"{name} {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}"
        )
    return result.stdout


def access_bits(opcode: str) -> int:
    """Bits moved per thread by a load/store opcode (``LDG.E`` -> 32)."""
    for part in opcode.split(".")[1:]:
        if part.isdigit():
            return int(part)
        if part in _SUFFIX_BITS:
            return _SUFFIX_BITS[part]
    return 32


def is_data_atomic(opcode: str) -> bool:
    """An atomic on floating-point values, summed in an order the hardware picks."""
    return any(part.startswith(_FLOAT_TYPES) for part in opcode.split(".")[1:])


def parse_sass(sass: str) -> dict:
    """Counts of global accesses by width, spills, generic loads, atomics, e4m3 conversions, L2
    prefetches, and squares fused into an add or rounded apart."""
    loads, stores, ops, squares = Counter(), Counter(), Counter(), Counter()
    e4m3_converts = data_atomics = 0
    for line in sass.splitlines():
        match = _SASS_LINE.match(line)
        if not match:
            continue
        square = _SQUARE.search(line)
        if square and square.group(2) == square.group(3):
            squares["fused" if square.group(1).startswith("FFMA") else "rounded"] += 1
        opcode = match.group(1)
        base = opcode.split(".")[0]
        ops[base] += 1
        e4m3_converts += base == "F2FP" and "E4M3" in opcode
        data_atomics += base in _ATOMICS and is_data_atomic(opcode)
        if base in ("LDG", "LDGSTS"):
            loads[access_bits(opcode)] += 1
        elif base == "STG":
            stores[access_bits(opcode)] += 1
    return {
        "global_load_width_bits": max(loads, default=0),
        "global_store_width_bits": max(stores, default=0),
        "ldg_counts": dict(sorted(loads.items())),
        "stg_counts": dict(sorted(stores.items())),
        "ldg_count": sum(loads.values()),
        "stg_count": sum(stores.values()),
        "local_loads": ops["LDL"],
        "local_stores": ops["STL"],
        "generic_loads": ops["LD"],
        "global_atomics": sum(ops[name] for name in _ATOMICS),
        "data_atomics": data_atomics,
        "e4m3_converts": e4m3_converts,
        "l2_bulk_prefetches": ops["UBLKPF"],
        "fused_squares": squares["fused"],
        "rounded_squares": squares["rounded"],
    }


def parse_resources(res_usage: str) -> dict:
    """The largest per-function numbers of ``cuobjdump -res-usage`` (a module has one kernel today)."""
    rows = [tuple(map(int, m)) for m in _RES_LINE.findall(res_usage)]
    if not rows:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{res_usage}")
    return {
        "functions": len(rows),
        "registers": max(r[0] for r in rows),
        "stack_bytes": max(r[1] for r in rows),
        "shared_bytes": max(r[2] for r in rows),
        "local_bytes": max(r[3] for r in rows),
    }


def parse_threads(elf_dump: str) -> int | None:
    """Threads per CTA from the cubin's required block size (EIATTR_REQNTID), if it declares one."""
    match = _REQNTID.search(elf_dump)
    if not match:
        return None
    x, y, z = (int(v, 16) for v in match.groups())
    return x * y * z


def _disassemble(fatbin_name: str, workdir: str) -> str:
    """SASS of every cubin in the fatbin, from nvdisasm directly, skipping its dataflow analysis."""
    _run_tool("cuobjdump", "-xelf", "all", fatbin_name, cwd=workdir)
    cubins = sorted(Path(workdir).glob("*.cubin"))
    if not cubins:
        raise RuntimeError("cuobjdump -xelf extracted no cubin from the fatbin")
    return "\n".join(_run_tool("nvdisasm", "-ndf", "-c", c.name, cwd=workdir) for c in cubins)


def inspect_fatbin(fatbin: bytes, *, sass: bool = True) -> dict:
    """Resources, block size and (with ``sass``, the slow part) access widths of the kernels in a fatbin."""
    with tempfile.TemporaryDirectory(prefix="cake_cubin_") as workdir:
        name = "kernels.fatbin"
        (Path(workdir) / name).write_bytes(fatbin)
        report = parse_resources(_run_tool("cuobjdump", "-res-usage", name, cwd=workdir))
        report["threads"] = parse_threads(_run_tool("cuobjdump", "-elf", name, cwd=workdir))
        if sass:
            report.update(parse_sass(_disassemble(name, workdir)))
        return report


def spill_free(report: dict) -> bool:
    """No stack frame and no local memory: a spill (LDL/STL) always needs a stack frame."""
    return report["stack_bytes"] == 0 and report["local_bytes"] == 0


def kernel_report(spec: Spec, *, sass: bool = True) -> dict:
    """The cubin report of one variant, read from the on-disk cache (compiled first if missing).

    Parameters
    ----------
    spec : KernelSpec or ReduceSpec
    sass : bool
        Also disassemble: access widths, local loads/stores, generic loads, global atomics.

    Returns
    -------
    dict
        ``name``, ``arch``, ``object`` (the cached file), the ``inspect_fatbin`` fields and
        ``cluster_n`` (a launch attribute, from the variant's config).

    Raises
    ------
    ToolNotFoundError
        cuobjdump or nvdisasm is not installed.
    """
    from ..runtime.build import config_for

    if not is_cached_on_disk(spec):
        get_kernel(spec)
    path = object_path(spec)
    report = {"name": spec.name(), "arch": spec.arch, "object": str(path)}
    report.update(inspect_fatbin(fatbin_from_object(path.read_bytes()), sass=sass))
    tiling = getattr(config_for(spec), "tiling", None)
    report["cluster_n"] = tiling.cluster_n if tiling is not None else 1
    return report
