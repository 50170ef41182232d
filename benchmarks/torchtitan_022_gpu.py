#!/usr/bin/env python
"""``python benchmarks/torchtitan_022_gpu.py [--device cuda] [--flavor debugmodel] [--steps 10]
[--batch 4] [--seq 2048] [--precision autocast] [--impls stock,cake_cute,cake_cute_memory_efficient,liger]
[--out OUT.json]``:
torchtitan 0.2.x's llama3 model on one device (the path for torch versions torchtitan 0.3 does not
import with), one row per RMSNorm, run in this order:

* ``stock``: torchtitan's ``torch.nn.RMSNorm``;
* ``cake_cute``: the model converter ``cake_rmsnorm`` of ``cake_cute.integrations.torchtitan``;
* ``cake_cute_memory_efficient``: its converter ``cake_rmsnorm_memory_efficient`` (the norms save their
  output instead of their input);
* ``liger``: each stock norm replaced by Liger-Kernel's ``LigerRMSNorm`` with the same eps and weight
  Parameter (its settings are ``LIGER`` below, written into the results); only where ``liger_kernel``
  imports and the device is CUDA, else skipped with the reason printed.

``--flavor`` is one of torchtitan's llama3 flavors or ``1B``, a Llama-3.2-1B-shaped model (dim 2048,
16 layers, 32 heads, 8 key/value heads, vocabulary 128256, FFN hidden 8192; untied output). Each model
is built on the meta device with ``max_seq_len`` set to ``--seq`` and initialized by ``init_weights``
from one seed, as 0.2.x's trainer does; then ``--steps`` AdamW steps on the same token batches, in
torchtitan's mixed precision of one of its two set-ups (``--precision``):

* ``autocast`` (its single-device and DDP runs): FP32 weights, the step under bf16 autocast. The norms
  then read and write the FP32 residual stream, and each Linear keeps its own bf16 copy of its input;
* ``fsdp`` (its FSDP2 runs, torchtitan's default beyond one GPU): torchtitan's own ``apply_fsdp`` with
  bf16 parameters and FP32 gradient reduction, over a one-rank mesh (one process), no autocast. The
  activations are bf16 and the norm's output is the tensor the next Linear keeps.

Per row: the loss curve, its largest relative difference from stock's, the median step time (the
first step, the warm-up, left out), the peak allocated memory from the build on (``peak_gib``) and over
the steps after the first (``steps_peak_gib``, optimizer states included).
Rows run one after the other in one process; each row's model and optimizer are freed before the next.
``--out`` is rewritten after every row.

``--device cpu`` is a check of the script and the converters where there is no GPU (cake_cute's CPU
path, with CPU autocast to bf16 as on the GPU; Liger skipped, peak memory null); its step times say
nothing about the kernels. Where torchtitan 0.2.x is not installed, ``bash
benchmarks/torchtitan_022_kit.sh`` fetches it and what its llama3 package imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchtitan
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args
from torchtitan.models.llama3.infra.parallelize import apply_fsdp
from torchtitan.protocols.model_converter import _registry_model_converter_cls as converters

import cake_cute.integrations.torchtitan  # noqa: F401  (registers the converters)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import write_results  # noqa: E402

# The order the rows run in: stock first (the others compare to it), the peer last (a failure of its
# kernels then costs no cake_cute row).
IMPLS = ("stock", "cake_cute", "cake_cute_memory_efficient", "liger")
CONVERTERS = {"cake_cute": "cake_rmsnorm", "cake_cute_memory_efficient": "cake_rmsnorm_memory_efficient"}
# torch.nn.RMSNorm scales in FP32 and rounds once: Liger's "gemma" casting with no offset (the norms'
# inputs here are the FP32 residual stream, where every casting mode computes the same). in_place is
# Liger's default (dX overwrites dY): every norm output here feeds Linears only, so dY is a gradient
# no other node reads.
LIGER = {"offset": 0.0, "casting_mode": "gemma", "in_place": True}
PRECISIONS = {
    "autocast": "FP32 weights, bf16 autocast (torchtitan's single-device mixed precision)",
    "fsdp": "torchtitan's apply_fsdp on a one-rank mesh: bf16 parameters, FP32 reduction, no autocast",
}
FLAVORS = {
    **llama3_args,
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
    ),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    """The peak allocated memory since the last reset; None on CPU, where torch keeps no statistics."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _skip_reason(impl: str, device: torch.device) -> str | None:
    """Why the row ``impl`` cannot run here, or None."""
    if impl != "liger":
        return None
    if device.type != "cuda":
        return "Liger's kernels are Triton kernels for CUDA devices"
    try:
        import liger_kernel.transformers.rms_norm  # noqa: F401
    except ImportError as error:
        return f"liger_kernel does not import: {error}"
    return None


