#!/usr/bin/env python
"""``python benchmarks/hostbound.py OUT.json``: the host-bound cost of an RMSNorm training step, cake_cute
next to torch, quack and Liger (those that import), all in one process, bf16, H = 4096, T in (1, 16, 256,
2048), eager and under ``torch.compile``, plain and residual (torch: ``x + r`` then ``F.rms_norm``).

Each number is the wall time of ``--reps`` back-to-back calls with no synchronization inside
(synchronize, ``time.perf_counter``, the calls, synchronize), divided by the count, the median of
five such rounds, the implementations taking turns within each round (``per_call_us``): when the GPU
runs behind the host this is what a call costs the host. Ops:

* ``step``: ``y = norm(x, w[, r])`` with autograd, then ``torch.autograd.grad(y, (x, w[, r]), g)``;
* ``fwd``: the same call under ``torch.no_grad()``;
* ``bwd``: ``torch.autograd.grad(..., retain_graph=True)`` on a graph built once.

``cake_cute_functional`` (eager only) has ``fwd`` and ``bwd`` rows of cake_cute's functional API, the
calls a framework with its own autograd makes: ``cake_rmsnorm_train_forward`` and
``cake_rmsnorm_train_backward`` (on the saved x or h_new and rstd of one forward), to be read against
torch's ``fwd`` and autograd ``bwd`` rows. ``cake_cute_mxfp8`` is the forward straight to MXFP8
(``cake_rmsnorm_fp8``; its step differentiates the handle ``y``), and ``cake_cute_mxfp8_op`` (eager only)
the same through its custom op, whose C++ kernels serve registered signatures.

The implementations are the adapters of ``cake_cute.tools.bench.peers`` (the ones the sweep
measures), plus ``cake_cute_module``: the ``CakeRMSNorm`` module's call; ``cake_cute_apply``:
``CakeRMSNormFunction.apply(x, w, eps, residual, deterministic)``, the entry FlashInfer's users call,
which follows the same routing rule as ``cake_cute``
(``cake_rmsnorm``: the native path, ``cake_cute.runtime.native``, once the first call has registered the
signature), and ``cake_cute_python``: the same calls forced onto the Python path (the engine's
``Function.apply`` of ``CakeRMSNormFunction``, below the routing). ``mode = compile`` wraps each
adapter's call in ``torch.compile(dynamic=False)``, one graph per (T, residual); ``mode = compile-graphs`` in
``torch.compile(dynamic=False, mode="reduce-overhead")``, which replays the compiled graphs as CUDA
graphs (each call marks a new step; ``bwd`` is not timed there: a replay overwrites the outputs a
retained graph would read).

``--cpu-layers`` (no CUDA needed): the cost of cake_cute's Python layers on the path every non-eager-CUDA
call takes (``cake_rmsnorm`` -> autograd -> argument checks -> the ``cake_cute::`` custom ops), with the
ops' CPU kernels replaced through ``torch.library.register_kernel`` by kernels that only allocate
their outputs, next to torch's own CPU ``F.rms_norm`` step (which also computes). The eager CUDA path
launches without the ops and needs a GPU for its device checks; the GPU mode measures it. With the
native extension built, each ``cake_cute`` call here first asks it, and it hands CPU tensors back
(``path: "cpu-layers+native-route"``): that refusal is the routing cost every eager call pays before
its launch; the native launch itself needs CUDA tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import kept_rows, write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402

EPS = 1e-6
IMPLS = (
    "cake_cute",
    "cake_cute_apply",
    "cake_cute_module",
    "cake_cute_functional",
    "cake_cute_python",
    "cake_cute_mxfp8",
    "cake_cute_mxfp8_op",
    "torch",
    "quack",
    "liger",
)
# Compiled, these run cake_cute's custom ops, as cake_cute and cake_cute_mxfp8 do.
EAGER_ONLY = ("cake_cute_python", "cake_cute_functional", "cake_cute_mxfp8_op")


class CakeApply:
    """``CakeRMSNormFunction.apply(x, w, eps, residual, deterministic)``: the routed public entry."""

    def __init__(self, torch, eps):
        from cake_cute import CakeRMSNormFunction

        self._apply = CakeRMSNormFunction.apply
        self._eps = eps

    def forward(self, x, w, residual):
        out = self._apply(x, w, self._eps, residual, True)
        return out if isinstance(out, tuple) else (out,)


class CakeModule:
    """``CakeRMSNorm.forward(x, residual=r)``, the module's call, holding the step's w as its weight."""

    def __init__(self, torch, eps):
        from cake_cute import CakeRMSNorm

        self._norm_class, self._eps, self._norms = CakeRMSNorm, eps, {}

    def forward(self, x, w, residual):
        norm = self._norms.get(id(w))
        if norm is None:
            norm = self._norm_class(w.shape[0], self._eps, device=w.device, dtype=w.dtype)
            self._norms[id(w)] = norm
            del norm.weight  # the step's own w, so its gradient is the one asked for
            norm.weight = w
        out = norm(x, residual=residual)
        return out if isinstance(out, tuple) else (out,)


class CakePythonPath(CakeApply):
    """cake_cute's eager step on its Python path: the engine's ``Function.apply`` of
    ``CakeRMSNormFunction`` (below its routing ``apply``), for the side-by-side rows."""

    def __init__(self, torch, eps):
        from functools import partial

        from cake_cute import CakeRMSNormFunction

        self._apply = partial(torch.autograd.Function.apply.__func__, CakeRMSNormFunction)
        self._eps = eps


class CakeFunctional:
    """cake_cute's functional API: ``op_calls`` gives its ``fwd`` and ``bwd`` calls (no autograd)."""

    def __init__(self, torch, eps):
        from cake_cute import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward

        self._forward, self._backward = cake_rmsnorm_train_forward, cake_rmsnorm_train_backward
        self._eps = eps

    def op_calls(self, x, w, r, g):
        x, w = x.detach(), w.detach()
        r = None if r is None else r.detach()
        _, rstd, *h_new = self._forward(x, w, self._eps, residual=r)
        saved, g_residual = (h_new[0], g) if r is not None else (x, None)

        def fwd():
            self._forward(x, w, self._eps, residual=r)

        def bwd():
            self._backward(g, saved, w, rstd, g_residual=g_residual)

        return {"fwd": fwd, "bwd": bwd}


