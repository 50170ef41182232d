"""The project's vocabulary, defined here and nowhere else: the dtypes the kernels take, the GPUs they
compile for (a capability not in ``ARCH_BY_CAPABILITY`` is not supported) and the gated norms' gate
activations. A dtype's CuTe DSL type is looked up on first use, so importing this module does not
import the DSL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str
    torch: torch.dtype
    bytes: int
    cutlass_name: str  # the type's name in the ``cutlass`` module

    def cutlass(self):
        import cutlass

        return getattr(cutlass, self.cutlass_name)


DTYPES = (
    DType("bf16", torch.bfloat16, 2, "BFloat16"),
    DType("fp16", torch.float16, 2, "Float16"),
    DType("fp32", torch.float32, 4, "Float32"),
)
DTYPE_NAMES = tuple(d.name for d in DTYPES)
# Activation dtypes no kernel takes, computed by the norm's math in torch operations (``routing.MATH``).
MATH_ONLY_DTYPES = (torch.float64,)
DTYPE_BY_NAME = {d.name: d for d in DTYPES}
DTYPE_BY_TORCH = {d.torch: d for d in DTYPES}

ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
SUPPORTED_ARCHS = tuple(ARCH_BY_CAPABILITY.values())
SUPPORTED_GPUS = "sm_90 (H100/H200) or sm_100/sm_103 (B200/B300)"

SILU, SIGMOID = "silu", "sigmoid"
GATE_ACTIVATIONS = (SILU, SIGMOID)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (KeyError for a dtype the kernels do not take)."""
    return DTYPE_BY_TORCH[dtype].name


def torch_dtype(name: str) -> torch.dtype:
    return DTYPE_BY_NAME[name].torch


def dtype_bytes(name: str) -> int:
    return DTYPE_BY_NAME[name].bytes


def cutlass_dtype(name: str):
    """``"bf16"`` -> ``cutlass.BFloat16`` (imports the DSL)."""
    return DTYPE_BY_NAME[name].cutlass()


def arch_of(capability: tuple[int, int]) -> str | None:
    """The compile target of a compute capability, or None when cake_cute does not support it."""
    return ARCH_BY_CAPABILITY.get(tuple(capability))
