#!/usr/bin/env python
"""``python benchmarks/gated_model_step.py OUT.json [--model qwen3_next|kimi_linear]``: what a
Qwen3-Next-style (SiLU gate) or Kimi-Linear-style (sigmoid gate) model's training step (forward, loss,
backward, AdamW) costs with each gated RMSNorm in its linear-attention layers, eager and under
``torch.compile``, in one process.

The model (``--model qwen3_next``, the default): Hugging Face's ``Qwen3NextForCausalLM`` from a
``Qwen3NextConfig``, random init (seed 0),
bf16, sdpa attention, no cache. 8 layers at hidden 2048, the config's default pattern of one
full-attention layer every 4 (layers 4 and 8; the others are Gated DeltaNet linear attention: 16 key
heads and 32 value heads of 128, so every gated norm normalizes 32 rows of 128 per token), full
attention with 16 query heads of 256 and 2 key/value heads, a dense SwiGLU MLP of 5632 in every layer
(``num_experts=0``: no router, so the step is the same work for every implementation), vocabulary
32000. About 0.7 B parameters: with AdamW's states and 8192 tokens' activations well under 30 GB, a
step a few hundred ms on one H200. 8192 tokens per step (batch 1 x sequence 8192), the same batch every
step.

``--model kimi_linear``: Hugging Face's ``KimiLinearForCausalLM`` from a ``KimiLinearConfig`` of the
same outline: 8 layers at hidden 2048, full attention (Multi-head Latent Attention: 16 heads, a
key/value latent of 512, query/key dims 128 + 64 rotary, value dim 128, as Kimi Linear's) in layers 4
and 8, Kimi Delta Attention in the others (32 heads of 128: every gated norm, its output norm
``KimiLinearRMSNormGated``, normalizes 32 rows of 128 per token and gates them with the sigmoid of a
low-rank projection), a dense SwiGLU MLP of 5632 in every layer (no experts), vocabulary 32000. The
Kimi Delta Attention is transformers' torch implementation unless fla's ``chunk_kda`` imports (see
``linear_attention`` below); its short convolutions are torch's without the ``causal_conv1d`` package.
The torch Kimi Delta Attention forms a per-channel decay of heads x T x 64 x 128 FP32 values in every
layer and keeps several such tensors for its backward (8.6 GB each at 32 heads and 8192 tokens, 1.1 GB
at 1024): with it, give fewer tokens (``--seq 1024``).

Implementations (only the linear-attention layers' gated norm differs; the plain norms are below):

* ``stock-torch``: Hugging Face's gated norm class (``Qwen3NextRMSNormGated``,
  ``KimiLinearRMSNormGated``) in every gated-norm slot. Transformers 5.17 and later build that class
  there whether fla is installed or not (fla's ``FusedRMSNormGated`` reaches it only through the
  ``kernels`` hub mapping, ``kernelize`` / ``use_kernels=True``, which needs the hub); 5.0 and older
  build fla's module in Qwen3-Next's slot when fla imports. The slot is made the Hugging Face class
  either way (same weight Parameter);
* ``fla``: fla's ``FusedRMSNormGated`` with the model's gate (``activation="silu"``, or ``"sigmoid"``
  as fla's own Kimi Delta Attention layer builds it) in those slots; a row with ``skipped`` when fla
  does not import;
* ``cake``: ``swap_gated_rmsnorm(model)``, the default cast policy, which follows the Hugging Face
  class's roundings (Qwen3-Next's: the plain kernel with a unit weight, then torch's products; Kimi
  Linear's class rounds once: the fused kernel);
* ``cake-one-rounding``: ``swap_gated_rmsnorm(model, cast_policy="one_rounding")``, the fused kernel
  rounding once (docs/gated.md: within 2**-6 of |y| of Qwen3-Next's three bf16 roundings; for Kimi
  Linear the same norm as ``cake``).

``--plain-norms``: ``stock`` (default) leaves the model's plain norms (``Qwen3NextRMSNorm``: the
layers' two norms, the q / k head norms, the final norm; ``KimiLinearRMSNorm``) as Hugging Face builds
them; ``cake`` applies ``swap_rmsnorm(model)`` to them in every run, as a user applying both swaps
would (each class's weight offset read from it). Either way every implementation runs the same plain
norms, so the difference between rows of one ``plain_norms`` is the gated norm's.

Which linear-attention kernels ran is in the output (``linear_attention``): transformers takes
``chunk_gated_delta_rule`` (Kimi Linear: ``chunk_kda``) from fla when fla's ops import, else its torch
implementation (much slower), and ``causal_conv1d_fn`` from the ``causal_conv1d`` package, else torch's
conv1d; ``--linear-attention torch`` makes the layers call transformers' torch delta rule even where
fla imports (fla 0.6 refuses its gated delta-rule backward on Hopper with Triton below 3.7.1, and
the fla norm needs only fla's norm module). ``default_gated_norm`` names the class the model builds
in the slot when left alone.

Timing and memory are benchmarks/model_step.py's (``time_steps``): CUDA events around each step after
``--warmup`` steps (which include the compile), median over ``--steps``; ``peak_gib`` is
``torch.cuda.max_memory_allocated`` over the timed steps (AdamW's states included); tokens/s is
tokens / median step. ``--compile-scope layers`` (default) compiles each decoder layer in place (fla's
delta rule is a ``torch.compiler.disable`` region, so a layer is two graphs around it); ``model``
compiles the whole model. Every run starts from the same seed and batch: ``losses`` are its first
``--loss-steps`` losses (warm-up steps included), ``loss_diff_vs_stock`` their largest difference from
``stock-torch``'s of the same mode and plain norms.

``--device cpu`` is a smoke mode: a tiny model (hidden 64, 2 layers, one of each kind, 32 tokens),
eager, 1 warm-up and 2 timed steps by default, host clock, no peak memory; with ``--dtype fp32`` the
cake runs' first loss is bitwise stock-torch's (the CPU path does the class's FP32 operations).

``--seq N``: N tokens per step (batch 1) instead of 8192. Compiling takes most of a compiled run (minutes at
8192 tokens: dynamo unrolls transformers' torch delta rule over its 64-token chunks into the linear-attention
layer's graph), and fewer tokens give a smaller graph.

``--interleave ROUNDS``: every run in one process, their timed steps taking turns, so that a drift of
the machine (another host, clocks, the allocator's history) weighs on every row alike: round 0 builds,
compiles and warms each run in turn and times its first ``--steps``; each of the other rounds times
``--steps`` of every run in the same order. ``step_ms`` is then the median of the rounds' medians
(``round_ms``), ``peak_gib`` is null (the other runs' models and optimizer states stay resident), and a
compiled row's dynamo counts are its round 0's. Every run's model stays in memory to the end.

``--profile DIR``: after a run's timed steps, 2 more under ``torch.profiler`` (CPU, and CUDA on a
GPU); per run, named ``<impl>-<mode>`` (``-plain-cake`` added for ``--plain-norms cake``), a ``.txt`` of
``key_averages()`` tables (the top 40 by self device time on a GPU, and by self CPU time) and a ``.json``
of per-step numbers: ``host_ms`` (the host's time in a step, the profiler's own included),
``device_span_ms`` (from the step's first device event to its last), ``device_ms`` (the device events'
time) and its top 30 ``device_ms_by_name``, ``kernels`` (device events less copies and
memsets), and ``markers``, the events naming a compiled frame (``Torch-Compiled Region: frame/compile``:
a graph break's resumed code is a frame of its own), a dynamo cache lookup, an AOT-autograd function,
an inductor graph call or a ``cake_cute::`` op; the row's ``profile`` names both files relative to
OUT's folder. A compiled row has ``dynamo``, dynamo's counts over the run: ``unique_graphs``,
``graph_breaks`` by reason, ``recompiles`` and their reasons, ``compile_s`` (forward and backward
graphs) and inductor's FX graph cache hits and misses (a graph compiled before on the machine is
loaded, not compiled).

Rows: ``{impl, mode, plain_norms, gated_norm, tokens, step_ms, tokens_per_s, peak_gib, losses,
loss_diff_vs_stock}``, ``dynamo`` and ``profile`` as above; ``error`` instead of the numbers when a
run raised, ``skipped`` when its implementation does not import. The results file is rewritten after
every run; ``--append`` keeps OUT's rows.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model_step import compiled, decoder_layers, time_steps  # noqa: E402
from results_doc import kept_rows, write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402

IMPLS = ("stock-torch", "fla", "cake", "cake-one-rounding")
STOCK = "stock-torch"
PLAIN_NORMS = ("stock", "cake")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROFILE_STEPS = 2  # profiled after the timed steps under --profile
STEP_REGION = "gated_model_step.step"  # the profiler's record_function around each profiled step
# Substrings of the profiler event names counted in a profile's ``markers``.
MARKERS = (
    "Torch-Compiled Region",
    "TorchDynamo Cache Lookup",
    "CompiledFunction",
    "CompiledFxGraph",
    "cake_cute::",
)


@dataclass(frozen=True)
class Size:
    """A model's sizes, and the batch (``heads``, ``kv_heads``, ``head_dim``: the full-attention layers';
    ``linear_*``: the linear-attention layers')."""

    hidden: int
    layers: int
    full_attention_interval: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    intermediate: int
    vocab: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def layer_types(self) -> list[str]:
        """The config's default pattern: every ``full_attention_interval``-th layer full attention."""
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.layers)
        ]


