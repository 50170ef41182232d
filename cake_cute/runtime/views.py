"""How torch tensors reach the kernels: the (rows, H) views they read in place (or a copy when the
layout forbids it) and the output buffers they write (the caller's own when aligned, else a fresh
one copied into the caller's). The kernels assume every row starts on a ``vec``-element boundary.
"""

from __future__ import annotations

import torch

from ..kernels.tiling import VECTOR_BYTES
from .launch_plan import COUNTER_BYTES, partial_row_stride

_CONTIGUOUS = torch.contiguous_format


def vector_align_bytes(vec: int, element_size: int) -> int:
    """The base alignment the kernels assume for a vector of ``vec`` elements."""
    return min(VECTOR_BYTES, vec * element_size)


def kernel_view(t: torch.Tensor, vec: int) -> torch.Tensor:
    """A (rows, H) view the kernels can read in place, else a contiguous copy."""
    hidden = t.shape[-1]
    if t.is_contiguous() and t.data_ptr() % (vec * t.element_size()) == 0:
        return t if t.dim() == 2 else t.view(-1, hidden)
    try:
        view = t.view(-1, hidden) if t.dim() != 2 else t
    except RuntimeError:
        view = None
    if view is not None and _is_kernel_layout(view, vec):
        return view
    return t.reshape(-1, hidden).contiguous()


def _is_kernel_layout(view: torch.Tensor, vec: int) -> bool:
    if view.shape[1] > 1 and view.stride(1) != 1:
        return False
    row_stride = view.stride(0)
    if view.shape[0] > 1 and row_stride % vec != 0:
        return False
    return view.data_ptr() % (vec * view.element_size()) == 0


def aligned_vector(w: torch.Tensor, vec: int) -> torch.Tensor:
    """w as the kernels read it: contiguous with an aligned base (a copy only when it is not)."""
    if w.is_contiguous() and w.data_ptr() % vector_align_bytes(vec, w.element_size()) == 0:
        return w
    return w.clone(memory_format=_CONTIGUOUS)


def rows_view(t: torch.Tensor, hidden: int) -> torch.Tensor:
    return t if t.dim() == 2 else t.view(-1, hidden)


def is_direct_output(t: torch.Tensor, vec: int) -> bool:
    """A caller-owned output the kernel may write directly: contiguous and vector aligned."""
    return t.is_contiguous() and t.data_ptr() % (vec * t.element_size()) == 0


def new_output(like: torch.Tensor, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous output, the one layout every kernel returns, real or fake (so torch.compile is
    told the strides it gets)."""
    shape = like.shape if shape is None else shape
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def as_output(result: torch.Tensor, like: torch.Tensor, shape=None, dtype: torch.dtype | None = None):
    """``result`` (computed by torch ops, in whatever layout they chose) copied into ``new_output``."""
    return new_output(like, shape, dtype).copy_(result.reshape(like.shape if shape is None else shape))


def output_like(given, x: torch.Tensor, vec: int):
    """(tensor the kernel writes, caller tensor to copy into afterwards or None) for an output like x."""
    if given is None:
        return new_output(x), None
    if is_direct_output(given, vec):
        return given, None
    return new_output(x), given


def vector_output(given, length: int, dtype: torch.dtype, device: torch.device):
    """The same for a 1-D output (rstd, dw)."""
    if given is None:
        return torch.empty(length, dtype=dtype, device=device), None
    if is_direct_output(given, 1):
        return given, None
    return torch.empty(length, dtype=dtype, device=device), given


def finish(written: torch.Tensor, caller):
    """Copy into a caller-owned output the kernel could not write directly; return what the caller gets."""
    if caller is None:
        return written
    caller.copy_(written)
    return caller


def kernel_weight(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w as the kernels take it beside x: itself in x's dtype or FP32, else widened to FP32 (exactly)."""
    return w if w.dtype in (x.dtype, torch.float32) else w.float()


def partial_rows_view(workspace, partial_rows: int, hidden: int, device) -> torch.Tensor:
    """The padded FP32 (partial_rows, H) view of the caller's workspace, or a fresh buffer."""
    stride = partial_row_stride(hidden)
    if workspace is None:
        partials = torch.empty((partial_rows, stride), dtype=torch.float32, device=device)
    else:
        partials = workspace[: partial_rows * stride * 4].view(torch.float32).view(partial_rows, stride)
    return partials if stride == hidden else partials[:, :hidden]


# Kept for the life of the process: a captured CUDA graph holds their addresses.
_stream_counters: dict[tuple[int, int], torch.Tensor] = {}


def barrier_counter(workspace, device: torch.device) -> torch.Tensor:
    """The grid barrier's Int32 counter of a backward that sums dW in its own launch: zero between
    launches. Launches that could run at once must not share one, so it lives in the caller's workspace
    (its last slot), else one per device and stream; a launch captured into a CUDA graph without a
    workspace gets its own, zeroed by each replay. Called with ``device`` current."""
    if workspace is not None:
        end = workspace.numel() // COUNTER_BYTES * COUNTER_BYTES - COUNTER_BYTES
        return workspace[end : end + 4].view(torch.int32)
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    counter = _stream_counters.get(key)
    if counter is None:
        counter = _stream_counters[key] = torch.zeros(
            1, dtype=torch.int32, device=torch.device("cuda", index)
        )
    return counter
