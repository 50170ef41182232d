#!/usr/bin/env python
"""``python benchmarks/megatron_train.py OUT.json``: Megatron-Core's own training loop on a GPT with the stock
local spec and with cake_cute's spec, from the same seed: loss curves step by step, median step time and
peak memory, and the stock spec run twice and with its norms compiled (its own spread: the bound a curve
is judged by).

The loop is that of Megatron-LM's ``examples/run_simple_mcore_train_loop.py`` with Megatron-LM's training
defaults for bf16: ``GPTModel`` in ``Float16Module``, Megatron's ``DistributedDataParallel`` (FP32 gradient
buffers, distributed optimizer), ``get_megatron_optimizer`` (Adam, bf16, gradient clipping 1.0),
``get_forward_backward_func`` and ``finalize_model_grads``, on a NCCL group of world size 1.
The batches are MockGPTDataset-shaped (random tokens from a seeded generator, labels the next token, a
full loss mask): every run sees the same batches without Megatron's dataset helpers or a tokenizer.

Runs (``--runs``): ``stock`` (``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``, the local
spec with RMSNorm: ``torch.nn.RMSNorm`` where Apex is absent), ``stock-again``, ``stock-compiled-norms``
(the stock norms under ``torch.compile``: with ``stock-again``, the bound a curve is judged by), ``cake``
(``cake_cute.integrations.megatron.get_gpt_decoder_block_spec``: the input, pre-MLP, q/k and final norms)
and ``cake-fused-residual`` (the same with ``fused_residual_rmsnorm``; Megatron-Core 0.17+, else recorded
as skipped). Every run has q/k norms (``qk_layernorm``). Default shape: 8 layers, H = 2048, 16 heads,
SwiGLU of 5632, sequence 4096, micro-batch 1, vocabulary 32768, 50 steps; the step time is the median
over the steps after ``--warmup`` (which include the kernels' compilation), the peak memory the CUDA
allocator's peak over the run.

``--device cpu`` (with e.g. ``--layers 2 --hidden 64 --heads 4 --seq 32 --steps 3``) runs the same loop
on a gloo group on the CPU to check the script end to end (``megatron_cpu.py`` stands in for the CUDA
calls Megatron makes; Megatron's schedule and optimizer allocate on CUDA, so a one-microbatch schedule
and torch's Adam take their places there; host clock, no peak memory).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RUNS = ("stock", "stock-again", "stock-compiled-norms", "cake", "cake-fused-residual")
SEED = 1234


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the JSON report goes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=None, help="SwiGLU width (default: 2.75 H, 5632 at 2048)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    args = parser.parse_args(argv)
    args.runs = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)}; expected names from {', '.join(RUNS)}")
    args.ffn = args.ffn or int(args.hidden * 2.75)
    args.warmup = min(args.warmup, max(args.steps - 1, 0))
    return args


def start(device: str) -> bool:
    """A process group of world size 1 and Megatron's parallel state (TP = PP = 1). Returns whether the
    CPU stand-ins are in use."""
    import os

    from megatron.core import parallel_state

    if device == "cpu":
        import megatron_cpu

        megatron_cpu.initialize_megatron_on_cpu()
        return True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    return False


def transformer_config(args, fused_residual: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # Megatron's fused kernels come from Apex / TE or jit-compiled functions: off for every run alike.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=args.device == "cpu",
    )
    if fused_residual:
        fields["fused_residual_rmsnorm"] = True
    return TransformerConfig(**fields)


def has_fused_residual_layer() -> bool:
    """TransformerLayer accepts (output, residual) from a norm from Megatron-Core 0.17 on, the version
    that added ``fused_residual_rmsnorm``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "fused_residual_rmsnorm" in TransformerConfig.__dataclass_fields__


def block_spec(name: str, config):
    from megatron.core.models.gpt import gpt_layer_specs

    from cake_cute.integrations import megatron as cake_megatron

    if name.startswith("stock"):
        return gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
    return cake_megatron.get_gpt_decoder_block_spec(config, use_transformer_engine=False)


