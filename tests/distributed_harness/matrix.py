"""The distributed matrix on a small Llama-style model, one process per device.

    torchrun --nproc_per_node=2 -m tests.distributed_harness.matrix --device cuda --out DIR
    torchrun --nproc_per_node=2 -m tests.distributed_harness.matrix --device cpu --small --out DIR  # gloo

``one_gpu.py`` runs the same cases with two ranks on one GPU (threads, or gloo processes). Every case
compares cake_cute (``swap_rmsnorm``) with ``torch.nn.RMSNorm`` under the same plan and with
one device on the global batch, and raises ``AssertionError`` with the numbers when a check fails. Rank 0
writes ``<out>/<date>-<device>-distributed.json`` (rows ``{case, world_size, ok, detail}``) and a log.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from cake_cute import (
    CakeRMSNorm,
    SequenceParallelResidual,
    cake_rmsnorm,
    cake_rmsnorm_fp8,
    fuse_residual_rmsnorm,
    swap_rmsnorm,
)
from cake_cute.reference import rel_error
from tests.distributed_harness import launch
from tests.distributed_harness import model as llama

EPS = 1e-5


@dataclass(frozen=True)
class Setup:
    device: str
    cfg: llama.Config
    global_batch: int
    seq: int
    steps: int
    compile_backend: str
    threads: bool = False  # the ranks are threads of one process (torch's threaded process group)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world(self) -> int:
        return dist.get_world_size()


# --- helpers ---------------------------------------------------------------------------------------


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _close(name: str, actual, expected, tol: float) -> float:
    err = rel_error(actual, expected)
    _check(err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}")
    return err


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_bytes(t) -> torch.Tensor:
    """A DTensor's (or tensor's) global value as bytes; 1-byte (FP8) dtypes are gathered as uint8,
    since gloo cannot move them."""
    if isinstance(t, DTensor) and t.dtype.itemsize == 1:
        local = t.to_local().view(torch.uint8)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return _full(t).view(torch.uint8)


def _clean_name(name: str) -> str:
    """Parameter names without the wrappers' prefixes (checkpointing, compile, DDP)."""
    for token in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(token, "")
    return name


@contextlib.contextmanager
def _process_wide(s: Setup, make_context):
    """``make_context()``, a setting of torch's process-wide state (dynamo's config, deterministic
    algorithms, the attention backends), entered on every rank. Ranks that are threads of one process
    share that state: rank 0 alone enters and leaves it, between barriers, so that no thread restores a
    value the other still runs under."""
    if not s.threads:
        with make_context():
            yield
        return
    dist.barrier()
    with make_context() if s.rank == 0 else contextlib.nullcontext():
        dist.barrier()
        yield
        dist.barrier()


def _reset_compiler(s: Setup) -> None:
    """Forget every compiled graph, so that a run's recompile check sees that run only."""
    with _process_wide(s, contextlib.nullcontext):
        if not s.threads or s.rank == 0:
            torch._dynamo.reset()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    """Bitwise equality of a local tensor across ranks."""
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


# --- 1. op level ------------------------------------------------------------------------------------


# Every op-level case shards rows on each non-hidden dimension, or replicates them.
ROW_PLACEMENTS = (Shard(0), Shard(1), Replicate())


def _op_level_inputs(s: Setup, seed: int):
    """A 1-D mesh over the ranks and global (x, r, w, g_y, g_h): [2 * world, 4 * world, H] rows (each
    rank gets whole rows under either shard) and a weight near 1."""
    mesh = init_device_mesh(s.device, (s.world,))
    gen = torch.Generator().manual_seed(seed)
    shape = (2 * s.world, 4 * s.world, s.cfg.hidden)
    x, r, g_y, g_h = (torch.randn(shape, generator=gen).to(s.device) for _ in range(4))
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(s.device)
    return mesh, (x, r, w, g_y, g_h)


