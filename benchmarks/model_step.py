#!/usr/bin/env python
"""``python benchmarks/model_step.py OUT.json``: what a Llama-style model's training step (forward + loss +
backward, bf16) costs with each RMSNorm, eager and under ``torch.compile``, in one process.

Shapes: 4 layers at H = 2048 and at H = 4096, 8192 tokens (batch 4 x sequence 2048). ``--model qwen3``
builds Hugging Face's ``Qwen3ForCausalLM`` instead: grouped-query attention (H / head_dim heads,
``--head-dim`` 128 by default, 8 key/value heads), a q and a k norm over every head (T * heads rows of
head_dim), RoPE and a SwiGLU of 3 H. Implementations (peers skipped when they do not import):

* ``torch``: every RMSNorm is ``torch.nn.RMSNorm`` (the residual adds are the model's own);
* ``cake_cute``: ``fuse_residual_rmsnorm(model)``, every residual add done by the norm
  that follows it (``cake_cute_unfused``, on request: ``swap_rmsnorm(model)`` alone); compiled with
  ``cake_cute.graph_passes.gradient_sum_pass`` (the q/k/v and gate/up dgrads summed by the norm's
  backward) unless ``--no-gradient-sums``. Its per-head q / k norms follow swap_rmsnorm's default rule:
  the kernel in eager, their PyTorch math (fused by inductor with the reshape and RoPE around them)
  under ``torch.compile``;
* ``liger`` / ``quack``: every RMSNorm calls that library's RMSNorm (the adapters of
  ``cake_cute.tools.bench.peers``, patched on the instances so nothing global changes between
  implementations);
* ``cake_cute_memory_efficient`` (on request): ``cake_cute`` with ``memory_efficient=True``, the norms
  saving their output (which the next Linear keeps) instead of their input;
* ``cake_cute_qk_kernel`` (Qwen3 default, else on request): ``cake_cute`` with
  ``compiled_head_norms="kernel"``, the per-head q / k norms the kernel under ``torch.compile`` too (a
  custom op, which inductor cannot fuse with its neighbours): the other side of the rule. In eager it
  is ``cake_cute``.

``--route`` runs Hugging Face's own kernel route instead (``set_use_kernels(True, kernel_config=...,
mode=Mode.TRAINING``, ``| Mode.TORCH_COMPILE`` when compiled: what ``from_pretrained(use_kernels=True)``
does), every norm decorated ``"RMSNorm"`` replaced by a kernel layer and nothing else changed:

* ``hf``: the model's own RMSNorm modules (stock);
* ``kernels_cake_cute``: ``cake_cute.hf_kernel_config(model)``, cake_cute's layers (the kernel for
  every norm, the per-head ones included, eager and compiled; no residual fused);
* ``kernels_liger``: the route's default mapping sends "RMSNorm" to the Hub's
  ``kernels-community/liger-kernels`` ``LigerRMSNorm``, which needs the network; its stand-in is the
  installed liger-kernel's ``LigerRMSNormFunction`` (defaults: no offset, Llama casts, in place) in a
  ``LigerRMSNorm`` layer of a local repository written at run time, mapped for every mode as the
  default mapping maps Liger's (``CakeKernelConfig`` serves any local layer that way).

A route run checks that every decorated norm runs the mapped layer (the route falls back to the stock
forward silently when a layer does not load or match).

The model is Hugging Face's ``LlamaForCausalLM`` (sdpa attention, loss from ``labels=``) when
transformers imports, else the Llama of ``tests/distributed_harness/model.py`` (its fused-residual blocks for
cake_cute; Llama only). Every implementation starts from the same seed. A step is timed with CUDA events after
``--warmup`` steps (which include the compile), median over ``--steps``; ``peak_gib`` is the peak
allocated memory over the timed steps. ``--device cpu --tiny`` runs a tiny model on CPU (host clock,
no peak memory) to check the script end to end. ``--hidden 2048`` runs one of the shapes and
``--append`` keeps OUT's rows, so a long run can be split over several commands into one file.
``--seq N`` shortens the sequences (batch 4 x N tokens): at a few hundred tokens a step is host-bound,
which is where the gradient-sum pass's host cost shows (``--no-gradient-sums`` for the A/B).
``--optimizer adamw`` makes the step a training step: ``torch.optim.AdamW`` (its default foreach
implementation, states in the parameters' bf16) steps after the backward, inside the timed step and
the peak memory.
``--profile DIR`` writes, per run, every kernel of a step with its time (torch.profiler), longest
first: where two implementations' steps differ. ``--compile-scope layers`` compiles each decoder layer
(``nn.Module.compile``: one inductor compile serves every layer) instead of the whole model, which
keeps a compiled run's warm-up to seconds; the embedding, the LM head and the loss then run eager, for
every implementation alike. The results file is rewritten after every run.

Rows: ``{impl, mode, layers, H, tokens, step_ms, peak_gib}``, plus ``model`` and ``compile_scope``
(and, for Qwen3, ``head_dim``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_doc import kept_rows, write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402

IMPLS = ("torch", "cake_cute", "liger", "quack")
QWEN3_IMPLS = ("torch", "cake_cute", "cake_cute_qk_kernel", "liger", "quack")
ROUTE_IMPLS = ("hf", "kernels_liger", "kernels_cake_cute")
ALL_IMPLS = (*IMPLS, "cake_cute_unfused", "cake_cute_qk_kernel", "cake_cute_memory_efficient", *ROUTE_IMPLS)
MODELS = ("llama", "qwen3")
EPS = 1e-5
QWEN3_HEAD_DIM = 128
QWEN3_KV_HEADS = 8


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    batch: int
    seq: int
    vocab: int = 32000
    model: str = "llama"
    head_dim: int = 128

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def heads(self) -> int:
        return max(1, self.hidden // self.head_dim)

    @property
    def kv_heads(self) -> int:
        """Llama: every head its own key/value head; Qwen3: grouped-query attention, at most
        ``QWEN3_KV_HEADS`` key/value heads and at least two query heads to each."""
        if self.model == "llama":
            return self.heads
        return min(QWEN3_KV_HEADS, max(1, self.heads // 2))

    @property
    def ffn(self) -> int:
        """The SwiGLU width: Llama's 8/3 H rounded up to a multiple of 256; Qwen3's 3 H."""
        if self.model == "qwen3":
            return 3 * self.hidden
        return -(-8 * self.hidden // 3 // 256) * 256


# tests/distributed_harness/model.py's Config field -> transformers.LlamaConfig's
_HF_NAMES = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "ffn": "intermediate_size",
}
FULL_SHAPES = (Shape(4, 2048, 4, 2048), Shape(4, 4096, 4, 2048))
TINY_SHAPES = (Shape(2, 64, 2, 32, vocab=128),)
TINY_HEAD_DIM = 16  # a tiny Qwen3: 4 query heads, 2 key/value heads


def shapes_for(
    model: str, hidden: list[int], seq: int, tiny: bool, head_dim: int | None = None
) -> list[Shape]:
    """The shapes of one run: the tiny one, or the full ones of ``hidden``, for ``model``; Qwen3's
    ``head_dim`` (None: ``QWEN3_HEAD_DIM``, or ``TINY_HEAD_DIM`` for the tiny model)."""
    if model != "qwen3":
        head_dim = 128
    elif head_dim is None:
        head_dim = TINY_HEAD_DIM if tiny else QWEN3_HEAD_DIM
    if tiny:
        return [replace(s, model=model, head_dim=head_dim) for s in TINY_SHAPES]
    return [replace(s, seq=seq, model=model, head_dim=head_dim) for s in FULL_SHAPES if s.hidden in hidden]


class AdapterNorm(nn.Module):
    """An RMSNorm that calls a ``cake_cute.tools.bench.peers`` adapter (Liger's or quack's kernel) on
    its weight."""

    def __init__(self, adapter, weight: nn.Parameter):
        super().__init__()
        self.adapter = adapter
        self.weight = weight

    def forward(self, x):
        # The peers' kernels take rows: [batch, seq, H] as [batch * seq, H] (a view).
        rows = x.reshape(-1, x.shape[-1])
        return self.adapter.forward(rows, self.weight, None)[0].view(x.shape)


def _is_rmsnorm(module: nn.Module) -> bool:
    """torch.nn.RMSNorm or a Hugging Face RMSNorm (one weight, ``variance_epsilon``)."""
    return isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def replace_norms(model: nn.Module, make) -> None:
    """Put ``make(weight)`` in place of every RMSNorm module of ``model`` (the weight is shared)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_rmsnorm(child):
                setattr(parent, name, make(child.weight))