class CakeMxfp8:
    """cake_cute's forward straight to MXFP8 (``cake_rmsnorm_fp8``, eager: by the routing rule);
    the differentiable handle ``y`` first, so a step is the quantizing forward and the RMSNorm backward."""

    def __init__(self, torch, eps):
        from cake_cute import cake_rmsnorm_fp8

        self._fp8, self._eps = cake_rmsnorm_fp8, eps

    def forward(self, x, w, residual):
        out = self._fp8(x, w, self._eps, residual=residual, recipe="mxfp8")
        return out.y, out.data, out.scales


class CakeMxfp8Op:
    """The same forward through its custom op ``cake_cute::rmsnorm_fp8_fwd`` (what torch.compile's graphs
    call; C++ kernels once the Python path has registered the signature), called eagerly: what routing
    eager calls through the op would cost."""

    def __init__(self, torch, eps):
        import cake_cute  # noqa: F401 (defines the op)

        self._op, self._eps = torch.ops.cake_cute.rmsnorm_fp8_fwd, eps

    def forward(self, x, w, residual):
        data, scales, y, _, _ = self._op(x, w, self._eps, residual, "mxfp8", False, 0.0)
        return y, data, scales


def factories() -> dict:
    from cake_cute.tools.bench import peers

    return {
        **peers.FACTORIES,
        "cake_cute_apply": CakeApply,
        "cake_cute_module": CakeModule,
        "cake_cute_python": CakePythonPath,
        "cake_cute_functional": CakeFunctional,
        "cake_cute_mxfp8": CakeMxfp8,
        "cake_cute_mxfp8_op": CakeMxfp8Op,
    }


ROUNDS = 5


def per_call_us(calls: dict, reps: int, sync) -> dict:
    """Host time per call of each of ``calls`` ({name: zero-argument call}): the median over ``ROUNDS``
    rounds of the mean of ``reps`` back-to-back calls, after 20 warm-up calls each. The implementations
    take turns within every round, so a slow phase of a busy host (one round alone moves by 10-20%)
    falls on all of them."""
    for fn in calls.values():
        for _ in range(20):
            fn()
    sync()
    means: dict = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            means[name].append((time.perf_counter() - start) / reps * 1e6)
    return {name: statistics.median(values) for name, values in means.items()}


def op_callables(forward, x, w, r, g):
    """{"step", "fwd", "bwd"} -> a zero-argument call of that op for one (x, w, r)."""
    leaves = (x, w) if r is None else (x, w, r)

    def step():
        torch.autograd.grad(forward(x, w, r)[0], leaves, g)

    def fwd():
        with torch.no_grad():
            forward(x, w, r)

    # A first call (a native path registers its signature on it), then the graph bwd re-runs: built
    # by the path every later call takes.
    forward(x, w, r)
    graph_output = forward(x, w, r)[0]

    def bwd():
        torch.autograd.grad(graph_output, leaves, g, retain_graph=True)

    return {"step": step, "fwd": fwd, "bwd": bwd}


# torch.compile's mode for each compiled measurement mode.
COMPILE_MODES = {"compile": "default", "compile-graphs": "reduce-overhead"}


def graph_replays(calls: dict) -> dict:
    """``step`` and ``fwd`` of ``op_callables`` for CUDA-graph replays: each call begins a new step."""

    def marked(call):
        def replay():
            torch.compiler.cudagraph_mark_step_begin()
            call()

        return replay

    return {op: marked(calls[op]) for op in ("step", "fwd")}