def case_op_level(s: Setup) -> str:
    mesh, (x, r, w, g_y, g_h) = _op_level_inputs(s, seed=7)
    details = []
    for placement in ROW_PLACEMENTS:
        for residual in (False, True):
            details.append(_op_level_one(mesh, placement, residual, x, r, w, g_y, g_h))
    _check_hidden_shard_refused(mesh, x, w)
    return "; ".join(details) + "; Shard(-1) refused"


def _op_level_one(mesh, placement, residual, x, r, w, g_y, g_h) -> str:
    expect_dw = Replicate() if isinstance(placement, Replicate) else Partial()
    leaves = [distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, r)]
    dw_leaf = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    grads = [distribute_tensor(t, mesh, [placement]) for t in (g_y, g_h)]
    with CommDebugMode() as comm:
        out = cake_rmsnorm(leaves[0], dw_leaf, EPS, leaves[1] if residual else None)
        outs = out if residual else (out,)
        torch.autograd.backward(outs, grads[: len(outs)])
    label = f"{placement}/{'residual' if residual else 'plain'}"
    _check(comm.get_total_counts() == 0, f"{label}: {comm.get_comm_counts()} collectives in the norm")
    for t in (*outs, leaves[0].grad) + ((leaves[1].grad,) if residual else ()):
        _check(tuple(t.placements) == (placement,), f"{label}: output placed {t.placements}")
    _check(tuple(dw_leaf.grad.placements) == (expect_dw,), f"{label}: dw placed {dw_leaf.grad.placements}")
    single = _single_device_op(x, r if residual else None, w, g_y, g_h if residual else None)
    got = [_full(t) for t in (*outs, leaves[0].grad, dw_leaf.grad)]
    for name, a, e in zip(("y", "h_new")[: len(outs)] + ("dx", "dw"), got, single):
        if name == "dw":
            _close(f"{label} dw", a, e, 1e-5)
        else:
            _check(torch.equal(a, e), f"{label}: {name} differs from one device")
    torch_y = F.rms_norm(x + r if residual else x, (x.shape[-1],), w, EPS)
    _close(f"{label} y vs torch", got[0], torch_y, 1e-5)
    return label


def _single_device_op(x, r, w, g_y, g_h):
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    out = cake_rmsnorm(leaves[0], leaves[1], EPS, r)
    outs = out if r is not None else (out,)
    torch.autograd.backward(outs, [g_y, g_h][: len(outs)])
    return [*(o.detach() for o in outs), leaves[0].grad, leaves[1].grad]


def case_fp8_op_level(s: Setup) -> str:
    """The forward to FP8 on DTensors (both recipes, y emitted or not, plain and residual, rows sharded
    on each dimension or replicated): no collective, every output placed like x, data / scales / rstd /
    y / h_new and dx bitwise one device's on the global batch, dw within 1e-5 (the ranks' partial sums
    add in another order)."""
    mesh, tensors = _op_level_inputs(s, seed=11)
    labels = []
    for placement in ROW_PLACEMENTS:
        for residual in (False, True):
            for recipe, emit_y in (("mxfp8", False), ("1x128", True)):
                labels.append(_fp8_op_level_one(mesh, placement, residual, recipe, emit_y, *tensors))
    return "; ".join(labels)


def _fp8_run(x, w, r, recipe, emit_y, g_y, g_h):
    """Outputs (data, scales, rstd, y or None, h_new or None) and gradients (dx, dw) of one call."""
    out = cake_rmsnorm_fp8(x, w, EPS, r, recipe=recipe, emit_y=emit_y)
    pairs = [(out.y, g_y)] + ([(out.h_new, g_h)] if r is not None else [])
    torch.autograd.backward(*zip(*pairs))
    outputs = (out.data, out.scales, out.rstd, out.y if emit_y else None, out.h_new)
    return outputs, (x.grad, w.grad)