def _torch_norm(weight: nn.Parameter) -> nn.RMSNorm:
    norm = nn.RMSNorm(weight.shape[0], eps=EPS, device="meta")
    norm.weight = weight
    return norm


def build_model(shape: Shape, impl: str, device, compiled: bool = False):
    """(model, step function) for ``impl``; the step returns the loss of one batch. ``compiled``: the
    model will be compiled (the kernel route's mode)."""
    torch.manual_seed(0)
    try:
        import transformers
    except ImportError:
        transformers = None
    sizes = dict(
        vocab=shape.vocab, hidden=shape.hidden, layers=shape.layers, heads=shape.heads, ffn=shape.ffn
    )
    if (shape.model == "qwen3" or impl in ROUTE_IMPLS) and transformers is None:
        raise ImportError(f"--model {shape.model} with {impl} needs transformers")
    with torch.device(device):
        if shape.model == "qwen3":
            config = transformers.Qwen3Config(
                **{_HF_NAMES[k]: v for k, v in sizes.items()},
                num_key_value_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                max_position_embeddings=shape.seq,
                rms_norm_eps=EPS,
                attn_implementation="sdpa",
            )
            model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
        elif transformers is not None:
            config = transformers.LlamaConfig(
                **{_HF_NAMES[k]: v for k, v in sizes.items()},
                num_key_value_heads=shape.heads,
                max_position_embeddings=shape.seq,
                rms_norm_eps=EPS,
                attn_implementation="sdpa",
            )
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        else:
            from tests.distributed_harness import model as llama

            config = llama.Config(**sizes, fused_residual=impl == "cake_cute")
            model = llama.build(config, seed=0, device=device, dtype=torch.bfloat16)
    if impl in ROUTE_IMPLS:
        use_kernel_route(model, impl, compiled)
    else:
        prepare_norms(model, impl, fused=transformers is not None)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    if transformers is not None:

        def loss(m):
            return m(input_ids=inputs, labels=inputs).loss
    else:

        def loss(m):
            logits = m(inputs)
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    return model, loss