FULL = Size(
    hidden=2048,
    layers=8,
    full_attention_interval=4,
    heads=16,
    kv_heads=2,
    head_dim=256,
    linear_key_heads=16,
    linear_value_heads=32,
    linear_head_dim=128,
    intermediate=5632,
    vocab=32000,
    batch=1,
    seq=8192,
)
# One layer of each kind, so the smoke run goes through both mixers.
TINY = Size(
    hidden=64,
    layers=2,
    full_attention_interval=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_head_dim=16,
    intermediate=128,
    vocab=128,
    batch=1,
    seq=32,
)


def common_config(size: Size) -> dict:
    """The config fields both families name alike: the sizes, the layer pattern, no cache (a training
    step keeps no recurrent state or KV cache), sdpa attention."""
    return dict(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        layer_types=size.layer_types,
        max_position_embeddings=size.seq,
        use_cache=False,
        attn_implementation="sdpa",
    )


def qwen3_next_config(size: Size):
    import transformers

    return transformers.Qwen3NextConfig(
        **common_config(size),
        head_dim=size.head_dim,
        linear_key_head_dim=size.linear_head_dim,
        linear_value_head_dim=size.linear_head_dim,
        linear_num_key_heads=size.linear_key_heads,
        linear_num_value_heads=size.linear_value_heads,
        num_experts=0,  # a dense MLP in every layer
    )


