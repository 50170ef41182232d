"""cake_cute: fused RMSNorm training kernels (CuTe DSL) for Hopper and Blackwell, used from PyTorch."""

from importlib.metadata import version as _installed_version

__version__ = _installed_version("cake-cute")  # the one source: pyproject.toml

import torch  # noqa: E402

from .autograd import CakeRMSNormFunction, cake_rmsnorm  # noqa: E402
from .dispatch import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward, prepare  # noqa: E402
from .fp8 import Fp8NormOutput, cake_rmsnorm_fp8  # noqa: E402
from .gated.autograd import cake_gated_rmsnorm  # noqa: E402
from .gated.flashinfer import (  # noqa: E402
    CakeRMSNormSiLUGateFunction,
    cake_rmsnorm_silu_gate,
    cake_rmsnorm_silu_gate_train_backward,
    cake_rmsnorm_silu_gate_train_backward_workspace,
    cake_rmsnorm_silu_gate_train_backward_workspace_bytes,
    cake_rmsnorm_silu_gate_train_forward,
)
from .gated.module import CakeGatedRMSNorm  # noqa: E402
from .gated.swap import GatedNormNotServed, swap_gated_rmsnorm  # noqa: E402
from .hf.fusion import add_rmsnorm, fuse_residual_rmsnorm  # noqa: E402
from .hf.kernel_route import hf_kernel_config, hf_kernel_mapping  # noqa: E402
from .hf.norm_reading import NormNotServed  # noqa: E402
from .hf.swap import swap_rmsnorm  # noqa: E402
from .launch import (  # noqa: E402
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_backward_workspace_bytes,
)
from .module import CakeRMSNorm  # noqa: E402
from .validation import ArgumentError, is_cake_rmsnorm_train_supported  # noqa: E402

if torch.distributed.is_available():
    # Registers the DTensor sharding rules of the custom ops, plain and gated.
    from .distributed import SequenceParallelResidual  # noqa: E402, F401
    from .gated import distributed as _gated_rules  # noqa: E402, F401

__all__ = [
    "CakeGatedRMSNorm",
    "CakeRMSNormSiLUGateFunction",
    "cake_rmsnorm_silu_gate",
    "cake_rmsnorm_silu_gate_train_backward",
    "cake_rmsnorm_silu_gate_train_backward_workspace",
    "cake_rmsnorm_silu_gate_train_backward_workspace_bytes",
    "cake_rmsnorm_silu_gate_train_forward",
    "GatedNormNotServed",
    "NormNotServed",
    "cake_gated_rmsnorm",
    "swap_gated_rmsnorm",
    "ArgumentError",
    "CakeRMSNorm",
    "CakeRMSNormFunction",
    "Fp8NormOutput",
    "add_rmsnorm",
    "SequenceParallelResidual",
    "cake_rmsnorm",
    "cake_rmsnorm_fp8",
    "cake_rmsnorm_train_backward",
    "cake_rmsnorm_train_backward_workspace",
    "cake_rmsnorm_train_backward_workspace_bytes",
    "cake_rmsnorm_train_forward",
    "fuse_residual_rmsnorm",
    "hf_kernel_config",
    "hf_kernel_mapping",
    "is_cake_rmsnorm_train_supported",
    "prepare",
    "swap_rmsnorm",
]