def prepare_norms(model: nn.Module, impl: str, fused: bool) -> None:
    """Install ``impl``'s norms; for cake_cute also the fused residual (HF layers patched, or the
    fallback model built with fused-residual blocks). ``cake_cute_qk_kernel`` keeps the per-head norms
    on the kernel under compile."""
    import cake_cute

    if impl == "cake_cute_qk_kernel":
        cake_cute.fuse_residual_rmsnorm(model, weight_offset=0.0, compiled_head_norms="kernel")
    elif impl == "cake_cute_memory_efficient" and fused:
        cake_cute.fuse_residual_rmsnorm(model, weight_offset=0.0, memory_efficient=True)
    elif impl == "cake_cute_memory_efficient":
        cake_cute.swap_rmsnorm(model, weight_offset=0.0, memory_efficient=True)
    elif impl == "cake_cute" and fused:
        cake_cute.fuse_residual_rmsnorm(model, weight_offset=0.0)
    elif impl.startswith("cake_cute"):
        cake_cute.swap_rmsnorm(model, weight_offset=0.0)
    elif impl == "torch":
        replace_norms(model, _torch_norm)
    else:
        from cake_cute.tools.bench import peers

        adapter = peers.FACTORIES[impl](torch, EPS)
        replace_norms(model, lambda weight: AdapterNorm(adapter, weight))


def use_kernel_route(model: nn.Module, impl: str, compiled: bool) -> None:
    """Hugging Face's kernel route for a ``ROUTE_IMPLS`` implementation (``hf``: nothing to do), then a
    check that every norm decorated "RMSNorm" runs the mapped layer."""
    if impl == "hf":
        return
    from kernels import Mode

    import cake_cute
    from cake_cute.hf.kernel_config import CakeKernelConfig

    if impl == "kernels_cake_cute":
        config = cake_cute.hf_kernel_config(model)
    else:
        config = CakeKernelConfig({"RMSNorm": f"{liger_repository()}:LigerRMSNorm"}, use_local_kernel=True)
    mode = Mode.TRAINING | Mode.TORCH_COMPILE if compiled else Mode.TRAINING
    model.set_use_kernels(True, kernel_config=config, mode=mode)
    for module in model.modules():
        if getattr(type(module), "kernel_layer_name", None) != "RMSNorm":
            continue
        bound = module.__dict__.get("forward")
        if bound is None or bound.__func__.__qualname__ not in (
            "CakeHFRMSNorm.forward",
            "LigerRMSNorm.forward",
        ):
            raise RuntimeError(
                f"{type(module).__name__} kept its own forward: the route did not apply {impl}"
            )


