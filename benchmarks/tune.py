"""Time candidate kernel configs for one H on the local GPU, through the config override table.

    python benchmarks/tune.py fwd H [TPR,VPT,ROWS ...]                 forward tilings
    python benchmarks/tune.py bwd H [TPR,VPT,ROWS,BUDGET ...]          backward tilings / register budgets
    python benchmarks/tune.py ring H[,H...] DEPTH:CTAS [DEPTH:CTAS ...]   backward ring depth, CTAs per SM
    python benchmarks/tune.py scan H[,H...] [KIND.CHOICE=VALUE[,...] ...] --rows-list T[,T...] [--kernels]

Options: ``--dtype`` (bf16), ``--reps`` (8), ``--rows`` (default 2^27 / H). The first candidate is
always the default config; ``0`` for BUDGET or CTAS keeps the default's value. Each candidate runs
inside ``kernels.config.overridden``, so it compiles into its own cache entry (the config is part of the
key) and nothing is patched. Device time comes from the profiler (the sum of the kernels a call
launches, averaged over ``--reps`` calls); TB/s counts the bytes the kernels must move. ``ring`` also
checks that every candidate with the default's program count returns bitwise the default's dx and dw.
``scan`` times whole backward calls, for each candidate set of override choices (e.g.
``bwd.ring_depth=4,dw.after_backward=false``; ``bwd.tiling=TPR:VPT:ROWS[:CLUSTER]``), the way the sweep does
(CUDA events around the call behind a spin, inputs rotated so none is L2-resident:
``cake_cute.tools.bench.timing``), next to a device copy of the same bytes, and checks that every
candidate's dx is bitwise the default's and its dw within FP32 rounding of an FP64 reference;
``--kernels`` adds each kernel's profiler time. The scans these modes replaced, and their logs:
evidence/kernel-rules-h200-2026-12-01/tiling-scans/, evidence/kernel-rules-h200-2026-12-01/stages-scan/.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial

import torch

import cake_cute
from cake_cute.kernels.config import backward_config, forward_config, overridden
from cake_cute.runtime import launch_plan
from cake_cute.runtime.device import device_facts
from cake_cute.tools.bench.timing import gpu_events
from cake_cute.vocab import DTYPE_NAMES, dtype_bytes, torch_dtype


def profiled_kernels(fn, reps: int) -> list:
    """The profiler's GPU kernel events of ``reps`` calls of ``fn`` (after one call outside)."""
    fn()
    torch.cuda.synchronize()

    def calls():
        for _ in range(reps):
            fn()

    return gpu_events(torch, calls)


def device_us(fn, reps: int) -> float:
    """Microseconds of device time per call of ``fn`` (all the kernels it launches)."""
    return sum(e.time_range.elapsed_us() for e in profiled_kernels(fn, reps)) / reps


def _ints(text: str, sep: str = ",") -> list[int]:
    return [int(v) for v in text.split(sep)]


def _backward(g, h, w, rstd, g_residual=None):
    """A backward call with its own workspace, sized under the config in force (an override can
    change how many partial rows of dW the backward writes)."""
    rows, hidden = h.shape
    ws = cake_cute.cake_rmsnorm_train_backward_workspace(
        rows, hidden, h.device, residual=g_residual is not None
    )
    return partial(cake_cute.cake_rmsnorm_train_backward, g, h, w, rstd, g_residual=g_residual, workspace=ws)


def _report(label: str, us: float, nbytes: int, extra: str = "") -> None:
    print(f"{label} us={us:.2f} TB/s={nbytes / us / 1e6:.3f} {extra}".rstrip(), flush=True)


def tune_forward(args, arch: str) -> None:
    H, act = args.hidden[0], args.dtype
    default = forward_config(arch, act, H).tiling
    tilings = [default] + [
        replace(default, threads_per_row=t, vecs_per_thread=v, rows_per_cta=r)
        for t, v, r in map(_ints, args.candidates)
    ]
    T = args.rows or (1 << 27) // H
    x = torch.randn(T, H, device="cuda", dtype=torch_dtype(act))
    w = torch.randn(H, device="cuda", dtype=torch_dtype(act))
    r = torch.randn_like(x)
    for residual in (False, True):
        forward = partial(cake_cute.cake_rmsnorm_train_forward, x, w, 1e-6, residual=r if residual else None)
        for tiling in tilings:
            with overridden("fwd", arch, act, H, tiling=tiling):
                label = f"fwd {act} H={H} res={residual} {forward_config(arch, act, H).describe()}"
                _report(
                    label,
                    device_us(forward, args.reps),
                    T * H * dtype_bytes(act) * (4 if residual else 2) + T * 4,
                )


