"""What cake_cute needs to know about a CUDA device: its compile target, its SM count, which device is
current, and how many CTAs (or clusters) of a launch shape are resident at once.

The persistent backward launches exactly the resident number of programs, since one more would run
as a second wave. Clusters must fit inside one GPC, so the count is not SMs * CTAs-per-SM / cluster
size; the driver's occupancy calculator is asked about a trivial kernel with the real block and
cluster shape, whose shared memory admits exactly ``ctas_per_sm`` CTAs per SM.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import cache

import torch

from ..kernels.tiling import SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from ..vocab import SUPPORTED_GPUS, arch_of


@dataclass(frozen=True, eq=False)  # one instance per device (cached): identity hashing is cheap
class DeviceFacts:
    index: int
    name: str
    capability: tuple[int, int]
    arch: str | None  # None: a GPU cake_cute does not support
    sm_count: int


@cache
def device_facts_of(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    return DeviceFacts(index, props.name, capability, arch_of(capability), props.multi_processor_count)


def device_facts(device: torch.device) -> DeviceFacts:
    return device_facts_of(device.index if device.index is not None else torch.cuda.current_device())


def device_arch(device: torch.device) -> str:
    """The compile target of a CUDA device, or a ValueError for a CPU tensor or an unsupported GPU."""
    if device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor, got device {device}")
    facts = device_facts(device)
    if facts.arch is None:
        raise ValueError(f"device {device} ({facts.name}) is not supported: cake_cute needs {SUPPORTED_GPUS}")
    return facts.arch


def on_device(device: torch.device):
    """A context making ``device`` current for the launch; a no-op when it already is (the usual case)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


_PTX_VERSION = {9: "7.8", 10: "8.8"}


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return result[1] if len(result) == 2 else result[1:]


@cache
def _probe_kernel(device_index: int, major: int, minor: int):
    """An empty kernel loaded into the device's primary context (current when this is called)."""
    from cuda.bindings import driver

    ptx = (
        f".version {_PTX_VERSION[major]}\n.target sm_{major}{minor}\n.address_size 64\n"
        ".visible .entry cake_cute_occupancy_probe() { ret; }\n"
    )
    module = _check(driver.cuModuleLoadData(ptx.encode() + b"\0"))
    return _check(driver.cuModuleGetFunction(module, b"cake_cute_occupancy_probe"))


@cache
def resident_clusters(
    device_index: int,
    capability: tuple[int, int],
    threads: int,
    cluster_n: int,
    ctas_per_sm: int,
    sm_count: int,
) -> int:
    """Clusters of ``cluster_n`` CTAs of ``threads`` threads, ``ctas_per_sm`` per SM, resident at once."""
    estimate = max(1, sm_count * ctas_per_sm // cluster_n)
    try:
        from cuda.bindings import driver

        # The device's primary context is the one torch uses; make it current for these queries.
        _check(driver.cuInit(0))
        dev = _check(driver.cuDeviceGet(device_index))
        context = _check(driver.cuDevicePrimaryCtxRetain(dev))
        _check(driver.cuCtxPushCurrent(context))
        try:
            func = _probe_kernel(device_index, *capability)
            smem = SMEM_PER_SM // ctas_per_sm - SMEM_RESERVED_PER_CTA
            attr = driver.CUfunction_attribute
            _check(
                driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            )
            if cluster_n == 1:
                per_sm = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, smem))
                return max(1, min(estimate, per_sm * sm_count))
            _check(
                driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            )
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = cluster_n, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = smem
            cluster = driver.CUlaunchAttribute()
            cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = (
                cluster_n,
                1,
                1,
            )
            config.attrs = [cluster]
            config.numAttrs = 1
            return max(1, min(estimate, _check(driver.cuOccupancyMaxActiveClusters(func, config))))
        finally:
            _check(driver.cuCtxPopCurrent())
            _check(driver.cuDevicePrimaryCtxRelease(dev))
    except Exception as err:  # the arithmetic bound; it can over-count how clusters pack into GPCs
        warnings.warn(
            f"cake_cute: occupancy query failed ({err}); assuming {estimate} resident programs", stacklevel=2
        )
        return estimate
