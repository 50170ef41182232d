#!/usr/bin/env python
"""``python benchmarks/megatron_pretrain.py OUT.json --megatron-lm DIR``: Megatron-LM's ``pretrain_gpt.py``
(mock data, ``--transformer-impl local``, bf16, one GPU) for a dense and an MoE GPT, with its own layer
specs and with the cake ``--spec`` objects, one process per run: loss and load-balancing loss per step,
step time, peak memory, and the model each run built (parameter count, initial-weight checksum, norm
classes, MoE layers).

``DIR`` holds Megatron-LM's ``pretrain_gpt.py``, ``gpt_builders.py`` and ``model_provider.py`` of the version
matching the installed megatron-core (the wheel ships ``megatron.training`` but not these repository
files); ``benchmarks/megatron_pretrain_kit.sh`` puts them in ``.device/megatron-lm`` beside the wheel.

Runs: ``--models`` from ``dense`` (8 layers, H = 2048, 16 heads, SwiGLU 5632) and ``moe`` (the same with
``--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2``); ``--specs`` from ``stock`` (no
``--spec``: Megatron-LM's builder picks its local specs for the config), ``cake-layer`` (``--spec
cake_cute.integrations.megatron gpt_layer_spec``) and ``cake-block`` (``gpt_decoder_block_spec``, which
Megatron-LM 0.19's builder calls with the config; before 0.19 the run is recorded as skipped). Every
run: sequence 4096, micro- and global batch 1, vocabulary 32000 (``NullTokenizer``), RoPE, untied
embeddings, Adam (lr 3e-4 constant, clipping 1.0), seed 1234, Megatron's fusions that need Apex or
Transformer Engine off, ``--log-interval 1``. The step time is Megatron's ``elapsed time per iteration``,
its median over the steps after ``--warmup`` (which include the cake kernels' compilation); the peak
memory is the CUDA allocator's peak in the run's process.

Each run's output goes to ``OUT`` 's folder as ``<stem>-<model>-<spec>.log``; a run that fails is
recorded with its return code and the end of its log, and the next run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

MODULE = "cake_cute.integrations.megatron"
SPECS = {
    "stock": [],
    "cake-layer": ["--spec", MODULE, "gpt_layer_spec"],
    "cake-block": ["--spec", MODULE, "gpt_decoder_block_spec"],
}
MODELS = {
    "dense": [],
    "moe": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"],
}
SEED = 1234
# Megatron-LM's builder calls a --spec function with the model config from this version on; before it,
# the function reaches the model uncalled and Megatron refuses it.
CALLS_SPEC_FUNCTIONS = (0, 19)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the JSON report goes (the logs go beside it)")
    parser.add_argument("--megatron-lm", type=Path, required=True, help="folder with pretrain_gpt.py")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}"
    )
    parser.add_argument("--specs", default=",".join(SPECS), help=f"comma-separated, from {', '.join(SPECS)}")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    parser.add_argument("--timeout", type=int, default=240, help="seconds one run may take")
    args = parser.parse_args(argv)
    args.models = _choices(parser, "--models", args.models, MODELS)
    args.specs = _choices(parser, "--specs", args.specs, SPECS)
    if not (args.megatron_lm / "pretrain_gpt.py").is_file():
        parser.error(f"--megatron-lm: no pretrain_gpt.py in {args.megatron_lm}")
    return args


def _choices(parser, flag: str, value: str, known: dict) -> list:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)}; expected names from {', '.join(known)}")
    return names


def pretrain_arguments(args, model: str, spec: str) -> list:
    """``pretrain_gpt.py``'s command line for one run."""
    shape = [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--ffn-hidden-size", str(args.ffn),
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
    ]  # fmt: skip
    common = [
        "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
        "--no-rope-fusion", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--lr", "3e-4", "--min-lr", "3e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
        "--train-iters", str(args.steps), "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", str(args.steps + 1), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "32000", "--seed", str(SEED),
    ]  # fmt: skip
    return shape + common + MODELS[model] + SPECS[spec]


# One iteration line of Megatron's training log: " [date] iteration  N/ M | name: value | ...".
ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|(.*)$")
FIELD = re.compile(r"\s*([^|:]+?):\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))\s*\|")


def parse_iterations(log: str) -> list:
    """Each iteration line's numeric fields (``lm loss``, ``load_balancing_loss``, ``elapsed time per
    iteration (ms)``, ...), in the order logged, with its ``iteration`` number."""
    rows = []
    for line in log.splitlines():
        match = ITERATION.search(line)
        if match:
            fields = {name.strip(): float(value) for name, value in FIELD.findall(match.group(2) + "|")}
            rows.append({"iteration": int(match.group(1)), **fields})
    return rows


def megatron_version() -> tuple:
    from importlib.metadata import version

    return tuple(int(part) for part in re.findall(r"\d+", version("megatron-core"))[:2])


def summarize(rows: list, warmup: int) -> dict:
    """The per-step series a run reports, from its iteration rows."""
    step_ms = [row.get("elapsed time per iteration (ms)") for row in rows]
    timed = [ms for ms in step_ms[warmup:] if ms is not None]
    return {
        "losses": [row.get("lm loss") for row in rows],
        "load_balancing_loss": [row.get("load_balancing_loss") for row in rows],
        "step_ms": step_ms,
        "median_step_ms": statistics.median(timed) if timed else None,
    }