def kimi_linear_config(size: Size):
    """Kimi Linear's outline at ``size``: its latent attention's dims from ``head_dim`` (Kimi Linear's
    own at 128: a latent of 4 * 128, rotary dims 64), every MLP dense."""
    import transformers

    return transformers.KimiLinearConfig(
        **common_config(size),
        kv_lora_rank=4 * size.head_dim,
        qk_nope_head_dim=size.head_dim,
        qk_rope_head_dim=size.head_dim // 2,
        v_head_dim=size.head_dim,
        linear_head_dim=size.linear_head_dim,
        linear_num_heads=size.linear_value_heads,
        mlp_layer_types=["dense"] * size.layers,  # no router: the same work for every implementation
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@dataclass(frozen=True)
class Family:
    """A model family the step is built from: its causal-LM class and config (``config``: Size -> the
    config), where a decoder layer holds its linear-attention mixer (``mixer``, an attribute that
    other layers lack or hold without ``norm_slot``) and the mixer its gated norm (``norm_slot``), the
    Hugging Face class and gate activation of that norm, the chunked delta rule's module global and
    the sizes of a full and a tiny run."""

    name: str
    model: str
    config: Callable[[Size], object]
    mixer: str
    norm_slot: str
    norm: str
    activation: str
    delta_rule: str
    full: Size
    tiny: Size

    def modeling(self):
        """transformers' modeling module of the family."""
        return importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")


QWEN3_NEXT = Family(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    qwen3_next_config,
    "linear_attn",
    "norm",
    "Qwen3NextRMSNormGated",
    "silu",
    "torch_chunk_gated_delta_rule",
    FULL,
    TINY,
)
# Kimi Linear at the Qwen3-Next step's outline: latent attention of 16 heads with Kimi Linear's dims
# (``kimi_linear_config``), 32 Kimi Delta Attention heads of 128.
KIMI_LINEAR = Family(
    "kimi_linear",
    "KimiLinearForCausalLM",
    kimi_linear_config,
    "self_attn",
    "o_norm",
    "KimiLinearRMSNormGated",
    "sigmoid",
    "chunk_kimi_delta_attention",
    replace(FULL, kv_heads=16, head_dim=128),
    replace(TINY, kv_heads=4),  # latent attention: one key/value head per query head
)
FAMILIES = {family.name: family for family in (QWEN3_NEXT, KIMI_LINEAR)}


def linear_mixers(model: nn.Module, family: Family = QWEN3_NEXT) -> list[nn.Module]:
    """The linear-attention mixers of the model, each holding one gated norm in ``family.norm_slot``."""
    mixers = (getattr(layer, family.mixer, None) for layer in decoder_layers(model))
    return [mixer for mixer in mixers if hasattr(mixer, family.norm_slot)]


def hf_gated_norm(mixer: nn.Module, family: Family = QWEN3_NEXT) -> nn.Module:
    """The mixer's gated norm as the family's Hugging Face class, holding the same weight: the module
    itself when it already is one (transformers 5.17+), else a new one (older transformers built fla's
    in Qwen3-Next's slot when fla imports)."""
    cls = getattr(family.modeling(), family.norm)
    slot = getattr(mixer, family.norm_slot)
    if isinstance(slot, cls):
        return slot
    with torch.device("meta"):
        norm = cls(slot.weight.shape[0], eps=mixer.layer_norm_epsilon)
    norm.weight = slot.weight
    return norm


def fla_gated_norm(mixer: nn.Module, family: Family = QWEN3_NEXT) -> nn.Module:
    """fla's ``FusedRMSNormGated`` with the family's gate activation, as transformers 5.0 built it in
    Qwen3-Next's slot and fla's Kimi Delta Attention builds it, holding the same weight."""
    from fla.modules import FusedRMSNormGated

    weight = getattr(mixer, family.norm_slot).weight
    norm = FusedRMSNormGated(
        weight.shape[0], eps=mixer.layer_norm_epsilon, activation=family.activation, device="meta"
    )
    norm.weight = weight
    return norm


def install_gated_norms(model: nn.Module, impl: str, family: Family = QWEN3_NEXT) -> None:
    """Put ``impl``'s gated norm in every linear-attention layer (the weight Parameters are kept)."""
    import cake_cute

    mixers = linear_mixers(model, family)
    for mixer in mixers:
        norm = fla_gated_norm(mixer, family) if impl == "fla" else hf_gated_norm(mixer, family)
        setattr(mixer, family.norm_slot, norm)
    if impl.startswith("cake"):
        policy = "one_rounding" if impl == "cake-one-rounding" else None
        swapped = cake_cute.swap_gated_rmsnorm(model, cast_policy=policy)
        if swapped != len(mixers):
            raise RuntimeError(f"swap_gated_rmsnorm replaced {swapped} gated norms of {len(mixers)}")


def build_model(
    size: Size, impl: str, plain_norms: str, dtype, device, family: Family = QWEN3_NEXT
) -> nn.Module:
    """The seeded random-init model with ``impl``'s gated norms and ``plain_norms``' plain norms."""
    import cake_cute

    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(family.modeling(), family.model)(family.config(size)).to(dtype)
    if plain_norms == "cake":
        # Before the gated norms: swap_rmsnorm leaves Hugging Face's gated class alone (not an RMSNorm's
        # forward), and fla's module is never offered to it.
        cake_cute.swap_rmsnorm(model)
    install_gated_norms(model, impl, family)
    return model.train()


def batch_loss(size: Size, device):
    """loss(model) of one fixed batch (seeded): Hugging Face's causal-LM loss from ``labels=``."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator).to(device)

    def loss(model):
        return model(input_ids=ids, labels=ids).loss

    return loss


def recording(loss, count: int):
    """(loss function, list): the wrapped function keeps its first ``count`` losses, detached (no host
    synchronization inside the steps)."""
    first: list[torch.Tensor] = []

    def loss_and_record(model):
        value = loss(model)
        if len(first) < count:
            first.append(value.detach())
        return value

    return loss_and_record, first


def fla_import_error() -> str | None:
    try:
        importlib.import_module("fla.modules")
    except Exception as exc:  # fla missing, or its Triton / torch too old: the peer is skipped
        return repr(exc)
    return None


def _resolved_by_package(function) -> bool | None:
    """Whether a function wrapped by transformers' ``use_kernel_func_from_hub_with_fallback`` runs
    the package's implementation (its closure's ``is_new_implementation``), looking through any
    wrapper that keeps ``__wrapped__``; None when no such closure is found."""
    while function is not None:
        code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
        if code is not None and closure:
            cells = dict(zip(code.co_freevars, closure))
            if "is_new_implementation" in cells:
                return cells["is_new_implementation"].cell_contents
        function = getattr(function, "__wrapped__", None)
    return None


def linear_attention_paths(family: Family = QWEN3_NEXT) -> dict:
    """Which implementation transformers' model of ``family`` calls for its linear-attention functions."""
    hf = family.modeling()
    packages = {family.delta_rule: "fla", "causal_conv1d_fn": "causal_conv1d"}
    paths = {}
    for name, package in packages.items():
        resolved = _resolved_by_package(getattr(hf, name, None))
        paths[name] = "unknown" if resolved is None else (package if resolved else "torch")
    return paths