def _fp8_op_level_one(mesh, placement, residual, recipe, emit_y, x, r, w, g_y, g_h) -> str:
    label = f"fp8 {recipe}{'+y' if emit_y else ''} {placement}/{'residual' if residual else 'plain'}"
    xd, rd = (distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, r))
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    gd, g_hd = (distribute_tensor(t, mesh, [placement]) for t in (g_y, g_h))
    with CommDebugMode() as comm:
        outputs, grads = _fp8_run(xd, wd, rd if residual else None, recipe, emit_y, gd, g_hd)
    _check(comm.get_total_counts() == 0, f"{label}: {comm.get_comm_counts()} collectives in the norm")
    placed = [t for t in (*outputs, grads[0]) if t is not None]
    _check(all(tuple(t.placements) == (placement,) for t in placed), f"{label}: an output placed otherwise")
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    want, want_grads = _fp8_run(leaves[0], leaves[1], r if residual else None, recipe, emit_y, g_y, g_h)
    for name, got, expected in zip(("data", "scales", "rstd", "y", "h_new"), outputs, want):
        if expected is not None:
            same = torch.equal(_full_bytes(got), _full_bytes(expected))
            _check(same, f"{label}: {name} differs from one device")
    _check(torch.equal(_full(grads[0]), want_grads[0]), f"{label}: dx differs from one device")
    _close(f"{label} dw", _full(grads[1]), want_grads[1], 1e-5)
    return label


def _check_hidden_shard_refused(mesh, x, w) -> None:
    xd = distribute_tensor(x, mesh, [Shard(2)])
    wd = distribute_tensor(w, mesh, [Replicate()])
    try:
        cake_rmsnorm(xd, wd, EPS)
    except Exception as err:  # DTensor may wrap the rule's ValueError
        _check("hidden" in str(err), f"Shard(-1) failed with an unclear error: {err}")
        return
    raise AssertionError("a DTensor sharded on the hidden dimension was accepted")


# --- 2. sequence-parallel norms + AdamW --------------------------------------------------------------


def case_sp_adamw(s: Setup) -> str:
    details = []
    for residual in (False, True):
        details.append(_sp_adamw_one(s, residual))
    return "; ".join(details)


def _sp_adamw_one(s: Setup, residual: bool) -> str:
    mesh = init_device_mesh(s.device, (s.world,))
    hidden = s.cfg.hidden
    single = CakeRMSNorm(hidden, eps=EPS, device=s.device)
    with torch.no_grad():
        single.weight.uniform_(0.5, 1.5, generator=torch.Generator(s.device).manual_seed(3))
    norm = copy.deepcopy(single)
    style = SequenceParallelResidual() if residual else SequenceParallel()
    parallelize_module(norm, mesh, style)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (norm, single)]
    local_seq = s.seq // s.world
    for step in range(10):
        gen = torch.Generator().manual_seed(100 + step)
        xs, rs, ts = (torch.randn(2, s.seq, hidden, generator=gen).to(s.device) for _ in range(3))
        for module, opt, sl in (
            (norm, opts[0], slice(s.rank * local_seq, (s.rank + 1) * local_seq)),
            (single, opts[1], slice(None)),
        ):
            out = module(xs[:, sl], residual=rs[:, sl]) if residual else module(xs[:, sl])
            y = out[0] if residual else out
            loss = (y.to_local() if isinstance(y, DTensor) else y).mul(ts[:, sl]).sum()
            opt.zero_grad()
            loss.backward()
            if module is norm:
                _check(
                    isinstance(norm.weight.grad, DTensor) and norm.weight.grad.placements == (Partial(),),
                    f"dw placed {getattr(norm.weight.grad, 'placements', None)}",
                )
            opt.step()
    local = norm.weight.to_local().detach()
    _check(_same_on_every_rank(local), "norm weights differ across ranks after 10 AdamW steps")
    err = _close("weights vs one device", local, single.weight.detach(), 1e-4)
    return f"{'residual' if residual else 'plain'}: bitwise equal across ranks, vs one device {err:.1e}"