# The stand-in for the Hub's kernels-community/liger-kernels LigerRMSNorm (which needs the network): the
# installed liger-kernel's function with its defaults, as a kernels layer.
_LIGER_LAYER = """import types

from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from torch import nn


class LigerRMSNorm(nn.Module):
    can_torch_compile = True

    def forward(self, hidden_states):
        return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


layers = types.SimpleNamespace(LigerRMSNorm=LigerRMSNorm)
"""
_LIGER_METADATA = {
    "name": "liger-stand-in",
    "id": "_liger_stand_in",
    "version": 1,
    "license": "BSD-2-Clause",
    "python-depends": [],
    "backend": {"type": "cuda"},
}


@functools.cache
def liger_repository() -> Path:
    """A local layer repository holding the Liger stand-in, written once per process."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="liger-stand-in-"))
    variant = root / "build" / "torch-universal"
    for package in (variant, variant / root.name.replace("-", "_")):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(_LIGER_LAYER)
    (variant / "metadata.json").write_text(json.dumps(_LIGER_METADATA))
    return root


def _clock(device):
    """(start, stop -> ms) timing one step: CUDA events on a GPU, the host clock on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def stop():
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return start.record, stop
    begin = []

    def stop_host():
        return (time.perf_counter() - begin.pop()) * 1e3

    return lambda: begin.append(time.perf_counter()), stop_host