def force_torch_delta_rule(family: Family = QWEN3_NEXT) -> None:
    """Make the family's layers call transformers' own torch chunked delta rule even where fla imports
    (fla 0.6 refuses its gated backward on Hopper with Triton below 3.7.1): the module global the
    layers call, unwrapped down to the torch function its decorators wrap."""
    hf = family.modeling()
    function = getattr(hf, family.delta_rule)
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    setattr(hf, family.delta_rule, function)


def gated_norm_class(model: nn.Module, family: Family) -> str:
    """The class name of the module in the first linear-attention layer's gated-norm slot."""
    return type(getattr(linear_mixers(model, family)[0], family.norm_slot)).__name__


def default_gated_norm(size: Size, family: Family = QWEN3_NEXT) -> str:
    """The class transformers builds in the gated-norm slot when nothing is swapped (meta device)."""
    with torch.device("meta"):
        model = getattr(family.modeling(), family.model)(family.config(size))
    return gated_norm_class(model, family)


def clear_dynamo_counts() -> None:
    """Dynamo's counters and compilation metrics cleared, its compiled code kept."""
    from torch._dynamo import utils

    utils.counters.clear()
    utils.clear_compilation_metrics()


def reset_dynamo() -> None:
    """Dynamo's caches, counters and compilation metrics cleared (``reset`` keeps the last two)."""
    torch._dynamo.reset()
    clear_dynamo_counts()


