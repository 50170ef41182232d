#!/usr/bin/env python
"""``python perf/torchtitan_022_gpu.py [--flavor debugmodel] [--steps 10] [--out OUT.json]``: torchtitan
0.2.x's llama3 model on one CUDA GPU, stock ``torch.nn.RMSNorm`` against the model converter
``cake_rmsnorm`` of ``cake_cute.integrations.torchtitan`` (the path for torch versions torchtitan 0.3
does not import with). Both models are built on the meta device and initialized by ``init_weights``
from one seed, as 0.2.x's trainer does; then ``--steps`` AdamW steps under bf16 autocast on the same
token batches. Prints (and writes) the two loss curves, their largest relative difference and the
median step time of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchtitan.models.llama3 import Transformer, llama3_args
from torchtitan.protocols.model_converter import _registry_model_converter_cls as converters

import cake_cute.integrations.torchtitan  # noqa: F401  (registers the converter "cake_rmsnorm")


def _model(args, cake: bool) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(args)
    if cake:
        converters["cake_rmsnorm"](None, None).convert(model)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def _train(args, cake: bool, steps: int, batch: int, seq: int) -> tuple[list[float], float]:
    model = _model(args, cake)
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    generator = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=generator).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):  # FP32 weights (RoPE's complex buffer stays exact)
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    args = llama3_args[options.flavor]
    rows = {}
    for name, cake in (("stock", False), ("cake_cute", True)):
        loss, step_s = _train(args, cake, options.steps, options.batch, options.seq)
        rows[name] = {"loss": loss, "median_step_s": step_s}
    stock, cake = rows["stock"]["loss"], rows["cake_cute"]["loss"]
    rows["max_rel_diff"] = max(abs(s - c) / abs(s) for s, c in zip(stock, cake))
    rows["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(rows, indent=1))
    if options.out:
        options.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