def launch(args, model: str, spec: str) -> dict:
    """One run in a process of its own (``torchrun``, one rank); its log beside the report."""
    name = f"{model}-{spec}"
    if spec == "cake-block" and megatron_version() < CALLS_SPEC_FUNCTIONS:
        return {"name": name, "skipped": "Megatron-LM calls a --spec function from 0.19 on"}
    log_path = args.out.with_name(f"{args.out.stem}-{name}.log")
    facts_path = args.out.with_name(f"{args.out.stem}-{name}.facts.json")
    facts_path.unlink(missing_ok=True)
    pretrain = pretrain_arguments(args, model, spec)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        __file__, "--child", str(facts_path), str(args.megatron_lm), *pretrain,
    ]  # fmt: skip
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    begin = time.perf_counter()
    with log_path.open("w") as log:
        try:
            done = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            returncode = "timeout"
        else:
            returncode = done.returncode
    text = log_path.read_text(errors="replace")
    run = {"name": name, "model": model, "spec": spec, "returncode": returncode, "pretrain_args": pretrain}
    run["wall_s"] = round(time.perf_counter() - begin, 1)
    run.update(summarize(parse_iterations(text), args.warmup))
    if facts_path.is_file():
        run.update(json.loads(facts_path.read_text()))
    if returncode != 0:
        run["log_tail"] = text.splitlines()[-40:]
    return run


# --- the child: pretrain_gpt.py in this process -----------------------------------------------------------


def model_facts(model) -> dict:
    """What a run built: parameter count, the FP64 sum of the initial weights (equal across runs that
    start from the same weights), norm classes, MoE layers, the final norm's class."""
    params = list(model.parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "init_checksum": float(sum(p.detach().double().sum() for p in params)),
        "norm_classes": dict(
            Counter(type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__)
        ),
        "moe_layers": sum(bool(getattr(layer, "is_moe_layer", False)) for layer in model.decoder.layers),
        "final_norm": type(model.decoder.final_layernorm).__name__,
    }


def record_built_models(facts: list) -> None:
    """Append ``model_facts`` of each ``GPTModel`` once constructed."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    init = GPTModel.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        facts.append(model_facts(self))

    GPTModel.__init__ = recording_init


def use_shipped_dataset_helpers() -> None:
    """Megatron-LM's initialization builds the dataset index helpers with ``make`` in megatron-core's
    folder, which the wheel ships compiled but without the Makefile: where the compiled module imports,
    that step is skipped."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None


def run_child(facts_path: Path, megatron_lm: Path, pretrain: list) -> None:
    """``pretrain_gpt.py`` with ``pretrain``, then the built model's facts and the peak memory into
    ``facts_path`` (also after a failure)."""
    import torch

    script = megatron_lm / "pretrain_gpt.py"
    sys.path.insert(0, str(megatron_lm))
    sys.argv = [str(script), *pretrain]
    built: list = []
    record_built_models(built)
    use_shipped_dataset_helpers()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        cuda = torch.cuda.is_available()
        facts = {
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "gpu": torch.cuda.get_device_name() if cuda else None,
        }
        facts.update(built[0] if built else {})
        facts_path.write_text(json.dumps(facts))


# --- the report -----------------------------------------------------------------------------------------


def environment() -> dict:
    from importlib.metadata import version

    import torch

    import cake_cute

    return {
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "cake_cute": cake_cute.__version__,
        "python": sys.version.split()[0],
    }


def print_table(report: dict) -> None:
    """One line per run: parameters, same initial weights as the model's stock run, first and last
    loss, last load-balancing loss, median step time, peak memory."""
    runs = report["runs"]
    stock = {run["model"]: run for run in runs if run.get("spec") == "stock" and "parameters" in run}
    print(f"{'run':<18}{'rc':>8}{'params':>15}{'same init':>11}{'loss 0':>10}{'loss -1':>10}"
          f"{'lb loss -1':>12}{'ms':>9}{'GiB':>8}")  # fmt: skip
    for run in runs:
        if "skipped" in run:
            print(f"{run['name']:<18}skipped: {run['skipped']}")
            continue
        base = stock.get(run["model"])
        same = ""
        if base is not None and "init_checksum" in run:
            same = str(run["init_checksum"] == base["init_checksum"])
        losses = [loss for loss in run["losses"] if loss is not None] or [float("nan")]
        balance = [loss for loss in run["load_balancing_loss"] if loss is not None]
        cells = [
            f"{run['returncode']!s:>8}", f"{run.get('parameters', ''):>15}", f"{same:>11}",
            f"{losses[0]:>10.4f}", f"{losses[-1]:>10.4f}", f"{balance[-1] if balance else '':>12}",
            f"{run['median_step_ms'] or float('nan'):>9.1f}", f"{run.get('peak_gib') or float('nan'):>8.2f}",
        ]  # fmt: skip
        print(f"{run['name']:<18}" + "".join(cells))


def main(argv=None) -> None:
    args = parse_args(argv)
    report = {"environment": environment(), "runs": []}
    for model in args.models:
        for spec in args.specs:
            run = launch(args, model, spec)
            report["runs"].append(run)
            args.out.write_text(json.dumps(report, indent=1))  # a partial report survives a later failure
            print(f"{run['name']}: {run.get('skipped') or run['returncode']}", flush=True)
    print_table(report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        run_child(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
    else:
        main()
