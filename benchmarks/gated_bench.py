"""Gated RMSNorm speed: cake_cute's forward and backward as a fraction of a device copy of the bytes
they must move, next to the Hugging Face module in eager and under torch.compile, and fla's
``FusedRMSNormGated`` (norm then gate) where fla imports; at the norm-then-gate shapes also FlashInfer's
functional spelling (``cake_cute_functional``: its backward recomputes rstd, so it reads x once more
than the bytes it is measured against). Gate activations: SiLU (Qwen3-Next's ``Qwen3NextRMSNormGated``,
the Mamba-2 hybrids' grouped class), and sigmoid at the norm-then-gate shapes (Kimi Linear's
``KimiLinearRMSNormGated``, fla's ``FusedRMSNormGated(activation="sigmoid")``; FlashInfer's spelling is
SiLU's alone).

Bytes (``docs/gated.md``): forward reads x and z and writes y, plus FP32 rstd per segment; backward
reads g, x and z and writes dx and dz, plus rstd. ``fraction`` = (device time of a copy of those
bytes) / (device time of the call): 1.0 runs at the copy's speed. Device times are medians of
``--reps`` calls timed by ``cake_cute.tools.bench.timing.DeviceTimer`` (a spin kernel hides the host;
inputs rotate through enough sets to exceed twice the L2, so every figure is an HBM figure). The
peers' backward is autograd's (the forward runs untimed before each call).

Shapes: rows of head_dim 128 (norm then gate, T * heads = 2^16 .. 2^21 rows; SiLU, then sigmoid) and
grouped full-width rows (gate then norm, SiLU). About four minutes on one H200 (the compiled module
compiles once per form, with dynamic shapes).

    python benchmarks/gated_bench.py results.json [--dtype bf16] [--reps 20] [--kernels]
        [--activations silu,sigmoid]

``--kernels``: where cake_cute's backward time goes at the head-dim shapes (no peers). A call is two
kernels, the row kernel (dx, dz, the per-program dW partial rows) and the fixed-order dW finish;
from the profiler's GPU activity over ``--reps`` calls: the row kernel's duration, the tail (the dW
finish's end after the row kernel's end) and the copy kernel's duration for the same bytes, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from cake_cute import (
    cake_rmsnorm_silu_gate_train_backward,
    cake_rmsnorm_silu_gate_train_backward_workspace,
    cake_rmsnorm_silu_gate_train_forward,
)
from cake_cute.gated.ops import gated_rmsnorm_backward, gated_rmsnorm_forward
from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for, gpu_events
from cake_cute.vocab import DTYPE_NAMES, GATE_ACTIVATIONS, SIGMOID, SILU, torch_dtype

EPS = 1e-6
HEAD_DIM_ROWS = [1 << k for k in range(16, 22)]
# (T, H, group_size): Mamba-2 hybrids' SSM output norms (n_groups = 8 and 1).
GROUPED = [(4096, 8192, 1024), (16384, 8192, 1024), (4096, 16384, 2048), (8192, 8192, 8192)]


def shapes(activations=GATE_ACTIVATIONS) -> list[tuple[int, int, int, bool, str]]:
    """(T, H, group_size, norm_before_gate, activation) of every case of ``activations``: head-dim
    rows with each, grouped rows with SiLU (the Mamba-2 hybrids gate with it alone)."""
    cases = [(rows, 128, 128, True, gate) for gate in activations for rows in HEAD_DIM_ROWS]
    if SILU in activations:
        cases += [(rows, hidden, group, False, SILU) for rows, hidden, group in GROUPED]
    return cases


def nbytes(op: str, rows: int, hidden: int, group: int, element: int) -> int:
    tensors = 3 if op == "forward" else 5
    return tensors * rows * hidden * element + 4 * rows * (hidden // group)


class Cake:
    name = "cake_cute"

    def __init__(self, hidden, group, norm_before_gate, dtype, activation=SILU):
        self.options = dict(group_size=group, norm_before_gate=norm_before_gate, activation=activation)
        self.w = torch.randn(hidden, device="cuda", dtype=dtype) * 0.5 + 1

    def forward(self, x, z):
        return gated_rmsnorm_forward(x, z, self.w, EPS, **self.options)

    def backward_call(self, x, z, g):
        _, rstd = self.forward(x, z)
        return lambda: gated_rmsnorm_backward(g, x, z, self.w, rstd, **self.options)


class CakeFlashInferFunctional(Cake):
    """FlashInfer's functional spelling (norm then gate): the forward returns no rstd, so the backward
    recomputes it (one more read of x than ``Cake``'s backward, timed against the same bytes)."""

    name = "cake_cute_functional"

    def __init__(self, hidden, dtype):
        super().__init__(hidden, hidden, True, dtype)
        self.workspace = None

    def forward(self, x, z):
        return cake_rmsnorm_silu_gate_train_forward(x, z, self.w, EPS)

    def backward_call(self, x, z, g):
        if self.workspace is None:  # one instance per shape (``peers``): sized once, for its T
            rows = x.numel() // x.shape[-1]
            self.workspace = cake_rmsnorm_silu_gate_train_backward_workspace(
                rows, x.device, hidden=x.shape[-1]
            )
        return lambda: cake_rmsnorm_silu_gate_train_backward(g, x, z, self.w, EPS, workspace=self.workspace)


class Module:
    """A peer that is an nn.Module taking (x, gate); its backward is autograd's."""

    def __init__(self, name, module):
        self.name, self.module = name, module

    def forward(self, x, z):
        with torch.no_grad():
            return self.module(x, z)

    def backward_call(self, x, z, g):
        x, z = x.detach().requires_grad_(), z.detach().requires_grad_()
        y = self.module(x, z)
        # retain_graph: the timer runs a call again when the host was late the first time.
        return lambda: torch.autograd.grad(y, (x, z, *self.module.parameters()), g, retain_graph=True)


def hf_module(hidden, group, norm_before_gate, dtype, activation=SILU):
    if activation == SIGMOID:  # Kimi Linear's KDA output norm: FP32 throughout, one rounding
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

        return KimiLinearRMSNormGated(hidden, eps=EPS).to("cuda", dtype)
    if norm_before_gate:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

        return Qwen3NextRMSNormGated(hidden, eps=EPS).to("cuda", dtype)
    # Mamba-2's grouped class (NemotronH's, 5.18+, is a copy), renamed Mamba2RMSNormGated in 5.25, which
    # gave it groups; before that, Zamba2's class, the same arithmetic with groups.
    from transformers.models.mamba2 import modeling_mamba2
    from transformers.models.zamba2 import modeling_zamba2

    cls = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_zamba2.Zamba2RMSNormGated
    return cls(hidden, group, eps=EPS).to("cuda", dtype)


def fla_module(hidden, dtype, activation=SILU):
    from fla.modules import FusedRMSNormGated

    return FusedRMSNormGated(hidden, eps=EPS, activation=activation).to("cuda", dtype)


_compiled: dict = {}


def compiled_hf_module(hidden, group, norm_before_gate, dtype, activation=SILU):
    key = (hidden, group, norm_before_gate, dtype, activation)
    if key not in _compiled:
        # The timer's retried backward keeps its graph (``Module.backward_call``), which a compiled
        # backward that donates its buffers refuses.
        torch._functorch.config.donated_buffer = False
        module = hf_module(hidden, group, norm_before_gate, dtype, activation)
        _compiled[key] = torch.compile(module, dynamic=True)
    return _compiled[key]


def peers(hidden, group, norm_before_gate, dtype, activation=SILU) -> list:
    """The implementations timed at one shape; a peer that cannot be built is left out (with a note)."""
    impls = [Cake(hidden, group, norm_before_gate, dtype, activation)]
    if norm_before_gate and activation == SILU:
        impls.append(CakeFlashInferFunctional(hidden, dtype))
    builders = {
        "hf_eager": lambda: hf_module(hidden, group, norm_before_gate, dtype, activation),
        "hf_compiled": lambda: compiled_hf_module(hidden, group, norm_before_gate, dtype, activation),
    }
    if norm_before_gate:
        builders["fla"] = lambda: fla_module(hidden, dtype, activation)
    for name, build in builders.items():
        try:
            impls.append(Module(name, build()))
        except Exception as exc:  # a peer missing or unbuildable here: noted, never fatal
            print(f"{name} left out: {exc!r}", file=sys.stderr)
    return impls


def _sets(rows, hidden, dtype, count):
    return [
        tuple(torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(3)) for _ in range(count)
    ]


def time_impl(timer, impl, inputs, reps) -> dict:
    """Median device times of the forward and the backward, after one untimed call of each (compiles,
    cache loads)."""
    rotation = Rotation(len(inputs))
    impl.forward(*inputs[0][:2])
    impl.backward_call(*inputs[0])()
    forward = timer.device_us(lambda _: impl.forward(*inputs[rotation.next()][:2]), reps)
    backward = timer.device_us(
        lambda call: call(), reps, setup=lambda: impl.backward_call(*inputs[rotation.next()])
    )
    return {"forward": forward, "backward": backward}


def backward_kernels(impl: Cake, inputs, reps) -> dict:
    """Medians over ``reps`` profiled backward calls: the row kernel's duration and the tail after it."""
    rotation = Rotation(len(inputs))
    calls = [impl.backward_call(*inputs[rotation.next()]) for _ in range(reps)]
    torch.cuda.synchronize()

    def run_calls():
        for call in calls:
            call()

    events = sorted(gpu_events(torch, run_calls), key=lambda e: e.time_range.start)
    if len(events) != 2 * reps:
        raise RuntimeError(f"expected two kernels per backward call, profiled {len(events)} for {reps}")
    rows, finish = events[0::2], events[1::2]
    return {
        "row_kernel_us": statistics.median(e.time_range.elapsed_us() for e in rows),
        "tail_us": statistics.median(f.time_range.end - r.time_range.end for r, f in zip(rows, finish)),
    }


def run_kernels(dtype, reps, activations) -> list[dict]:
    """``--kernels``: the backward's row kernel and tail against the copy kernel, head-dim shapes."""
    timer = DeviceTimer(torch, torch.device("cuda"))
    element = torch.tensor([], dtype=dtype).element_size()
    rows_out = []
    for rows, hidden, group, norm_before_gate, activation in shapes(activations):
        if not norm_before_gate:
            continue
        inputs = _sets(rows, hidden, dtype, buffer_sets_for(3 * rows * hidden * element, timer.l2_bytes))
        impl = Cake(hidden, group, norm_before_gate, dtype, activation)
        impl.backward_call(*inputs[0])()
        copy = timer.copy_ceiling(nbytes("backward", rows, hidden, group, element), reps, kernel_time=True)
        split = backward_kernels(impl, inputs, reps)
        row = {"impl": impl.name, "op": "backward", "activation": activation, "rows": rows, "hidden": hidden}
        row["dtype"] = str(dtype).removeprefix("torch.")
        row |= {k: round(us, 2) for k, us in split.items()}
        row["copy_kernel_us"] = copy["copy_kernel_us"]
        row["row_kernel_fraction_of_copy"] = round(copy["copy_kernel_us"] / split["row_kernel_us"], 3)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows_out


def run(dtype, reps, activations) -> list[dict]:
    timer = DeviceTimer(torch, torch.device("cuda"))
    element = torch.tensor([], dtype=dtype).element_size()
    rows_out = []
    for rows, hidden, group, norm_before_gate, activation in shapes(activations):
        set_bytes = 3 * rows * hidden * element
        inputs = _sets(rows, hidden, dtype, buffer_sets_for(set_bytes, timer.l2_bytes))
        copies = {
            op: timer.copy_ceiling(nbytes(op, rows, hidden, group, element), reps)["copy_gpu_us"]
            for op in ("forward", "backward")
        }
        for impl in peers(hidden, group, norm_before_gate, dtype, activation):
            try:
                times = time_impl(timer, impl, inputs, reps)
            except Exception as exc:  # a peer failing at one shape is a row with its error
                failure = {"impl": impl.name, "activation": activation, "rows": rows, "hidden": hidden}
                rows_out.append(failure | {"error": repr(exc)})
                continue
            for op, us in times.items():
                row = {
                    "impl": impl.name,
                    "op": op,
                    "form": "norm_then_gate" if norm_before_gate else "gate_then_norm",
                    "activation": activation,
                    "rows": rows,
                    "hidden": hidden,
                    "group_size": group,
                    "dtype": str(dtype).removeprefix("torch."),
                    "us": round(us, 2),
                    "copy_us": round(copies[op], 2),
                    "fraction_of_copy": round(copies[op] / us, 3),
                }
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows_out


def _activations(text: str) -> list[str]:
    names = text.split(",")
    if unknown := [name for name in names if name not in GATE_ACTIVATIONS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}, expected a subset of {GATE_ACTIVATIONS}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where the JSON results go")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per median")
    parser.add_argument("--kernels", action="store_true", help="the backward's kernels against a copy kernel")
    parser.add_argument(
        "--activations",
        type=_activations,
        default=list(GATE_ACTIVATIONS),
        help="gate activations to time, comma-separated (default silu,sigmoid)",
    )
    args = parser.parse_args(argv)
    dtype = torch_dtype(args.dtype)
    results = (run_kernels if args.kernels else run)(dtype, args.reps, args.activations)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    args.output.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