def dynamo_stats() -> dict:
    """What dynamo counted since ``reset_dynamo``: graphs, graph breaks and recompiles (with their
    reasons), the frames' compile time in seconds (the backward's, compiled on first use, included) and
    inductor's FX graph cache hits and misses."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = get_compilation_metrics()
    reasons = Counter(m.recompile_reason for m in metrics if m.recompile_reason)
    return dict(
        unique_graphs=counters["stats"]["unique_graphs"],  # a Counter: 0 when never counted
        graph_breaks=dict(counters["graph_break"]),
        recompiles=reasons.total(),
        recompile_reasons=dict(reasons),
        compile_s=round(sum(m.duration_us or 0 for m in metrics) / 1e6, 1),
        fx_graph_cache_hits=counters["inductor"]["fxgraph_cache_hit"],
        fx_graph_cache_misses=counters["inductor"]["fxgraph_cache_miss"],
    )


def profiled_steps(model, loss, optimizer, device, steps: int):
    """torch.profiler's record of ``steps`` training steps, each inside a ``STEP_REGION`` range."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        for _ in range(steps):
            with record_function(STEP_REGION):
                model.zero_grad(set_to_none=True)
                loss(model).backward()
                optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return prof


def profile_tables(prof, device) -> str:
    """``key_averages()`` tables: the top 40 by self device time (when CUDA was profiled), by self CPU."""
    sorts = (["self_device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
    averages = prof.key_averages()
    return "\n\n".join(f"sorted by {key}\n{averages.table(sort_by=key, row_limit=40)}" for key in sorts)


def profile_summary(prof, steps: int) -> dict:
    """Per step: the step's host time and device span, its device events' time (in all, and the top
    30 names), kernels, the markers."""
    from torch.autograd import DeviceType

    events = prof.events()
    on_host = [e for e in events if e.device_type == DeviceType.CPU]
    on_device = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    # On a GPU a record_function range is also a device annotation, from its first device event to its last.
    annotations = [e for e in events if e.device_type != DeviceType.CPU and e.is_user_annotation]
    device_us = Counter()
    for event in on_device:
        device_us[event.name] += event.time_range.elapsed_us()
    kernels = [e for e in on_device if not e.name.startswith(("Memcpy", "Memset"))]
    markers = Counter(e.name for e in on_host if any(m in e.name for m in MARKERS))

    def step_ms(ranges) -> float:
        return round(sum(e.time_range.elapsed_us() for e in ranges if e.name == STEP_REGION) / 1e3 / steps, 3)

    return dict(
        steps=steps,
        host_ms=step_ms(on_host),
        device_span_ms=step_ms(annotations),
        device_ms=round(device_us.total() / 1e3 / steps, 3),
        kernels=len(kernels) / steps,
        device_ms_by_name={name: round(us / 1e3 / steps, 3) for name, us in device_us.most_common(30)},
        markers={name: count / steps for name, count in sorted(markers.items())},
    )


def write_profile(prof, device, steps: int, stem: Path) -> list[Path]:
    """``stem``.txt (the tables) and ``stem``.json (the summary)."""
    text, summary = stem.with_suffix(".txt"), stem.with_suffix(".json")
    text.write_text(profile_tables(prof, device) + "\n")
    summary.write_text(json.dumps(profile_summary(prof, steps), indent=1) + "\n")
    return [text, summary]


@dataclass
class Prepared:
    """A run ready to step: its model (``stepped``: compiled in place in mode compile), the loss
    recording its first values, the optimizer, and the class in the gated-norm slot."""

    stepped: nn.Module
    loss: Callable[[nn.Module], torch.Tensor]
    first_losses: list
    optimizer: torch.optim.Optimizer
    gated_norm: str

    def time(self, device, warmup: int, steps: int) -> tuple[float, float | None]:
        """``time_steps`` of this run: (median step ms, peak GiB or None)."""
        return time_steps(self.stepped, self.loss, device, warmup, steps, self.optimizer)


def prepare(size, key: tuple, args, device) -> Prepared:
    """The run's (``key``: impl, mode, plain norms) model built (and compiled in mode compile), its
    loss and optimizer."""
    impl, mode, plain_norms = key
    family = FAMILIES[args.model]
    model = build_model(size, impl, plain_norms, DTYPES[args.dtype], device, family)
    stepped = compiled(model, impl, False, args.compile_scope) if mode == "compile" else model
    loss, first_losses = recording(batch_loss(size, device), args.loss_steps)
    gated_norm = gated_norm_class(model, family)
    return Prepared(stepped, loss, first_losses, torch.optim.AdamW(model.parameters()), gated_norm)


def finish(prepared: Prepared, key: tuple, step_ms: float, peak, args, size, device) -> dict:
    """A run's row from its median step: tokens/s, peak memory, first losses; the profile's files
    under ``--profile``."""
    impl, mode, plain_norms = key
    row = dict(
        gated_norm=prepared.gated_norm,
        step_ms=round(step_ms, 3),
        tokens_per_s=round(size.tokens / step_ms * 1e3),
        peak_gib=peak and round(peak, 3),
        losses=[value.item() for value in prepared.first_losses],
    )
    if args.profile is not None:
        prof = profiled_steps(prepared.stepped, prepared.loss, prepared.optimizer, device, PROFILE_STEPS)
        stem = args.profile / (f"{impl}-{mode}" + ("-plain-cake" if plain_norms == "cake" else ""))
        files = write_profile(prof, device, PROFILE_STEPS, stem)
        row["profile"] = [os.path.relpath(path, args.out.parent) for path in files]
    return row


def measure(size, key: tuple, args, device) -> dict:
    """One run (``key``: impl, mode, plain norms) in a fresh dynamo: timing, peak memory and first
    losses; dynamo's counts when compiled; the profile's files under ``--profile``."""
    reset_dynamo()
    prepared = prepare(size, key, args, device)
    step_ms, peak = prepared.time(device, args.warmup, args.steps)
    row = finish(prepared, key, step_ms, peak, args, size, device)
    _, mode, _ = key
    if mode == "compile":
        row["dynamo"] = dynamo_stats()
    return row


def measure_interleaved(size, keys: list[tuple], args, device, failed: dict) -> dict:
    """Every run of ``keys`` in one process, their timed steps taking turns: round 0 builds, compiles
    and warms each run in turn and times its first ``--steps``; each later round times ``--steps`` of
    every run in the same order. ``step_ms`` is the median over rounds of each round's median, and
    ``round_ms`` lists them; the peak is not kept (the other runs' models and optimizer states are
    resident). Dynamo's counts of a compiled run are those of its round 0 (the compile). A run that
    raises is recorded in ``failed`` and leaves the rounds. Returns {key: row}."""
    reset_dynamo()
    # Each run's layers are cache entries of the same code objects: room for all of them.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(keys))
    prepared, rounds, stats = {}, {}, {}
    for key in keys:
        clear_dynamo_counts()
        try:
            prepared[key] = prepare(size, key, args, device)
            rounds[key] = [prepared[key].time(device, args.warmup, args.steps)[0]]
        except Exception as exc:  # one implementation failing must not cost the others' rows
            prepared.pop(key, None)
            failed[key] = repr(exc)
            continue
        _, mode, _ = key
        if mode == "compile":
            stats[key] = dynamo_stats()
    for _ in range(1, args.interleave):
        for key in prepared:
            rounds[key].append(prepared[key].time(device, 0, args.steps)[0])
    rows = {}
    for key, run in prepared.items():
        row = finish(run, key, statistics.median(rounds[key]), None, args, size, device)
        row["round_ms"] = [round(ms, 3) for ms in rounds[key]]
        if key in stats:
            row["dynamo"] = stats[key]
        rows[key] = row
    return rows


def with_loss_diff(row: dict, rows: list[dict]) -> dict:
    """``row`` with its losses' largest difference from stock-torch's of the same mode and plain norms."""
    stock = next(
        (
            r
            for r in rows
            if r["impl"] == STOCK and r["mode"] == row["mode"] and r["plain_norms"] == row["plain_norms"]
        ),
        None,
    )
    if "losses" not in row or stock is None or "losses" not in stock:
        return row
    diffs = [abs(a - b) for a, b in zip(row["losses"], stock["losses"])]
    return {**row, "loss_diff_vs_stock": max(diffs, default=None)}


def run(args, size: Size, save=None) -> list[dict]:
    """Every (plain norms, mode, implementation) of ``args``, one after another or (``--interleave``)
    taking turns; ``save(rows)`` after each row."""
    device = torch.device(args.device)
    fla_missing = fla_import_error()
    keys = [(impl, mode, plain) for plain in args.plain_norms for mode in args.modes for impl in args.impls]
    skipped = {key: f"fla does not import: {fla_missing}" for key in keys if key[0] == "fla" and fla_missing}
    measured = [key for key in keys if key not in skipped]
    failed: dict = {}
    together = measure_interleaved(size, measured, args, device, failed) if args.interleave else {}
    rows: list[dict] = []
    for key in keys:
        impl, mode, plain_norms = key
        row = dict(impl=impl, mode=mode, plain_norms=plain_norms, tokens=size.tokens)
        if key in skipped:
            row["skipped"] = skipped[key]
        elif args.interleave:
            row |= together.get(key) or {"error": failed[key]}
        else:
            try:
                row |= measure(size, key, args, device)
            except Exception as exc:  # one implementation failing must not cost the others' rows
                row["error"] = repr(exc)
        rows.append(with_loss_diff(row, rows))
        print(json.dumps(rows[-1]), flush=True)
        if save is not None:
            save(rows)
        if not args.interleave:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def _list_of(choices):
    def parse(text: str) -> list[str]:
        values = text.split(",")
        if unknown := set(values) - set(choices):
            raise argparse.ArgumentTypeError(f"unknown {sorted(unknown)}, expected a subset of {choices}")
        return values

    return parse


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument(
        "--model",
        choices=tuple(FAMILIES),
        default="qwen3_next",
        help="qwen3_next (SiLU gate, default) or kimi_linear (sigmoid gate)",
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu: the tiny smoke model, eager")
    p.add_argument("--tiny", action="store_true", help="the tiny model (implied by --device cpu)")
    p.add_argument("--impls", type=_list_of(IMPLS), default=list(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument(
        "--plain-norms",
        type=_list_of(PLAIN_NORMS),
        default=["stock"],
        help="stock (Hugging Face's plain norms, default), cake (swap_rmsnorm in every run), or both",
    )
    p.add_argument("--modes", type=_list_of(("eager", "compile")), help="default eager,compile (cpu: eager)")
    p.add_argument("--compile-scope", choices=("layers", "model"), default="layers")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, help="steps before the timed ones (default 3; cpu: 1)")
    p.add_argument("--steps", type=int, help="timed steps (default 10; cpu: 2)")
    p.add_argument("--loss-steps", type=int, default=3, help="how many first losses each row keeps")
    p.add_argument(
        "--linear-attention",
        choices=("default", "torch"),
        default="default",
        help="torch: transformers' torch delta rule even where fla imports (default: its own pick)",
    )
    p.add_argument("--append", action="store_true", help="keep the rows already in OUT")
    p.add_argument("--profile", type=Path, help="folder for each run's torch.profiler tables and summary")
    p.add_argument("--seq", type=int, help="tokens per step (batch 1) instead of the size's own")
    p.add_argument(
        "--interleave",
        type=int,
        metavar="ROUNDS",
        help="every run in one process, their timed steps taking turns over ROUNDS rounds (>= 2)",
    )
    args = p.parse_args(argv)
    if args.interleave is not None and args.interleave < 2:
        p.error(f"--interleave takes at least 2 rounds; got {args.interleave}")
    cpu = args.device == "cpu"
    args.tiny = args.tiny or cpu
    args.modes = args.modes or (["eager"] if cpu else ["eager", "compile"])
    args.warmup = (1 if cpu else 3) if args.warmup is None else args.warmup
    args.steps = (2 if cpu else 10) if args.steps is None else args.steps
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    _use_source_tree()
    family = FAMILIES[args.model]
    size = family.tiny if args.tiny else family.full
    if args.seq is not None:
        size = replace(size, seq=args.seq)
    paths = linear_attention_paths(family)
    if args.linear_attention == "torch":
        force_torch_delta_rule(family)
        paths[family.delta_rule] = "torch (forced)"
    default_norm = default_gated_norm(size, family)
    print(f"linear attention: {paths}; the gated-norm slot's default class: {default_norm}", flush=True)
    kept = kept_rows(args.out, args.append)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device

    def save(rows: list[dict]) -> None:
        write_results(
            args.out,
            "benchmarks/gated_model_step.py",
            device,
            kept + rows,
            model=family.model,
            size=asdict(size),
            dtype=args.dtype,
            optimizer="adamw",
            compile_scope=args.compile_scope,
            warmup=args.warmup,
            steps=args.steps,
            transformers=_version("transformers"),
            fla=_version("fla-core", "flash-linear-attention"),
            linear_attention=paths,
            default_gated_norm=default_norm,
        )

    save(run(args, size, save))
    return 0


if __name__ == "__main__":
    sys.exit(main())