# --- 3-9. the model under plans ---------------------------------------------------------------------


class Run(NamedTuple):
    losses: list[float]  # the global batch's mean loss of every step
    grads: dict[str, torch.Tensor]  # full gradients after the first step
    weights: dict[str, torch.Tensor]  # full parameters after the last step


def _step(model, plan: llama.Plan, tokens, targets, micro: int, total) -> None:
    """Forward and backward over ``plan.accumulate`` micro-batches; FSDP reduces after the last only."""
    for i in range(plan.accumulate):
        if plan.fsdp:
            model.set_requires_gradient_sync(i == plan.accumulate - 1)
        rows = slice(i * micro, (i + 1) * micro)
        loss = llama.loss_fn(model(tokens[rows]), targets[rows]) / plan.accumulate
        loss.backward()
        total += loss.detach()


def _forward_backward(model, s: Setup, plan: llama.Plan, step: int, dp_degree: int, dp_rank: int) -> float:
    """Forward and backward of step ``step`` on the plan's share of its global batch; the global
    batch's mean loss."""
    cfg = replace(s.cfg, fused_residual=plan.fused_residual)
    local = s.global_batch // dp_degree
    tokens, targets = llama.batch(cfg, 1000 + step, s.global_batch, s.seq, s.device)
    tokens, targets = (t[dp_rank * local : (dp_rank + 1) * local] for t in (tokens, targets))
    total = torch.zeros((), device=s.device)
    # Compiled blocks (fullgraph=True: no graph break) must not recompile after the first step.
    recompiles = functools.partial(torch._dynamo.config.patch, error_on_recompile=plan.compile and step > 0)
    with _process_wide(s, recompiles):
        _step(model, plan, tokens, targets, local // plan.accumulate, total)
    if dp_degree > 1:
        dist.all_reduce(total)
        total /= dp_degree
    return total.item()


def _train(model, s: Setup, plan: llama.Plan, dp_degree: int, dp_rank: int):
    """Train ``s.steps`` AdamW steps on the plan's share of each global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads = [], None
    for step in range(s.steps):
        losses.append(_forward_backward(model, s, plan, step, dp_degree, dp_rank))
        if step == 0:
            first_grads = {_clean_name(n): _full(p.grad).float() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return Run(losses, first_grads, _full_weights(model))


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {_clean_name(n): _full(p.detach()).float() for n, p in model.named_parameters()}


def _model(s: Setup, plan: llama.Plan, cake: bool, seed: int = 0):
    """The plan's model (weights from ``seed``), its norms swapped for cake_cute's if ``cake``."""
    model = llama.build(replace(s.cfg, fused_residual=plan.fused_residual), seed=seed, device=s.device)
    if cake:
        swap_rmsnorm(model)
    return model


def _plan_model(s: Setup, plan: llama.Plan, cake: bool, seed: int = 0):
    """``_model`` under the plan."""
    model = _model(s, plan, cake, seed)
    return llama.parallelize(model, s.device, s.world, replace(plan, compile_backend=s.compile_backend))


def _run_plan(s: Setup, plan: llama.Plan, cake: bool, distributed: bool = True):
    _reset_compiler(s)  # each run compiles afresh, so the recompile checks see this run only
    if not distributed:
        model = _model(s, plan, cake)
        if plan.param_dtype is not None:
            model = model.to(plan.param_dtype)
        return _train(model, s, llama.Plan(fused_residual=plan.fused_residual), 1, 0)
    model = _plan_model(s, plan, cake)
    return _train(model, s, plan, *llama.data_parallel_coords(s.world, s.rank, plan))


def _compare(run, loose: bool = False) -> str:
    """cake under the plan vs torch's norm under the plan and vs cake on one device;
    ``run(cake, distributed)`` trains one of them and returns its ``Run``."""
    tol_loss, tol_grad = (3e-2, 8e-2) if loose else (1e-4, 2e-3)
    cake_losses, cake_grads, _ = run(True, True)
    torch_losses, torch_grads, _ = run(False, True)
    one_losses, one_grads, _ = run(True, False)
    worst = 0.0
    for name, ref_losses in (("torch under the plan", torch_losses), ("one device", one_losses)):
        worst = max(
            worst, _close(f"losses vs {name}", torch.tensor(cake_losses), torch.tensor(ref_losses), tol_loss)
        )
    for name, ref in (("torch", torch_grads), ("one device", one_grads)):
        for pname, g in cake_grads.items():
            worst = max(worst, _close(f"grad {pname} vs {name}", g, ref[pname], tol_grad))
    _check(len(cake_grads) == len(one_grads), "parameter sets differ")
    return f"losses {', '.join(f'{v:.5f}' for v in cake_losses)}, worst relative error {worst:.2e}"


def _plan_case(plan: llama.Plan):
    def case(s: Setup) -> str:
        return _compare(functools.partial(_run_plan, s, plan), loose=plan.param_dtype is not None)

    return case


def case_determinism(s: Setup) -> str:
    """Two identical TP + SP runs. The norm is deterministic by itself; the rest of the model needs
    PyTorch's deterministic algorithms (embedding backward) and the math attention backend (the fused
    attention backwards accumulate with atomics). On CUDA run with CUBLAS_WORKSPACE_CONFIG=:4096:8."""
    plan = llama.Plan(tp=True)
    with _process_wide(s, _deterministic_algorithms):
        first = _run_plan(s, plan, cake=True)
        second = _run_plan(s, plan, cake=True)
    _check(first.losses == second.losses, f"losses differ: {first.losses} vs {second.losses}")
    for kind in ("grads", "weights"):
        for name, t in getattr(first, kind).items():
            _check(torch.equal(t, getattr(second, kind)[name]), f"{kind} {name} differ between runs")
    return f"{len(first.losses)} losses, {len(first.grads)} gradients and final weights bitwise equal"


@contextlib.contextmanager
def _deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(previous)


# --- 10. distributed checkpoint ------------------------------------------------------------------------


def _dcp_case(plan: llama.Plan):
    def case(s: Setup) -> str:
        # Bitwise equality of the next step needs the embedding backward's deterministic algorithm.
        with _process_wide(s, _deterministic_algorithms):
            return _dcp_round_trip(s, plan)

    return case


def _dcp_round_trip(s: Setup, plan: llama.Plan) -> str:
    """A cake model under the plan and its AdamW state after one step, saved with DCP and loaded into
    a model of other initial weights: the loaded weights are the saved ones and the next step of both
    gives the same loss and weights, bitwise."""
    saved, loaded = (_plan_model(s, plan, cake=True, seed=seed) for seed in (0, 1))
    saved_opt, loaded_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (saved, loaded))
    coords = llama.data_parallel_coords(s.world, s.rank, plan)
    _forward_backward(saved, s, plan, 0, *coords)
    saved_opt.step()
    saved_opt.zero_grad()
    directory = _shared_temp_dir(s)
    try:
        model_state, optim_state = get_state_dict(saved, saved_opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
        model_state, optim_state = get_state_dict(loaded, loaded_opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(loaded, loaded_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    finally:
        dist.barrier()
        if s.rank == 0:
            shutil.rmtree(directory)
    at_save = _full_weights(saved)
    for name, t in _full_weights(loaded).items():
        _check(torch.equal(t, at_save[name]), f"{name} loaded differs from saved")
    losses = []
    for model, opt in ((saved, saved_opt), (loaded, loaded_opt)):
        losses.append(_forward_backward(model, s, plan, 1, *coords))
        opt.step()
    _check(losses[0] == losses[1], f"the next step's losses differ: {losses}")
    after = _full_weights(saved)
    for name, t in _full_weights(loaded).items():
        _check(torch.equal(t, after[name]), f"{name} differs after the next step")
    return f"{len(at_save)} parameters + AdamW state round-tripped, next step bitwise equal ({losses[0]:.5f})"


def _shared_temp_dir(s: Setup) -> str:
    """A new temporary directory made by rank 0, its path broadcast to every rank."""
    path = [tempfile.mkdtemp(prefix="cake-cute-dcp-") if s.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


# --- 11. Hugging Face blocks, residual adds fused, under TP + SP ------------------------------------------


class _Logits(torch.nn.Module):
    """A causal LM called as ``model(tokens) -> logits``, as the matrix's training loop calls its models."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(input_ids=tokens).logits


