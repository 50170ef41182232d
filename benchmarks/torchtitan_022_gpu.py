#!/usr/bin/env python
"""``python benchmarks/torchtitan_022_gpu.py [--device cuda] [--flavor debugmodel] [--steps 10]
[--out OUT.json]``:
torchtitan 0.2.x's llama3 model on one device, stock ``torch.nn.RMSNorm`` against the model converter
``cake_rmsnorm`` of ``cake_cute.integrations.torchtitan`` (the path for torch versions torchtitan 0.3
does not import with). Both models are built on the meta device and initialized by ``init_weights``
from one seed, as 0.2.x's trainer does; then ``--steps`` AdamW steps under bf16 autocast on the same
token batches. Prints (and writes) the two loss curves, their largest relative difference and the
median step time of each (the first step, the warm-up, left out).

``--device cpu`` is a check of the script and the converter where there is no GPU (cake_cute's CPU
path, with CPU autocast to bf16 as on the GPU); its step times say nothing about the kernels. Where
torchtitan 0.2.x is not installed, ``bash benchmarks/torchtitan_022_kit.sh`` fetches it and what its llama3
package imports.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchtitan
from torchtitan.models.llama3 import Transformer, llama3_args
from torchtitan.protocols.model_converter import _registry_model_converter_cls as converters

import cake_cute.integrations.torchtitan  # noqa: F401  (registers the converter "cake_rmsnorm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import write_results  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(args, cake: bool, device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(args)
    if cake:
        converters["cake_rmsnorm"](None, None).convert(model)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def _train(args, cake: bool, options) -> tuple[list[float], float]:
    """The loss of each step and the median step time, steps after the first."""
    device = options.device
    model = _model(args, cake, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    generator = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(options.steps):
        tokens = torch.randint(0, args.vocab_size, (options.batch, options.seq + 1), generator=generator)
        tokens = tokens.to(device)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16):  # FP32 weights (RoPE's complex buffer stays exact)
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, statistics.median(times[1:])


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"), help="cuda or cpu")
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(llama3_args))
    parser.add_argument("--steps", type=int, default=10, help="at least 2 (the first is not timed)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path, help="the results document (benchmarks/results_doc.py)")
    options = parser.parse_args()
    if options.device.type not in ("cuda", "cpu"):
        parser.error(f"--device: expected cuda or cpu, got {options.device}")
    if options.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--device cpu checks the script)")
    if options.steps < 2:
        parser.error(f"--steps: expected at least 2, got {options.steps}")
    return options


def main() -> None:
    options = _options()
    args = llama3_args[options.flavor]
    rows = []
    for norm, cake in (("stock", False), ("cake_cute", True)):
        loss, step_s = _train(args, cake, options)
        rows.append({"norm": norm, "loss": loss, "median_step_s": step_s})
        print(f"{norm:>9} median step {step_s * 1e3:.2f} ms, loss " + " ".join(f"{x:.6f}" for x in loss))
    stock, cake = rows[0]["loss"], rows[1]["loss"]
    max_rel_diff = max(abs(s - c) / abs(s) for s, c in zip(stock, cake))
    print(f"largest relative difference of the loss, stock against cake_cute: {max_rel_diff:.3e}")
    if options.out:
        device = options.device
        write_results(
            options.out,
            "benchmarks/torchtitan_022_gpu.py",
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            rows,
            torchtitan=torchtitan.__version__,
            model=f"llama3 {options.flavor}, FP32 weights, bf16 autocast, AdamW lr 8e-4",
            steps=options.steps,
            batch=options.batch,
            seq=options.seq,
            max_rel_diff=max_rel_diff,
        )


if __name__ == "__main__":
    main()