def time_steps(model, loss, device, warmup: int, steps: int, optimizer=None) -> tuple[float, float | None]:
    """(median step ms, peak GiB or None on CPU) of forward + loss + backward (+ ``optimizer.step()``)."""

    def step():
        model.zero_grad(set_to_none=True)
        loss(model).backward()
        if optimizer is not None:
            optimizer.step()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, stop = _clock(device)
    times = []
    for _ in range(steps):
        start()
        step()
        times.append(stop())
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def kernel_profile(model, loss, steps: int = 3) -> list[tuple[str, float, float]]:
    """(kernel name, µs per step, launches per step) of every GPU kernel of a step, longest first."""
    from tune import profiled_kernels  # after _use_source_tree: it imports cake_cute

    def step():
        model.zero_grad(set_to_none=True)
        loss(model).backward()

    totals: dict[str, list[float]] = {}
    for event in profiled_kernels(step, steps):
        totals.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = [(name, sum(us) / steps, len(us) / steps) for name, us in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def write_profile(path: Path, rows: list[tuple[str, float, float]]) -> None:
    total = sum(us for _, us, _ in rows)
    lines = [f"# {total:.1f} us of kernels per step", "us_per_step  launches  kernel"]
    lines += [f"{us:11.1f}  {n:8.1f}  {name[:160]}" for name, us, n in rows]
    path.write_text("\n".join(lines) + "\n")


def _available(impl: str) -> bool:
    if impl.startswith("cake_cute") or impl in ("torch", "hf"):
        return True
    if impl in ROUTE_IMPLS:
        needs = ["transformers", "kernels"] + (["liger_kernel"] if impl == "kernels_liger" else [])
        missing = [name for name in needs if importlib.util.find_spec(name) is None]
        if missing:
            print(f"skip {impl}: {', '.join(missing)} not installed", file=sys.stderr)
        return not missing
    from cake_cute.tools.bench import peers

    try:
        peers.FACTORIES[impl](torch, EPS)
    except ImportError as e:
        print(f"skip {impl}: {e}", file=sys.stderr)
        return False
    return True


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM, or of tests/distributed_harness/model.py's Llama."""
    inner = getattr(model, "model", model)
    return inner.layers


def compiled(model, impl: str, gradient_sums: bool, scope: str = "model"):
    """``torch.compile(model)``, or with ``scope="layers"`` each decoder layer compiled in place and
    the model returned; cake_cute's with its gradient-sum pass when ``gradient_sums``."""
    options = None
    if impl.startswith("cake_cute") and gradient_sums:
        from cake_cute.graph_passes import gradient_sum_pass

        options = {"post_grad_custom_post_pass": gradient_sum_pass}
    if scope == "layers":
        for layer in decoder_layers(model):
            layer.compile(options=options)
        return model
    return torch.compile(model, options=options)


def run(args, save=None) -> list[dict]:
    """Every (shape, implementation, mode) of ``args``; ``save(rows)`` after each run."""
    device = torch.device(args.device)
    rows = []
    for shape in shapes_for(args.model, args.hidden, args.seq, args.tiny, args.head_dim):
        for impl in [i for i in args.impls if _available(i)]:
            for mode in args.modes:
                torch._dynamo.reset()
                model, loss = build_model(shape, impl, device, compiled=mode == "compile")
                stepped = model
                if mode == "compile":
                    stepped = compiled(model, impl, args.gradient_sums, args.compile_scope)
                optimizer = torch.optim.AdamW(model.parameters()) if args.optimizer == "adamw" else None
                step_ms, peak = time_steps(stepped, loss, device, args.warmup, args.steps, optimizer)
                row = dict(impl=impl, mode=mode, layers=shape.layers, H=shape.hidden, tokens=shape.tokens)
                if optimizer is not None:
                    row["optimizer"] = args.optimizer
                if args.model != "llama" or args.compile_scope != "model":
                    row |= dict(model=args.model, compile_scope=args.compile_scope)
                if args.model == "qwen3":
                    row["head_dim"] = shape.head_dim
                rows.append({**row, "step_ms": round(step_ms, 3), "peak_gib": peak and round(peak, 3)})
                print(json.dumps(rows[-1]), flush=True)
                if save is not None:
                    save(rows)
                if args.profile is not None and device.type == "cuda":
                    args.profile.mkdir(parents=True, exist_ok=True)
                    profile_path = args.profile / f"{impl}-{mode}-H{shape.hidden}.txt"
                    write_profile(profile_path, kernel_profile(stepped, loss))
                del model, stepped, loss, optimizer
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def route_versions(impls) -> dict:
    """``{"route": {transformers, kernels versions}}`` when a kernel-route implementation runs."""
    if not set(impls) & set(ROUTE_IMPLS) - {"hf"}:
        return {}
    return {"route": {name: importlib.metadata.version(name) for name in ("transformers", "kernels")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (checks the script, e.g. on CPU)")
    p.add_argument(
        "--impls",
        type=lambda s: s.split(","),
        help=f"comma-separated subset of {','.join(ALL_IMPLS)} (default {','.join(IMPLS)}; "
        f"qwen3: {','.join(QWEN3_IMPLS)})",
    )
    p.add_argument(
        "--route",
        action="store_true",
        help=f"Hugging Face's kernel route: default impls {','.join(ROUTE_IMPLS)} (the module docstring)",
    )
    p.add_argument("--model", choices=MODELS, default="llama", help="Llama, or Qwen3 (q/k norms, GQA)")
    p.add_argument(
        "--head-dim",
        type=int,
        help=f"Qwen3's head_dim, its q/k norms' size (default {QWEN3_HEAD_DIM}; {TINY_HEAD_DIM} with --tiny)",
    )
    p.add_argument(
        "--compile-scope",
        choices=("model", "layers"),
        default="model",
        help="compile the whole model (default) or each decoder layer",
    )
    p.add_argument("--modes", type=lambda s: s.split(","), default=["eager", "compile"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--hidden",
        type=lambda s: [int(h) for h in s.split(",")],
        default=[shape.hidden for shape in FULL_SHAPES],
        help="the full shapes to run, by H (default 2048,4096); --append collects several runs in one file",
    )
    p.add_argument("--append", action="store_true", help="keep the rows already in OUT (other shapes)")
    p.add_argument("--seq", type=int, default=FULL_SHAPES[0].seq, help="tokens per sequence (batch 4)")
    p.add_argument(
        "--optimizer",
        choices=("none", "adamw"),
        default="none",
        help="step an optimizer after the backward (default none: forward + loss + backward)",
    )
    p.add_argument("--profile", type=Path, help="write each run's kernels and their time per step here")
    p.add_argument(
        "--no-gradient-sums",
        dest="gradient_sums",
        action="store_false",
        help="compile cake_cute's models without cake_cute.graph_passes.gradient_sum_pass",
    )
    args = p.parse_args(argv)
    if args.impls is None:
        args.impls = list(ROUTE_IMPLS if args.route else QWEN3_IMPLS if args.model == "qwen3" else IMPLS)
    if unknown := set(args.impls) - set(ALL_IMPLS):
        p.error(f"--impls: unknown {sorted(unknown)}, expected a subset of {','.join(ALL_IMPLS)}")
    if args.head_dim is not None and (args.model != "qwen3" or args.head_dim < 1):
        p.error("--head-dim: a positive int, for --model qwen3 (Llama's heads are 128 wide)")
    _use_source_tree()
    kept = kept_rows(args.out, args.append)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device

    def save(rows: list[dict]) -> None:
        write_results(
            args.out,
            "benchmarks/model_step.py",
            device,
            kept + rows,
            warmup=args.warmup,
            steps=args.steps,
            gradient_sums=args.gradient_sums,
            **route_versions(args.impls),
        )

    save(run(args, save))
    return 0


if __name__ == "__main__":
    sys.exit(main())