def measure(adapters: dict, mode: str, rows: list, args, device, sync) -> None:
    """Append the rows of every implementation ({name: adapter}) in one mode over every (residual, T),
    the implementations timed side by side at each point (``per_call_us``)."""
    for residual in (False, True):
        for tokens in args.tokens:
            if mode in COMPILE_MODES:
                torch._dynamo.reset()
            calls = {}
            for impl, adapter in adapters.items():
                try:
                    calls[impl] = point_calls(adapter, mode, residual, tokens, args.hidden, device)
                except Exception as e:  # a peer that fails under compile: note it, measure the rest
                    print(f"skip {impl} {mode}: {type(e).__name__}: {e}", file=sys.stderr)
            for op in ("step", "fwd", "bwd"):
                timed = {impl: ops[op] for impl, ops in calls.items() if op in ops}
                for impl, us in per_call_us(timed, args.reps, sync).items():
                    row = dict(impl=impl, op=op, mode=mode, residual=residual, T=tokens, H=args.hidden)
                    rows.append({**row, "dtype": "bfloat16", "us_per_call": round(us, 2), **args.extra})
                    print(json.dumps(rows[-1]), flush=True)


def point_calls(adapter, mode: str, residual: bool, tokens: int, hidden: int, device) -> dict:
    """``op_callables`` of one implementation (its own ``op_calls`` where it has them) at one (mode,
    residual, T), on inputs seeded by T."""
    gen = torch.Generator(device=device).manual_seed(tokens)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()

    x, w = leaf(tokens, hidden), leaf(hidden)
    r = leaf(tokens, hidden) if residual else None
    g = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    if hasattr(adapter, "op_calls"):
        return adapter.op_calls(x, w, r, g)
    fn = adapter.forward
    if mode in COMPILE_MODES:
        fn = torch.compile(fn, dynamic=False, mode=COMPILE_MODES[mode])
    calls = op_callables(fn, x, w, r, g)
    return graph_replays(calls) if mode == "compile-graphs" else calls


def gpu_main(args) -> list:
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False  # bwd re-runs a compiled backward on a retained graph
    import cake_cute

    cake_cute.prepare()  # the native host path is built before a step, never in one
    adapters = {}
    for impl in args.impls:
        try:
            adapters[impl] = factories()[impl](torch, EPS)
        except ImportError as e:
            print(f"skip {impl}: {e}", file=sys.stderr)
    rows: list = []
    for mode in args.modes:
        chosen = {k: a for k, a in adapters.items() if mode not in COMPILE_MODES or k not in EAGER_ONLY}
        measure(chosen, mode, rows, args, "cuda", torch.cuda.synchronize)
    return rows


def _allocating_forward(x, w, eps, residual=None, weight_offset=0.0):
    h_new = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32), h_new


def _allocating_backward(g, x, w, rstd, g_residual=None, weight_offset=0.0):
    return torch.empty_like(x), torch.empty_like(w)


def cpu_layers_main(args) -> list:
    """cake_cute's layers with allocate-only CPU kernels vs torch's CPU F.rms_norm (see the module)."""
    from cake_cute.runtime import native

    torch.library.register_kernel("cake_cute::rmsnorm_fwd", "cpu", _allocating_forward)
    torch.library.register_kernel("cake_cute::rmsnorm_bwd", "cpu", _allocating_backward)
    native.load()
    adapters = {impl: factories()[impl](torch, EPS) for impl in ("cake_cute", "cake_cute_apply", "torch")}
    rows: list = []
    measure(adapters, "eager", rows, args, "cpu", lambda: None)
    for row in rows:  # the path each row's calls take, and what their kernels do
        cake = row["impl"] != "torch"
        row["path"] = "cpu-layers+native-route" if cake and native.extension else "cpu-layers"
        row["kernel"] = "allocate-only" if cake else "torch cpu"
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument(
        "--tokens",
        type=lambda s: [int(t) for t in s.split(",")],
        help="T values (default 1,16,256,2048; with --cpu-layers 1,16, where torch's CPU op computes)",
    )
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["eager", "compile"],
        help=f"eager, {', '.join(COMPILE_MODES)}",
    )
    p.add_argument("--cpu-layers", action="store_true", help="CPU only: cake_cute's Python layers")
    p.add_argument("--append", action="store_true", help="keep the rows already in OUT (a split run)")
    args = p.parse_args(argv)
    args.extra = {}
    args.tokens = args.tokens or ([1, 16] if args.cpu_layers else [1, 16, 256, 2048])
    _use_source_tree()
    rows = kept_rows(args.out, args.append) + (cpu_layers_main(args) if args.cpu_layers else gpu_main(args))
    device = "cpu" if args.cpu_layers else torch.cuda.get_device_name()
    write_results(args.out, "benchmarks/hostbound.py", device, rows, reps=args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
