"""Kernel specs: what names one compiled kernel variant. T is a runtime value of every kernel, so it is
in no spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..vocab import SILU


@dataclass(frozen=True)
class KernelSpec:
    """A forward (``"fwd"``) or backward (``"bwd"``) kernel: rows of ``act_dtype``, a weight of
    ``w_dtype``, hidden size ``hidden``, optionally fused with the residual add, with ``weight_offset``
    compiled in. A backward reads g as ``g_parts`` summands; a ``memory_efficient`` backward reads y in
    place of the input. The name mentions either only when it is not the default, so existing names stay."""

    kind: str  # "fwd" or "bwd"
    arch: str  # vocab.SUPPORTED_ARCHS
    act_dtype: str  # vocab.DTYPE_NAMES
    w_dtype: str
    hidden: int
    residual: bool = False
    weight_offset: float = 0.0
    g_parts: int = 1  # "bwd" only
    memory_efficient: bool = False  # "bwd" only
    dw_dtype: str = ""  # "bwd" only: the dW a backward that finishes it in its launch writes

    def name(self) -> str:
        offset = f"_off{self.weight_offset:g}".replace(".", "p").replace("-", "m")
        res = "_res" if self.residual else ""
        parts = f"_g{self.g_parts}" if self.g_parts > 1 else ""
        saved = "_meff" if self.memory_efficient else ""
        dw = f"_dw{self.dw_dtype}" if self.dw_dtype else ""
        variant = f"{self.arch}_{self.act_dtype}_w{self.w_dtype}_h{self.hidden}"
        return f"cake_{self.kind}_{variant}{res}{offset}{parts}{saved}{dw}"


@dataclass(frozen=True)
class ReduceSpec:
    """The dW reduction: FP32 partial rows of ``hidden`` columns summed into a dW of ``out_dtype``."""

    kind: ClassVar[str] = "dw"
    arch: str
    out_dtype: str  # vocab.DTYPE_NAMES: FP32 for the functional API, w's dtype for autograd
    hidden: int

    def name(self) -> str:
        return f"cake_dw_{self.arch}_{self.out_dtype}_h{self.hidden}"


@dataclass(frozen=True)
class GatedSpec:
    """A gated RMSNorm forward (``"gated_fwd"``), its statistics alone (``"gated_rstd"``) or backward
    (``"gated_bwd"``): rows of ``act_dtype`` and their gate, a weight of ``w_dtype``, groups of
    ``group_size`` columns, ``weight_offset`` and the gate ``activation`` compiled in. The statistics
    read no weight: their spec carries x's dtype as ``w_dtype`` and no offset. The name mentions the
    activation only when it is not SiLU."""

    kind: str  # "gated_fwd", "gated_rstd" or "gated_bwd"
    arch: str  # vocab.SUPPORTED_ARCHS
    act_dtype: str  # vocab.DTYPE_NAMES
    w_dtype: str
    hidden: int
    group_size: int
    norm_before_gate: bool
    weight_offset: float = 0.0
    activation: str = SILU
    dw_dtype: str = ""  # "gated_bwd" only: the dW a backward that finishes it in its launch writes

    def name(self) -> str:
        offset = f"_off{self.weight_offset:g}".replace(".", "p").replace("-", "m")
        groups = "" if self.group_size == self.hidden else str(self.group_size)
        form = f"nbg{groups}" if self.norm_before_gate else f"gbn{self.group_size}"
        gate = "" if self.activation == SILU else f"_{self.activation}"
        dw = f"_dw{self.dw_dtype}" if self.dw_dtype else ""
        variant = f"{self.arch}_{self.act_dtype}_w{self.w_dtype}_h{self.hidden}_{form}{offset}{gate}{dw}"
        return f"cake_{self.kind}_{variant}"