def seed_everything(device: str) -> None:
    torch.manual_seed(SEED)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)


class CpuAdam:
    """The CPU smoke run's optimizer: Megatron's mixed-precision optimizers allocate on ``"cuda"``
    (``optimizer.py``), so torch's Adam steps the bf16 parameters with the FP32 gradients Megatron's DDP
    accumulated in ``main_grad`` (clipped to norm 1.0), behind the optimizer's step/zero_grad calls."""

    def __init__(self, model, lr: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.adam = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def step(self):
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.adam.step()
        return True, float(grad_norm), None


def optimizer_for(args, model):
    """Megatron's optimizer as its training setup configures it for bf16 (Adam, FP32 main weights in
    the distributed optimizer, gradient clipping 1.0); ``CpuAdam`` on the CPU."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if args.device == "cpu":
        return CpuAdam(model, args.lr)
    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    return get_megatron_optimizer(config, [model])


def compile_norms(model) -> None:
    """The stock norms under ``torch.compile`` (inductor's generated norm, another rounding of the same
    math as eager's kernel): the stock spec's own compiled-vs-eager spread bounds a norm's curve."""
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.forward = torch.compile(module.forward)


def build(args, name: str):
    """``(model, optimizer)``: GPTModel in Float16Module in Megatron's DDP (FP32 gradient buffers, for the
    distributed optimizer), and the optimizer over it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(args, fused_residual=name == "cake-fused-residual")
    seed_everything(args.device)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(name, config),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if args.device == "cuda":
        model.cuda(torch.cuda.current_device())  # torch.nn.RMSNorm (the stock norm) is built on the CPU
    if name == "stock-compiled-norms":
        compile_norms(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, model))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model, optimizer_for(args, model)


def batch(args, step: int) -> dict:
    """Step ``step``'s micro-batch, the same in every run: MockGPTDataset's fields."""
    generator = torch.Generator().manual_seed(SEED + step)
    text = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator)
    device = torch.device(args.device)
    fields = {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": torch.ones(args.micro_batch, args.seq),
        "position_ids": torch.arange(args.seq).expand(args.micro_batch, args.seq),
    }
    return {key: value.to(device) for key, value in fields.items()}


def forward_step(attention_mask, data_iterator, model):
    """Megatron's forward-step contract: the model's per-token losses and a function reducing them."""
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], attention_mask, labels=data["labels"])

    def loss_func(loss_mask, output_tensor):
        mask = loss_mask.view(-1).float()
        loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss.detach()}

    return output, partial(loss_func, data["loss_mask"])


def cpu_forward_backward(*, forward_step_func, data_iterator, model, **_):
    """The CPU smoke run's schedule: Megatron's (``schedules.py``) counts tokens in a tensor it puts on
    ``"cuda"``; this is its one-microbatch path (forward step, loss, backward, ``finalize_model_grads``)
    without that count."""
    (chunk,) = model
    output, loss_func = forward_step_func(data_iterator, chunk)
    loss, reduced = loss_func(output)
    loss.backward()
    chunk.config.finalize_model_grads_func(model)
    return [reduced]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release_memory(device: str) -> None:
    """Free what earlier runs left (Megatron's config holds the DDP model through ``no_sync_func``: a
    reference cycle that only the collector frees)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def parameter_checksum(model) -> float:
    """The FP64 sum of every parameter: equal across runs when they start from the same weights."""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def run_steps(args, model, optimizer, attention_mask, forward_backward, name: str):
    """``(losses, step_ms)`` of ``args.steps`` training steps."""
    losses, step_ms = [], []
    for step in range(args.steps):
        synchronize(args.device)
        begin = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=partial(forward_step, attention_mask),
            data_iterator=iter([batch(args, step)]),
            model=[model],
            num_microbatches=1,
            seq_length=args.seq,
            micro_batch_size=args.micro_batch,
            decoder_seq_length=args.seq,
            forward_only=False,
        )
        update_successful, _, _ = optimizer.step()
        synchronize(args.device)
        step_ms.append((time.perf_counter() - begin) * 1e3)
        if not update_successful:
            raise RuntimeError(f"{name}: the optimizer skipped step {step}")
        losses.append(float(reduced[0]["lm loss"]))
    return losses, step_ms


def train(args, name: str, cpu_shims: bool) -> dict:
    """One run: build, train ``args.steps`` steps, and report losses, times and peak memory."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    if name == "cake-fused-residual" and not has_fused_residual_layer():
        return {"name": name, "skipped": "fused_residual_rmsnorm needs Megatron-Core 0.17+"}
    release_memory(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, optimizer = build(args, name)
    checksum = parameter_checksum(model)
    if cpu_shims:
        import megatron_cpu

        attention_mask = megatron_cpu.causal_mask(args.seq).to(args.device)
        forward_backward = cpu_forward_backward
    else:
        attention_mask = None  # Megatron's local attention builds its causal mask on the GPU
        forward_backward = get_forward_backward_func()
    losses, step_ms = run_steps(args, model, optimizer, attention_mask, forward_backward, name)
    return {
        "name": name,
        "norm_classes": sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__}),
        "init_checksum": checksum,
        "losses": losses,
        "step_ms": step_ms,
        "median_step_ms": statistics.median(step_ms[args.warmup :]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
    }


def max_difference(losses, reference) -> float:
    return max(abs(a - b) for a, b in zip(losses, reference))


def environment(args) -> dict:
    from importlib.metadata import version

    import cake_cute

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    return {
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "cake_cute": cake_cute.__version__,
        "python": sys.version.split()[0],
        "gpu": gpu,
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "ffn": args.ffn,
            "seq": args.seq,
            "micro_batch": args.micro_batch,
            "vocab": args.vocab,
            "steps": args.steps,
        },
    }


def print_table(report: dict) -> None:
    """One line per run: first and last loss, the largest loss difference from the stock run over all
    steps, whether the run started from the stock run's weights, median step time, peak memory."""
    runs = [run for run in report["runs"] if "losses" in run]
    stock = next((run for run in runs if run["name"] == "stock"), None)
    header = [("first loss", 12), ("last loss", 12), ("max |d| vs stock", 18), ("same init", 11)]
    header += [("median ms", 11), ("peak GiB", 10)]
    print(f"{'run':<22}" + "".join(f"{title:>{width}}" for title, width in header))
    for run in report["runs"]:
        if "skipped" in run:
            print(f"{run['name']:<22}skipped: {run['skipped']}")
            continue
        diff = same = ""
        if stock is not None:
            diff = f"{max_difference(run['losses'], stock['losses']):.3e}"
            same = "yes" if run["init_checksum"] == stock["init_checksum"] else "NO"
        peak = "" if run["peak_gib"] is None else f"{run['peak_gib']:.2f}"
        print(
            f"{run['name']:<22}{run['losses'][0]:>12.5f}{run['losses'][-1]:>12.5f}{diff:>18}{same:>11}"
            f"{run['median_step_ms']:>11.2f}{peak:>10}"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    cpu_shims = start(args.device)
    report = {"environment": environment(args), "runs": []}
    with contextlib.ExitStack() as stack:
        if cpu_shims:
            import megatron_cpu

            stack.enter_context(megatron_cpu.cuda_calls_on_cpu())
        print(json.dumps(report["environment"]), flush=True)
        for name in args.runs:
            begin = time.perf_counter()
            run = train(args, name, cpu_shims)
            report["runs"].append(run)
            args.out.write_text(json.dumps(report, indent=1))  # a partial report survives a later failure
            done = run.get("skipped") or f"median step {run['median_step_ms']:.2f} ms"
            print(f"{name}: {done} ({time.perf_counter() - begin:.0f} s in all)", flush=True)
    print_table(report)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