def tune_backward(args, arch: str) -> None:
    H, act = args.hidden[0], args.dtype
    default = backward_config(arch, act, act, H, False).tiling
    candidates = [{}] + [
        {"tiling": replace(default, threads_per_row=t, vecs_per_thread=v, rows_per_cta=r)}
        | ({"register_budget": budget} if budget else {})
        for t, v, r, budget in map(_ints, args.candidates)
    ]
    T = args.rows or (1 << 27) // H
    x = torch.randn(T, H, device="cuda", dtype=torch_dtype(act))
    w = torch.randn(H, device="cuda", dtype=torch_dtype(act))
    g = torch.randn_like(x)
    h, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
    for residual in (False, True):
        gr = torch.randn_like(x) if residual else None
        for choices in candidates:
            with overridden("bwd", arch, act, H, **choices):
                config = backward_config(arch, act, act, H, residual)
                us = device_us(_backward(g, h, w, rstd, gr), args.reps)
                programs = launch_plan.backward_programs(T, H, act, act, residual, device_facts(x.device))
                label = f"bwd {act} H={H} res={residual} {config.describe()} programs={programs}"
                _report(label, us, T * H * dtype_bytes(act) * (4 if residual else 3))


def tune_ring(args, arch: str) -> None:
    act = args.dtype
    combos = [(0, 0)] + [tuple(_ints(c, ":")) for c in args.candidates]
    for H in args.hidden:
        T = args.rows or (1 << 27) // H
        x = torch.randn(T, H, device="cuda", dtype=torch_dtype(act))
        w = torch.randn(H, device="cuda", dtype=torch_dtype(act))
        g = torch.randn_like(x)
        h, rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)
        reference = None
        for depth, ctas in combos:
            choices = {k: v for k, v in (("ring_depth", depth), ("ctas_per_sm", ctas)) if v}
            with overridden("bwd", arch, act, H, **choices):
                config = backward_config(arch, act, act, H, False)
                programs = launch_plan.backward_programs(T, H, act, act, False, device_facts(x.device))
                backward = _backward(g, h, w, rstd)
                out = backward()
                same = ""
                if reference is None:
                    reference = (tuple(t.clone() for t in out), programs)
                elif reference[1] == programs:
                    same = f"bitwise={all(torch.equal(a, b) for a, b in zip(reference[0], out))}"
                us = device_us(backward, args.reps)
                label = f"ring {act} H={H} T={T} {config.describe()} programs={programs}"
                _report(label, us, T * H * dtype_bytes(act) * 3, same)


def parse_candidate(candidate: str, arch: str, act: str, hidden: int) -> dict[str, dict]:
    """``kind.choice=value[,kind.choice=value ...]`` -> {kind: choices}; ``default`` -> {}. Values are
    integers, ``true``/``false``, or for ``tiling`` ``TPR:VPT:ROWS[:CLUSTER]`` (the rest, and without
    CLUSTER the cluster size, of the default's)."""
    found: dict[str, dict] = {}
    if candidate == "default":
        return found
    for item in candidate.split(","):
        name, _, text = item.partition("=")
        kind, _, choice = name.partition(".")
        if choice == "tiling":
            tpr, vpt, rows, *cluster = _ints(text, ":")
            base = (
                forward_config(arch, act, hidden)
                if kind == "fwd"
                else backward_config(arch, act, act, hidden, False)
            )
            value = replace(base.tiling, threads_per_row=tpr, vecs_per_thread=vpt, rows_per_cta=rows)
            if cluster:
                value = replace(value, cluster_n=cluster[0])
        elif text in ("true", "false"):
            value = text == "true"
        else:
            value = int(text)
        found.setdefault(kind, {})[choice] = value
    return found


def _rotated_backward(sets, w, workspace):
    """A backward call that takes the next input set of ``sets`` on every call."""
    from cake_cute.tools.bench.timing import Rotation

    rotation = Rotation(len(sets))

    def call(_=None):
        g, x, rstd, gr = sets[rotation.next()]
        return cake_cute.cake_rmsnorm_train_backward(g, x, w, rstd, g_residual=gr, workspace=workspace)

    return call


