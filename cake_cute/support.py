"""Whether a device (and hidden size) can run cake_cute."""

from __future__ import annotations

import torch

from .kernels.config import MAX_HIDDEN
from .validation import ARCH_BY_CAPABILITY


def is_cake_rmsnorm_train_supported(device, hidden=None) -> bool:
    """True on sm_90 / sm_100 / sm_103 CUDA devices for 1 <= hidden <= 262144; never raises."""
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        return False
    if hidden is not None and (
        isinstance(hidden, bool) or not isinstance(hidden, int) or not 1 <= hidden <= MAX_HIDDEN
    ):
        return False
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return False
    return torch.cuda.get_device_capability(index) in ARCH_BY_CAPABILITY