def _hf_llama(s: Setup) -> torch.nn.Module:
    """A transformers Llama of the matrix's sizes, weights from a generator of its own (N(0, 0.02),
    norm weights U(0.5, 1.5)), untied embeddings (the TP plan shards them differently)."""
    # The modules themselves: transformers' lazy top-level attributes are not safe to resolve from two
    # threads at once.
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    cfg = s.cfg
    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads // 2,
        head_dim=cfg.hidden // cfg.heads,
        max_position_embeddings=s.seq,
        rms_norm_eps=EPS,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    lm = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            value = torch.empty(p.shape)
            p.copy_(
                value.uniform_(0.5, 1.5, generator=gen)
                if "norm" in name
                else value.normal_(0, 0.02, generator=gen)
            )
    return _Logits(lm.to(s.device))


def _hf_tp_sp(model: _Logits, mesh) -> None:
    """torchtitan's TP + SP plan on a transformers Llama. The residual stream stays a ``Shard(1)``
    DTensor between the layers (transformers adds the residual to the attention and MLP outputs
    itself and derives positions from the embedding's global shape)."""
    norm = SequenceParallelResidual()
    sharded_out = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(
        model.lm,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": norm,
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.lm.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": norm,
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": sharded_out,
                "post_attention_layernorm": norm,
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": sharded_out,
            },
        )


