"""A small Llama-style decoder and the parallel plans the distributed matrix, the training benchmark and
the CPU tests share: torchtitan's TP + sequence-parallel plan, FSDP2 per block + root, DDP,
activation checkpointing and torch.compile per block.

``fused_residual=True`` builds blocks that call their norms as ``norm(x, residual=r) -> (y, x + r)``
(the residual add fused into the norm, as in vLLM / Hugging Face "add + norm" stacks); the torch
reference for that call is ``AddRMSNorm``, a ``torch.nn.RMSNorm`` that ``swap_rmsnorm`` replaces by a
``CakeRMSNorm`` doing the same in one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from cake_cute import SequenceParallelResidual


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128
    fused_residual: bool = False


class AddRMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` called as ``norm(input, *, residual=None)``: y, or
    ``(norm(x + residual), x + residual)``."""

    def forward(self, input, *, residual=None):
        if residual is None:
            return super().forward(input)
        h = input + residual
        return super().forward(h), h


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.hidden, cfg.hidden, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fused_residual = cfg.fused_residual
        self.attention_norm = AddRMSNorm(cfg.hidden, eps=1e-5)
        self.attention = Attention(cfg)
        self.ffn_norm = AddRMSNorm(cfg.hidden, eps=1e-5)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, residual=None):
        """Plain: ``x -> x + attn(norm(x)) -> ... `` (returns one tensor). Fused residual: ``(x, residual)``
        in and out, the adds done by the norms (``residual`` None on the first block)."""
        if not self.fused_residual:
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))
        normed, residual = (
            self.attention_norm(x, residual=residual)
            if residual is not None
            else (
                self.attention_norm(x),
                x,
            )
        )
        normed, residual = self.ffn_norm(self.attention(normed), residual=residual)
        return self.feed_forward(normed), residual


def _waited(x):
    """x as a plain tensor. Under TP the embedding returns its reduce-scatter as an
    ``AsyncCollectiveTensor``; a block compiled with AOTAutograd that takes one as input loses the
    input's gradient in torch 2.13 (with torch.nn.RMSNorm as well), so wait for it here (clone waits)."""
    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


class Llama(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = AddRMSNorm(cfg.hidden, eps=1e-5)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = _waited(self.tok_embeddings(tokens))
        if not self.cfg.fused_residual:
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.output(self.norm(x, residual=residual)[0])


def build(cfg: Config, seed: int, device, dtype=torch.float32) -> Llama:
    """The same weights for the same seed on every rank, drawn from a generator of their own (ranks
    that are threads of one process share torch's global generator); norm weights are random (not
    ones) so that a wrong weight gradient shows."""
    model = Llama(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_initial_value(name, p, gen))
    return model.to(device=device, dtype=dtype)


def _initial_value(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """torch's default distributions (N(0, 1) embeddings, U(+-1/sqrt(fan_in)) linear weights), norm
    weights U(0.5, 1.5)."""
    value = torch.empty(p.shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return value.uniform_(0.5, 1.5, generator=gen)
    if name.startswith("tok_embeddings"):
        return value.normal_(generator=gen)
    bound = p.shape[1] ** -0.5
    return value.uniform_(-bound, bound, generator=gen)


def batch(cfg: Config, seed: int, batch_size: int, seq: int, device):
    """(tokens, targets) for one step, the same on every rank (each rank's share is cut by the plan)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, seq + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def norm_style(cfg: Config):
    """The sequence-parallel style for the model's norms (Shard(1) is the sequence dimension)."""
    return SequenceParallelResidual() if cfg.fused_residual else SequenceParallel()


def apply_tp(model: Llama, mesh) -> Llama:
    """torchtitan's Llama plan: vocab-parallel embedding with a sequence-sharded output, sequence
    parallel norms, column/row parallel attention and feed-forward, a replicated output."""
    norm = norm_style(model.cfg)
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": norm,
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": norm,
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": norm,
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    return model


def apply_checkpointing(model: Llama) -> Llama:
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
    return model


def apply_compile(model: Llama, backend: str = "inductor") -> Llama:
    """torch.compile per block (torchtitan's choice: after checkpointing, before FSDP), no graph breaks."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=True, backend=backend)
    return model


def apply_fsdp(model: Llama, mesh, *, reshard_after_forward: bool, param_dtype=None) -> Llama:
    """FSDP2 per block and at the root; ``param_dtype`` (e.g. bf16) turns on mixed precision with FP32
    gradient reduction."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


@dataclass(frozen=True)
class Plan:
    """How to parallelize the model: TP + SP, FSDP2, DDP, a 2-D (dp, tp) mesh, and what goes on top."""

    tp: bool = False
    fsdp: bool = False
    ddp: bool = False
    mesh_shape: tuple[int, ...] = ()  # (dp, tp) for FSDP + TP; empty: one mesh over every rank
    reshard: bool = True
    param_dtype: torch.dtype | None = None
    accumulate: int = 1
    checkpoint: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    fused_residual: bool = False


def data_parallel_coords(world: int, rank: int, plan: Plan) -> tuple[int, int]:
    """(data-parallel degree, this rank's data-parallel index): which share of the global batch it takes."""
    if plan.mesh_shape:
        return plan.mesh_shape[0], rank // plan.mesh_shape[1]
    if plan.fsdp or plan.ddp:
        return world, rank
    return 1, 0


def parallelize(model: Llama, device: str, world: int, plan: Plan) -> nn.Module:
    """The plan applied in torchtitan's order: TP, activation checkpointing, compile, FSDP (or DDP).
    Swap the norms (``swap_rmsnorm``) before calling this."""
    if plan.mesh_shape:
        mesh = init_device_mesh(device, plan.mesh_shape, mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    else:
        dp_mesh = tp_mesh = init_device_mesh(device, (world,))
    if plan.tp:
        apply_tp(model, tp_mesh)
    if plan.checkpoint:
        apply_checkpointing(model)
    if plan.compile:
        apply_compile(model, plan.compile_backend)
    if plan.fsdp:
        apply_fsdp(model, dp_mesh, reshard_after_forward=plan.reshard, param_dtype=plan.param_dtype)
    if plan.ddp:
        return DistributedDataParallel(model)
    return model