def _to_liger(model: torch.nn.Module) -> None:
    """Every ``torch.nn.RMSNorm`` of ``model`` becomes a ``LigerRMSNorm`` holding its weight Parameter,
    with the ``reset_parameters`` through which torchtitan's ``init_weights`` initializes a norm."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    class InitializedLigerRMSNorm(LigerRMSNorm):
        def reset_parameters(self) -> None:
            torch.nn.init.ones_(self.weight)

    for parent in list(model.modules()):
        for name, norm in list(parent.named_children()):
            if type(norm) is torch.nn.RMSNorm:
                liger = InitializedLigerRMSNorm(norm.weight.numel(), eps=norm.eps, **LIGER)
                liger.weight = norm.weight
                setattr(parent, name, liger)


def _model(args: TransformerModelArgs, impl: str, options) -> torch.nn.Module:
    """The model of row ``impl`` in torchtitan's order: built on the meta device, its norms swapped,
    sharded (``--precision fsdp``), materialized and initialized."""
    with torch.device("meta"):
        model = Transformer(args)
    if impl in CONVERTERS:
        converters[CONVERTERS[impl]](None, None).convert(model)
    elif impl == "liger":
        _to_liger(model)
    if options.precision == "fsdp":
        mesh = init_device_mesh(options.device.type, (1,), mesh_dim_names=("dp_shard",))
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=options.device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def _train(args: TransformerModelArgs, impl: str, options) -> dict:
    """The row of ``impl``: loss of each step, median step time (steps after the first), peak memory."""
    device = options.device
    _reset_peak(device)
    model = _model(args, impl, options)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=options.precision == "autocast")
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    generator = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(options.steps):
        tokens = torch.randint(0, args.vocab_size, (options.batch, options.seq + 1), generator=generator)
        tokens = tokens.to(device)
        _sync(device)
        start = time.perf_counter()
        with autocast:  # FP32 weights (RoPE's complex buffer stays exact)
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        del logits, loss  # not held into the next step (2 GiB of bf16 logits at the 1B shape)
        if step == 0:  # the peak so far covers the build and the warm-up; the steps' own starts here
            build_peak = _peak_gib(device)
            _reset_peak(device)
    steps_peak = _peak_gib(device)
    return {
        "norm": impl,
        "loss": losses,
        "median_step_s": statistics.median(times[1:]),
        "peak_gib": None if steps_peak is None else max(build_peak, steps_peak),
        "steps_peak_gib": steps_peak,
    }


def _free(device: torch.device) -> None:
    """Free what the finished row left (reference cycles included) and return the allocator's cached
    blocks, so that the next row starts from the memory the process held before any row."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _max_rel_diff(loss: list[float], stock: list[float]) -> float:
    return max(abs(s - x) / abs(s) for s, x in zip(stock, loss))


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GiB"


def _print_row(row: dict) -> None:
    diff = row["max_rel_diff_vs_stock"]
    print(
        f"{row['norm']:>26} median step {row['median_step_s'] * 1e3:.2f} ms, peak {_gib(row['peak_gib'])} "
        f"(steps {_gib(row['steps_peak_gib'])}), loss vs stock "
        + ("n/a" if diff is None else f"{diff:.3e}")
        + ", loss "
        + " ".join(f"{x:.6f}" for x in row["loss"])
    )


def _impls(text: str) -> list[str]:
    """The rows named in ``--impls``, in the order of ``IMPLS``."""
    names = set(text.split(","))
    unknown = names - set(IMPLS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(sorted(unknown))} (expected {', '.join(IMPLS)})"
        )
    return [impl for impl in IMPLS if impl in names]


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"), help="cuda or cpu")
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    parser.add_argument("--steps", type=int, default=10, help="at least 2 (the first is not timed)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--precision",
        choices=("autocast", "fsdp"),
        default="autocast",
        help="torchtitan's single-device bf16 autocast, or its FSDP2 bf16 parameters (one rank)",
    )
    parser.add_argument(
        "--impls", type=_impls, default=list(IMPLS), help="comma-separated rows (default all)"
    )
    parser.add_argument("--out", type=Path, help="the results document (benchmarks/results_doc.py)")
    options = parser.parse_args()
    if options.device.type not in ("cuda", "cpu"):
        parser.error(f"--device: expected cuda or cpu, got {options.device}")
    if options.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--device cpu checks the script)")
    if options.steps < 2:
        parser.error(f"--steps: expected at least 2, got {options.steps}")
    return options


def _write(options, args: TransformerModelArgs, rows: list[dict], skipped: dict[str, str]) -> None:
    device = options.device
    write_results(
        options.out,
        "benchmarks/torchtitan_022_gpu.py",
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        rows,
        torchtitan=torchtitan.__version__,
        model=f"llama3 {options.flavor}, AdamW lr 8e-4",
        precision=PRECISIONS[options.precision],
        model_args={k: v for k, v in dataclasses.asdict(args).items() if k != "_enforced"},
        liger=LIGER,
        skipped=skipped,
        steps=options.steps,
        batch=options.batch,
        seq=options.seq,
    )


def main() -> None:
    options = _options()
    device = options.device
    if options.precision == "fsdp":  # one rank: its collectives are local copies
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)
        dist.init_process_group(backend, store=dist.HashStore(), world_size=1, rank=0)
    # The trainer sets max_seq_len to the training sequence length (RoPE's table is that long).
    args = dataclasses.replace(FLAVORS[options.flavor], max_seq_len=options.seq)
    rows, skipped, stock = [], {}, None
    for impl in options.impls:
        reason = _skip_reason(impl, device)
        if reason is not None:
            skipped[impl] = reason
            print(f"{impl:>26} skipped: {reason}")
        else:
            row = _train(args, impl, options)
            _free(device)
            if impl == "stock":
                stock = row["loss"]
            row["max_rel_diff_vs_stock"] = None if stock is None else _max_rel_diff(row["loss"], stock)
            rows.append(row)
            _print_row(row)
        if options.out:  # after every row: a row that fails keeps those before it
            _write(options, args, rows, skipped)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