def _hf_run(s: Setup, cake: bool, distributed: bool) -> Run:
    model = _hf_llama(s)
    fused_adds = []
    if cake:
        fuse_residual_rmsnorm(model.lm, weight_offset=0.0)
        for module in model.modules():
            if isinstance(module, CakeRMSNorm):
                module.register_forward_pre_hook(
                    lambda _, args, kwargs: fused_adds.append(len(args) > 1 or "residual" in kwargs),
                    with_kwargs=True,
                )
    if distributed:
        _hf_tp_sp(model, init_device_mesh(s.device, (s.world,)))
    run = _train(model, s, llama.Plan(tp=distributed), 1, 0)
    # At least each layer's post-attention add is fused (the one before the next layer's norm is too
    # where that norm's weight is a plain tensor).
    _check(not cake or sum(fused_adds) >= s.cfg.layers * s.steps, f"{sum(fused_adds)} fused residual adds")
    return run


def case_hf_fused_tp_sp(s: Setup) -> str:
    """A transformers Llama with ``fuse_residual_rmsnorm`` under TP + SP vs the stock model under the
    same plan and vs the fused model on one device."""
    return _compare(functools.partial(_hf_run, s))


def cases(world: int) -> dict:
    """Case name -> function(Setup) -> detail; every name in the JSON."""
    table = {"1-op-level": case_op_level, "1-fp8-op-level": case_fp8_op_level, "2-sp-adamw": case_sp_adamw}
    plans = {
        "3-tp-sp": llama.Plan(tp=True),
        "3-tp-sp-fused-residual": llama.Plan(tp=True, fused_residual=True),
        "4-fsdp-reshard": llama.Plan(fsdp=True, reshard=True),
        "4-fsdp-no-reshard": llama.Plan(fsdp=True, reshard=False),
        "4-fsdp-bf16": llama.Plan(fsdp=True, param_dtype=torch.bfloat16),
        "4-fsdp-grad-accumulation": llama.Plan(fsdp=True, accumulate=2),
        "5-fsdp-tp-1x2": llama.Plan(tp=True, fsdp=True, mesh_shape=(1, world)),
        "5-fsdp-tp-2x1": llama.Plan(tp=True, fsdp=True, mesh_shape=(world, 1)),
        "6-ddp": llama.Plan(ddp=True),
    }
    for name in ("3-tp-sp", "3-tp-sp-fused-residual", "4-fsdp-reshard", "5-fsdp-tp-1x2", "6-ddp"):
        plans[f"7-compile-{name[2:]}"] = replace(plans[name], compile=True)
    for name in ("3-tp-sp", "4-fsdp-reshard"):
        plans[f"8-checkpoint-{name[2:]}"] = replace(plans[name], checkpoint=True)
    table.update({name: _plan_case(plan) for name, plan in plans.items()})
    table["9-determinism"] = case_determinism
    table["10-dcp-tp-sp"] = _dcp_case(plans["3-tp-sp"])
    table["10-dcp-fsdp"] = _dcp_case(plans["4-fsdp-reshard"])
    table["11-hf-fused-tp-sp"] = case_hf_fused_tp_sp
    return table


