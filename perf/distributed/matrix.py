"""The distributed matrix of issue #11 on a small Llama-style model, one process per device.

    torchrun --nproc_per_node=2 perf/distributed/matrix.py --device cuda --out perf/results
    torchrun --nproc_per_node=2 perf/distributed/matrix.py --device cpu --small --out /tmp/dist  # gloo

Every case compares cake_cute (``swap_rmsnorm``) with ``torch.nn.RMSNorm`` under the same plan and with
one device on the global batch, and raises ``AssertionError`` with the numbers when a check fails. Rank 0
writes ``<out>/<date>-<device>-distributed.json`` (rows ``{case, world_size, ok, detail}``) and a log.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402
import model as llama  # noqa: E402

from cake_cute import (  # noqa: E402
    CakeRMSNorm,
    SequenceParallelResidual,
    cake_rmsnorm,
    cake_rmsnorm_fp8,
    swap_rmsnorm,
)
from cake_cute.reference import rel_error  # noqa: E402

EPS = 1e-5


@dataclass(frozen=True)
class Setup:
    device: str
    cfg: llama.Config
    global_batch: int
    seq: int
    steps: int
    compile_backend: str

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


def _train(model, s: Setup, plan: llama.Plan, dp_degree: int, dp_rank: int):
    """Train ``s.steps`` AdamW steps on the plan's share of each global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = replace(s.cfg, fused_residual=plan.fused_residual)
    losses, first_grads = [], None
    local = s.global_batch // dp_degree
    micro = local // plan.accumulate
    for step in range(s.steps):
        tokens, targets = llama.batch(cfg, 1000 + step, s.global_batch, s.seq, s.device)
        tokens, targets = (t[dp_rank * local : (dp_rank + 1) * local] for t in (tokens, targets))
        total = torch.zeros((), device=s.device)
        # Compiled blocks (fullgraph=True: no graph break) must not recompile after the first step.
        recompiles = torch._dynamo.config.patch(error_on_recompile=plan.compile and step > 0)
        with recompiles:
            _step(model, plan, tokens, targets, micro, total)
        if dp_degree > 1:
            dist.all_reduce(total)
            total /= dp_degree
        losses.append(total.item())
        if step == 0:
            first_grads = {_clean_name(n): _full(p.grad).float() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    weights = {_clean_name(n): _full(p.detach()).float() for n, p in model.named_parameters()}
    return Run(losses, first_grads, weights)


def _run_plan(s: Setup, plan: llama.Plan, cake: bool, distributed: bool = True):
    cfg = replace(s.cfg, fused_residual=plan.fused_residual)
    plan = replace(plan, compile_backend=s.compile_backend)
    torch._dynamo.reset()  # each run compiles afresh, so the recompile checks see this run only
    model = llama.build(cfg, seed=0, device=s.device)
    if cake:
        swap_rmsnorm(model)
    if not distributed:
        if plan.param_dtype is not None:
            model = model.to(plan.param_dtype)
        return _train(model, s, llama.Plan(fused_residual=plan.fused_residual), 1, 0)
    model = llama.parallelize(model, s.device, s.world, plan)
    return _train(model, s, plan, *llama.data_parallel_coords(s.world, s.rank, plan))


def _compare(s: Setup, plan: llama.Plan) -> str:
    """cake under the plan vs torch.nn.RMSNorm under the plan and vs cake on one device."""
    loose = plan.param_dtype is not None
    tol_loss, tol_grad = (3e-2, 8e-2) if loose else (1e-4, 2e-3)
    cake_losses, cake_grads, _ = _run_plan(s, plan, cake=True)
    torch_losses, torch_grads, _ = _run_plan(s, plan, cake=False)
    one_losses, one_grads, _ = _run_plan(s, plan, cake=True, distributed=False)
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
        return _compare(s, plan)

    return case


def case_determinism(s: Setup) -> str:
    """Two identical TP + SP runs. The norm is deterministic by itself; the rest of the model needs
    PyTorch's deterministic algorithms (embedding backward) and the math attention backend (the fused
    attention backwards accumulate with atomics). On CUDA run with CUBLAS_WORKSPACE_CONFIG=:4096:8."""
    plan = llama.Plan(tp=True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            first = _run_plan(s, plan, cake=True)
            second = _run_plan(s, plan, cake=True)
    finally:
        torch.use_deterministic_algorithms(previous)
    _check(first.losses == second.losses, f"losses differ: {first.losses} vs {second.losses}")
    for kind in ("grads", "weights"):
        for name, t in getattr(first, kind).items():
            _check(torch.equal(t, getattr(second, kind)[name]), f"{kind} {name} differ between runs")
    return f"{len(first.losses)} losses, {len(first.grads)} gradients and final weights bitwise equal"


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
    return table


# --- the runner ---------------------------------------------------------------------------------------


def _setup(args) -> Setup:
    launch.init(args)
    if args.small:
        cfg, batch, seq = llama.Config(), 4, 16
    else:
        cfg = llama.Config(vocab=8192, hidden=1024, layers=2, heads=8, ffn=2816)
        batch, seq = 4, 1024
    return Setup(args.device, cfg, batch, seq, args.steps, args.compile_backend)


def main(argv=None) -> int:
    parser = launch.parser(__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--only", default="", help="comma-separated case-name prefixes")
    parser.add_argument("--tag", default="", help="appended to the output file names")
    args = parser.parse_args(argv)
    s = _setup(args)
    prefixes = [p for p in args.only.split(",") if p]
    rows, lines = [], []
    for name, fn in cases(s.world).items():
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        start = time.perf_counter()
        try:
            detail, ok = fn(s), True
        except Exception as err:  # one failing case must not hide the others
            detail, ok = f"{type(err).__name__}: {err}", False
            if s.rank == 0:
                traceback.print_exc()
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # gloo-safe CPU tensor: every rank must agree
        ok = bool(flag.item()) and ok
        rows.append({"case": name, "world_size": s.world, "ok": ok, "detail": detail})
        line = f"{name:34s} {'ok  ' if ok else 'FAIL'} {time.perf_counter() - start:6.1f}s  {detail}"
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