def _kernel_label(name: str) -> str:
    """The module a kernel comes from (``rmsnorm_bwd``, ``dw_reduce``, ...) or the name's start."""
    for module in ("rmsnorm_fwd_quant", "rmsnorm_fwd", "rmsnorm_bwd", "dw_reduce"):
        if module in name:
            return module
    return name[:30]


def kernel_us(call, reps: int) -> dict[str, float]:
    """Median device time of each kernel ``call`` launches (by kernel module), from the profiler."""
    import statistics

    times: dict[str, list[float]] = {}
    for event in profiled_kernels(call, reps):
        times.setdefault(_kernel_label(event.name), []).append(event.time_range.elapsed_us())
    return {name: statistics.median(us) for name, us in times.items()}


def _scan_case(timer, arch: str, act: str, T: int, H: int, residual: bool, args) -> None:
    from contextlib import ExitStack

    from cake_cute.tools.bench.timing import buffer_sets_for

    device = timer.device
    nbytes = T * H * dtype_bytes(act) * (4 if residual else 3)
    w = torch.randn(H, device=device, dtype=torch_dtype(act))
    sets = []
    for _ in range(buffer_sets_for(nbytes, timer.l2_bytes)):
        x = torch.randn(T, H, device=device, dtype=torch_dtype(act))
        rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)[1]
        sets.append((torch.randn_like(x), x, rstd, torch.randn_like(x) if residual else None))
    g0, x0, rstd0, _ = sets[0]
    dw_ref = (g0.double() * x0.double() * rstd0.double()[:, None]).sum(0)
    copy_us = timer.copy_ceiling(nbytes, args.reps)["copy_gpu_us"]
    reference_dx = None
    for candidate in ["default"] + args.candidates:
        with ExitStack() as stack:
            for kind, choices in parse_candidate(candidate, arch, act, H).items():
                dtype = "fp32" if kind == "dw" else act
                stack.enter_context(overridden(kind, arch, dtype, H, **choices))
            try:
                backward_config(arch, act, act, H, residual)
            except ValueError as err:  # a choice this mode cannot take (e.g. a deep ring with residual)
                print(f"scan {act} T={T} H={H} res={residual} cand={candidate} skipped: {err}", flush=True)
                continue
            workspace = cake_cute.cake_rmsnorm_train_backward_workspace(T, H, device, residual=residual)
            dx, dw = _rotated_backward(sets[:1], w, workspace)()
            reference_dx = dx.clone() if reference_dx is None else reference_dx
            err = ((dw.double() - dw_ref).norm() / dw_ref.norm()).item()
            call = _rotated_backward(sets, w, workspace)
            us = timer.device_us(call, args.reps)
            programs = launch_plan.backward_programs(T, H, act, act, residual, device_facts(device))
            label = f"scan {act} T={T} H={H} res={residual} cand={candidate} programs={programs}"
            checks = f"dx_bitwise={torch.equal(dx, reference_dx)} dw_rel_err={err:.2e}"
            kernels = ""
            if args.kernels:
                kernels = " ".join(f"{k}={v:.2f}" for k, v in kernel_us(call, args.reps).items())
            _report(label, us, nbytes, f"frac_copy={copy_us / us:.3f} {checks} {kernels}")


def tune_scan(args, arch: str) -> None:
    from cake_cute.tools.bench.timing import DeviceTimer

    timer = DeviceTimer(torch, torch.device("cuda"))
    timer.warm_clocks()
    for H in args.hidden:
        for T in _ints(args.rows_list):
            for residual in (False, True):
                _scan_case(timer, arch, args.dtype, T, H, residual, args)
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("fwd", "bwd", "ring", "scan"))
    parser.add_argument("hidden", type=_ints, help="H (ring: a comma-separated list)")
    parser.add_argument("candidates", nargs="*")
    parser.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=0, help="T (default: 2^27 / H)")
    parser.add_argument("--rows-list", default="2048,4096,8192,16384", help="scan: the T values")
    parser.add_argument("--kernels", action="store_true", help="scan: each kernel's profiler time too")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if not cake_cute.is_cake_rmsnorm_train_supported(device):
        print("benchmarks/tune.py needs a supported GPU", file=sys.stderr)
        return 2
    modes = {"fwd": tune_forward, "bwd": tune_backward, "ring": tune_ring, "scan": tune_scan}
    modes[args.mode](args, device_facts(device).arch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