# --- the runner ---------------------------------------------------------------------------------------


def model_config(small: bool) -> tuple[llama.Config, int, int]:
    """(model config, global batch, sequence length): tiny for CPU runs, else a GPU-sized model."""
    if small:
        return llama.Config(), 4, 16
    return llama.Config(vocab=8192, hidden=1024, layers=2, heads=8, ffn=2816), 4, 1024


def selected(world: int, only: str) -> dict:
    """The cases whose names start with one of the comma-separated prefixes in ``only`` (all if empty)."""
    prefixes = [p for p in only.split(",") if p]
    return {n: fn for n, fn in cases(world).items() if not prefixes or any(n.startswith(p) for p in prefixes)}


def run_case(s: Setup, fn) -> tuple[bool, str]:
    """(ok, detail) of one case on this rank; a failure is reported, never raised, so that one failing
    case does not hide the others."""
    try:
        return True, fn(s)
    except Exception as err:
        if s.rank == 0:
            traceback.print_exc()
        return False, f"{type(err).__name__}: {err}"


def report_line(name: str, ok: bool, seconds: float, detail: str) -> str:
    return f"{name:34s} {'ok  ' if ok else 'FAIL'} {seconds:6.1f}s  {detail}"


def _setup(args) -> Setup:
    launch.init(args)
    cfg, batch, seq = model_config(args.small)
    return Setup(args.device, cfg, batch, seq, args.steps, args.compile_backend)


def add_case_arguments(parser) -> None:
    """The arguments every runner of the matrix takes besides launch's."""
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--only", default="", help="comma-separated case-name prefixes")
    parser.add_argument("--tag", default="", help="appended to the output file names")


def main(argv=None) -> int:
    parser = launch.parser(__doc__)
    add_case_arguments(parser)
    args = parser.parse_args(argv)
    s = _setup(args)
    rows, lines = [], []
    for name, fn in selected(s.world, args.only).items():
        start = time.perf_counter()
        ok, detail = run_case(s, fn)
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # gloo-safe CPU tensor: every rank must agree
        ok = bool(flag.item()) and ok
        rows.append({"case": name, "world_size": s.world, "ok": ok, "detail": detail})
        line = report_line(name, ok, time.perf_counter() - start, detail)
        lines.append(line)
        if s.rank == 0:
            print(line, flush=True)
    if s.rank == 0:
        _write(args, s, rows, lines)
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in rows) else 1


def _write(args, s: Setup, rows, lines) -> None:
    config = {**s.cfg.__dict__, "global_batch": s.global_batch, "seq": s.seq, "steps": s.steps}
    suffix = "distributed" + (f"-{args.tag}" if args.tag else "")
    path = launch.write_json(args, suffix, config, rows)
    path.with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
