"""Head-dim scan: the forward's and backward's current config and candidate configs at per-head norm
shapes (H = 32 ... 256), against quack, torch.compile and a device copy of the same bytes.

    python benchmarks/headdim_scan.py [--hidden 64,128] [--rows 2^16,2^18,2^20] [--vs quack,compile]
                                [--only fwd-direct,bwd-lean] [--out DIR] [--budget-s 210] [--list]

For every (H, T, residual off/on): one copy ceiling per op, then each implementation's autograd call,
timed the way ``cake-cute bench`` times a row (``tools.bench.runner.Sweep.measure``: input sets rotated
past the L2, device time between CUDA events behind a spin). cake_cute runs its current config
(``default``) and every candidate of ``candidates(H, dtype)`` (those of ``--only``), each inside
``kernels.config.overridden`` (its own compile-cache entry; nothing patched). Each candidate is also
checked through the functional API on the first input set: the same bits on a second call
(determinism), a row's outputs the same bits when it is one of fewer rows (batch invariance: the first
``T // 3 + 5`` rows alone), and whether its outputs are the default's bits (y, rstd, h_new for the
forward; dx, and separately dw, for the backward, whose dw is also compared with an FP64 reference:
another number of partial rows sums it in another order).

torch.compile compiles once per (H, residual) with the row count dynamic (``mark_dynamic``; the sweep's
peer compiles every shape statically), so the scan does not pay one inductor compile per shape; a
peer that does not import is skipped with a note. Every cake_cute kernel is compiled first, by a
process pool, into the disk cache; cake_cute's rows of every case run before any peer is imported
(quack patches CuTe classes process-wide, and each override change reloads cake_cute's kernels), then
the peers' rows of the cases measured. Cases run in the order given (the default puts H = 64, 128, 256
first); cake_cute's rows stop starting new cases after ``CAKE_SHARE`` of ``--budget-s`` seconds, the
peers' after ``--budget-s``; the JSON (``$OUT/headdim-scan.json``, the sweep's row schema plus
``candidate``, ``overrides`` and the checks) is rewritten after every case, the log
(``headdim-scan.log``) line by line, so a timeout keeps what was measured. Without ``$OUT`` and
``--out`` the files go to evidence/<date>-<gpu>-headdim-scan/.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from argparse import Namespace
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tune.py's candidate parser, in workers too

from cake_cute.kernels.config import backward_config, forward_config, overridden
from cake_cute.kernels.tiling import MAX_CTAS_PER_SM, MIN_THREADS_PER_CTA, RowTiling
from cake_cute.tools.bench.cases import parse_count_list
from cake_cute.vocab import DTYPE_NAMES

# H = 64 is where the backward trails quack most; then the head_dim of most models, then the rest.
HIDDEN = (64, 128, 256, 32, 96, 80, 192)
ROWS = (1 << 16, 1 << 18, 1 << 20)
PEERS = ("quack", "compile")
ARCH = "sm_90a"  # the candidates are Hopper configs (the GPU round's H200)
REPS, PROF_REPS = 2, 5
CAKE_SHARE = 0.65  # of --budget-s for cake_cute's rows; the peers' rows of the same cases get the rest
EPS = 1e-6
# An exact backward cover gives a lane at most this many vectors: three (H = 96, 192) compile to 150
# registers on sm_90a, so they get EXACT_BWD_REGISTERS (three CTAs per SM); five (H = 80) need 222.
MAX_BWD_VECS = 3
EXACT_BWD_REGISTERS = 160
CTA_THREADS = (128, 256)  # backward CTAs of several rows
SMALL_FWD_CTA = 64  # forward CTAs of two warps, 32 of them per SM
DEEP_RING = 8  # ring slots of a one-vector backward tiling (56 registers, 36 KB of shared memory)
MAX_FWD_VECS = 8
WIDE_CTA_FACTORS = (2, 4)  # forward CTAs of 256 and 512 threads
ROWS_IN_FLIGHT = 8  # partial rows a dW reduction lane loads before adding them (32 registers)
REDUCE_THREADS = 1024


@dataclass(frozen=True)
class Candidate:
    """A named set of override choices (``tune.py``'s ``kind.choice=value,...`` text) for one op."""

    name: str
    op: str
    overrides: str


def _tiling_text(t: RowTiling) -> str:
    return f"{t.threads_per_row}:{t.vecs_per_thread}:{t.rows_per_cta}"


def _lanes(tpr: int, vpt: int, base: RowTiling) -> RowTiling:
    """``base`` with ``tpr`` lanes of ``vpt`` vectors per row and as many rows as fill 128 threads."""
    return replace(
        base, threads_per_row=tpr, vecs_per_thread=vpt, rows_per_cta=max(1, MIN_THREADS_PER_CTA // tpr)
    )


def exact_cover(base: RowTiling, max_vecs: int) -> RowTiling | None:
    """The tiling of the most power-of-two lanes (at most a warp) that cover the row with no idle lane
    and at most ``max_vecs`` vectors each; None where ``base`` already covers it exactly or none does."""
    if base.covers_row_exactly or base.cluster_n > 1 or base.hidden % base.vec:
        return None
    vecs = base.hidden // base.vec
    fits = [tpr for tpr in (32, 16, 8, 4, 2, 1) if vecs % tpr == 0 and vecs // tpr <= max_vecs]
    return _lanes(fits[0], vecs // fits[0], base) if fits else None


def one_vector_lanes(base: RowTiling) -> RowTiling | None:
    """One vector per lane (twice or more the lanes of ``base``), where that covers the row exactly
    within a warp; None where ``base`` already has one vector per lane."""
    if base.vecs_per_thread == 1 or base.hidden % base.vec or base.cluster_n > 1:
        return None
    vecs = base.hidden // base.vec
    if vecs > 32 or vecs & (vecs - 1):
        return None
    return _lanes(vecs, 1, base)


def forward_candidates(hidden: int, dtype: str, arch: str = ARCH) -> list[Candidate]:
    """Forward tilings to time against the rule's: an exact cover where the rule's lanes overrun H,
    lanes of half and of one vector each (more lanes per row, fewer rows per CTA), lanes of twice
    the vectors (up to the forward's 8; fewer lanes per row, more rows per CTA, half the CTAs), and
    the rule's lanes in CTAs of ``WIDE_CTA_FACTORS`` times the rows (fewer, larger CTAs: a call of
    2^16 rows is a single wave of 128-thread CTAs, whose launch and ramp weigh on a call of a few
    microseconds); and the rule's lanes and one-vector lanes in ``SMALL_FWD_CTA``-thread CTAs, every
    SM's 32 CTA slots in use (``fwd-cta64``, ``fwd-vpt1-cta64``: the launch shape Nsight Compute found
    for torch.compile's forward at bf16 H = 64, 2^16 residual rows, 8192 CTAs of 2 warps and 32
    registers, where it leads: evidence/kernel-rules-h200-2026-12-01/headdim-ncu/)."""
    base = forward_config(arch, dtype, hidden).tiling
    found = []
    exact = exact_cover(base, MAX_FWD_VECS)
    if exact is not None:
        found.append(("fwd-exact", exact))
    if base.covers_row_exactly and base.vecs_per_thread % 2 == 0 and base.vecs_per_thread > 2:
        found.append(("fwd-half", _lanes(base.threads_per_row * 2, base.vecs_per_thread // 2, base)))
    one = one_vector_lanes(base)
    if one is not None:
        found.append(("fwd-vpt1", one))
    if base.covers_row_exactly and base.threads_per_row > 1 and base.vecs_per_thread * 2 <= MAX_FWD_VECS:
        found.append(("fwd-double", _lanes(base.threads_per_row // 2, base.vecs_per_thread * 2, base)))
    if base.threads_per_cta == MIN_THREADS_PER_CTA and base.rows_per_cta > 1:
        for factor in WIDE_CTA_FACTORS:
            found.append((f"fwd-rows{factor}x", replace(base, rows_per_cta=base.rows_per_cta * factor)))
    tiled = [Candidate(name, "fwd", f"fwd.tiling={_tiling_text(t)}") for name, t in found]
    for name, lanes in (("fwd", base), ("fwd-vpt1", one)):
        if lanes is not None and lanes.threads_per_row <= SMALL_FWD_CTA // 2:
            small = replace(lanes, rows_per_cta=SMALL_FWD_CTA // lanes.threads_per_row)
            text = f"fwd.tiling={_tiling_text(small)},fwd.min_ctas_per_sm={MAX_CTAS_PER_SM}"
            tiled.append(Candidate(f"{name}-cta{SMALL_FWD_CTA}", "fwd", text))
    return tiled


def backward_candidates(hidden: int, dtype: str, arch: str = ARCH) -> list[Candidate]:
    """Backward configs to time against the rule's. A short-row backward CTA holds several row groups,
    which fold their dW sums in shared memory, so a program writes one FP32 partial row, and
    ``dw_reduce`` sums them with ``REDUCE_THREADS``-thread CTAs whose lanes have ``ROWS_IN_FLIGHT``
    partial rows in flight (the rule for at most 64 column vectors). The candidates:

    - ``dw256``: the reduction of wider rows (256 threads, one partial row at a time), which the
      folded partial rows may make enough (dW bitwise the rule's when both sum in the same order);
    - ``bwd-exact``: an exact cover where the rule's lanes overrun H (H = 96, 192: three vectors per
      lane, 160 registers);
    - ``bwd-vpt1``: one vector per lane (half the rows per CTA, half the bytes in flight), also with a
      ring of ``DEEP_RING`` row tiles (plain mode: residual mode keeps two), which gives back the
      bytes in flight that halving the rows per CTA took;
    - ``bwd-cta128``, ``bwd-cta256``: the rule's lanes in CTAs of 128 and of 256 threads, in both
      modes (one of them is the rule's tiling in each mode; twice the rows per CTA is twice the bytes
      in flight per program and half the programs)."""
    base = backward_config(arch, dtype, dtype, hidden, False).tiling
    found = [Candidate("dw256", "bwd", "dw.threads=256,dw.rows_in_flight=1")]
    exact = exact_cover(base, MAX_BWD_VECS)
    if exact is not None:
        text = f"bwd.tiling={_tiling_text(exact)},bwd.register_budget={EXACT_BWD_REGISTERS}"
        found.append(Candidate("bwd-exact", "bwd", text))
    one = one_vector_lanes(base)
    if one is not None:
        found.append(Candidate("bwd-vpt1", "bwd", f"bwd.tiling={_tiling_text(one)}"))
        text = f"bwd.tiling={_tiling_text(one)},bwd.ring_depth={DEEP_RING}"
        found.append(Candidate(f"bwd-vpt1-ring{DEEP_RING}", "bwd", text))
    if base.rows_per_cta > 1 and base.cluster_n == 1:
        for threads in CTA_THREADS:
            rows = replace(base, rows_per_cta=threads // base.threads_per_row)
            found.append(Candidate(f"bwd-cta{threads}", "bwd", f"bwd.tiling={_tiling_text(rows)}"))
    return found


def candidates(hidden: int, dtype: str, only: list[str] | None = None, arch: str = ARCH) -> list[Candidate]:
    """The candidates of one (H, dtype), the forward's, then the backward's; those named in ``only``
    where given."""
    found = forward_candidates(hidden, dtype, arch) + backward_candidates(hidden, dtype, arch)
    return [c for c in found if only is None or c.name in only]


def cases(hidden: list[int], rows: list[int]) -> list[tuple[int, int, bool]]:
    """(H, T, residual) in scan order: H outer, T, then residual off and on."""
    return [(h, t, residual) for h in hidden for t in rows for residual in (False, True)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=parse_count_list, default=list(HIDDEN), help="H values, in scan order")
    p.add_argument("--rows", type=parse_count_list, default=list(ROWS), help="T values (2^16 forms accepted)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16")
    p.add_argument("--vs", default=",".join(PEERS), help="peers out of quack,compile,liger ('none' for none)")
    p.add_argument("--out", type=Path, help="folder of the JSON and log (default: $OUT, else evidence/)")
    p.add_argument("--budget-s", type=float, default=210.0, help="start no case after this many seconds")
    p.add_argument("--reps", type=int, default=PROF_REPS, help="device-timed calls per row")
    p.add_argument("--only", help="the candidates to run, by name (default: every one)")
    p.add_argument("--list", action="store_true", help="print the cases and candidates and exit (no GPU)")
    return p


def parse_args(argv: list[str] | None = None) -> Namespace:
    """The scan's arguments; ``vs`` becomes a list, an unknown peer is a usage error (exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.vs = [] if args.vs == "none" else [p.strip() for p in args.vs.split(",") if p.strip()]
    unknown = [p for p in args.vs if p not in ("quack", "compile", "liger")]
    if unknown:
        parser.error(f"--vs: unknown peer {', '.join(unknown)} (expected quack, compile, liger or none)")
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.only is not None:
        args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    return args


def out_dir(args: Namespace, gpu: str, date: str) -> Path:
    """``--out``, else ``$OUT``, else evidence/<date>-<gpu>-headdim-scan/."""
    from cake_cute.tools.bench.results import REPO, slugify

    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return REPO / "evidence" / f"{date}-{slugify(gpu)}-headdim-scan"


def listing(args: Namespace) -> str:
    """The cases and every H's candidates, as text."""
    lines = [f"{len(cases(args.hidden, args.rows))} cases: H {args.hidden} x T {args.rows} x residual off/on"]
    for h in args.hidden:
        for c in candidates(h, args.dtype, args.only):
            lines.append(f"H={h} {c.op} {c.name}: {c.overrides}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ on a GPU


class Log:
    """Lines to stdout and to the log file at once."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")


def _overrides(stack: ExitStack, text: str, dtype: str, hidden: int) -> None:
    """Enter the override contexts of a candidate's text; a dW entry for both of dW's output dtypes
    (FP32 for the functional API, w's dtype for autograd)."""
    from tune import parse_candidate

    for kind, choices in parse_candidate(text, ARCH, dtype, hidden).items():
        for entry_dtype in {"fp32", dtype} if kind == "dw" else {dtype}:
            stack.enter_context(overridden(kind, ARCH, entry_dtype, hidden, **choices))


def _functional(torch, op: str, t: dict, rows: int | None = None) -> tuple:
    """The functional API's outputs on the first ``rows`` rows of input set ``t`` (y, rstd[, h_new] or
    dx, dw), cloned."""
    import cake_cute

    x, w, r = t["x"].detach()[:rows], t["w"].detach(), t.get("r")
    r = None if r is None else r.detach()[:rows]
    out = cake_cute.cake_rmsnorm_train_forward(x, w, EPS, residual=r)
    if op == "bwd":
        h = out[2] if r is not None else x
        gh = t["gh"][:rows] if r is not None else None
        out = cake_cute.cake_rmsnorm_train_backward(t["g"][:rows], h, w, out[1], g_residual=gh)
    return tuple(o.clone() for o in out)


def _dw_error(torch, t: dict, dw) -> float:
    """|dw - FP64 dw| / |FP64 dw| on input set ``t``."""
    x, r = t["x"].detach().double(), t.get("r")
    h = x if r is None else (t["x"].detach() + r.detach()).double()
    rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS)
    want = (t["g"].double() * h * rstd).sum(0)
    return ((dw.double() - want).norm() / want.norm()).item()


def checks(torch, op: str, t: dict, default: tuple | None) -> dict:
    """Determinism, batch invariance and agreement with the default config's bits (see the module
    docstring) of the config in force, on input set ``t``."""
    first, second = _functional(torch, op, t), _functional(torch, op, t)
    rows = t["x"].shape[0] // 3 + 5
    fewer = _functional(torch, op, t, rows)
    per_row = first[:1] if op == "bwd" else first  # dw sums every row: not a per-row output
    found = {
        "deterministic": all(torch.equal(a, b) for a, b in zip(first, second)),
        "batch_invariant": all(torch.equal(a[:rows], b) for a, b in zip(per_row, fewer)),
    }
    if default is not None:
        found["bitwise_default"] = all(torch.equal(a, b) for a, b in zip(per_row, default[: len(per_row)]))
    if op == "bwd":
        found["dw_rel_err"] = float(f"{_dw_error(torch, t, first[1]):.3e}")
        if default is not None:
            found["dw_bitwise_default"] = torch.equal(first[1], default[1])
    return found


def compile_variant(task: tuple) -> str | None:
    """Compile into the disk cache every kernel a scan row of ``task`` = (H, residual, dtype, override
    text) can launch (forward, backward, both dW reductions); None, or why it could not."""
    from cake_cute.runtime.cache import get_kernel
    from cake_cute.runtime.specs import KernelSpec, ReduceSpec

    hidden, residual, dtype, text = task
    try:
        with ExitStack() as stack:
            _overrides(stack, text, dtype, hidden)
            backward_config(ARCH, dtype, dtype, hidden, residual)  # a choice this mode cannot take raises
            for kind in ("fwd", "bwd"):
                get_kernel(KernelSpec(kind, ARCH, dtype, dtype, hidden, residual=residual))
            for out in {dtype, "fp32"}:
                get_kernel(ReduceSpec(ARCH, out, hidden))
    except Exception as e:
        return f"H={hidden} residual={residual} {text}: {type(e).__name__}: {str(e)[:200]}"
    return None


def compile_all(hidden: list[int], dtype: str, only: list[str] | None, jobs: int) -> list[str]:
    """Every kernel of the scan compiled into the disk cache by ``jobs`` processes (the compiles are
    independent and single-threaded); the problems found."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [
        (h, residual, dtype, cand.overrides)
        for h in hidden
        for residual in (False, True)
        for cand in [Candidate("default", "", "default"), *candidates(h, dtype, only)]
    ]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [problem for problem in pool.map(compile_variant, tasks) if problem]


class RowsDynamicCompile:
    """torch.compile of the sweep's FP32 reference with the row count dynamic: one graph per (H, dtype,
    residual) serves every T."""

    name = "compile"

    def __init__(self, torch, eps):
        from cake_cute.tools.bench.peers import FACTORIES

        self._peer = FACTORIES["compile"](torch, eps)  # its settings and its reference functions
        self._torch = torch
        self._graphs: dict = {}

    def forward(self, x, w, residual):
        key = (x.shape[-1], x.dtype, w.dtype, residual is not None)
        if key not in self._graphs:
            peer = self._peer
            src = peer._plain if residual is None else peer._with_residual
            self._graphs[key] = self._torch.compile(src, fullgraph=True)
        fn = self._graphs[key]
        self._torch._dynamo.mark_dynamic(x, 0)
        if residual is None:
            return (fn(x, w),)
        self._torch._dynamo.mark_dynamic(residual, 0)
        return fn(x, residual, w)

    def after_backward(self, tensors) -> None:
        """Nothing to restore."""


class Scan:
    """The state of one scan on the GPU: the sweep that times rows, the log, the rows so far."""

    def __init__(self, args: Namespace, torch, log: Log):
        from cake_cute.tools.bench.runner import Sweep

        self.args, self.torch, self.log = args, torch, log
        sweep_args = Namespace(grid="headdim", reps=REPS, prof_reps=args.reps, warmup=1, eps=EPS)
        self.sweep = Sweep(sweep_args, torch)
        self.rows: list[dict] = []
        self.peers: list = []

    def note(self, text: str) -> None:
        """Log a note and keep it for the results file."""
        self.sweep.notes.append(text)
        self.log(f"note: {text}")

    def precompile(self) -> float:
        """Run every cake_cute variant of the scan (the default's and each candidate's, both dW output
        dtypes) on a few rows, which loads what ``compile_all`` compiled; returns the seconds it
        took."""
        import cake_cute

        torch, dtype, start = self.torch, self.args.dtype, time.perf_counter()
        for hidden in self.args.hidden:
            for residual in (False, True):
                t = self.sweep.input_sets(8, hidden, dtype, residual)[0]
                for cand in [Candidate("default", "", "default"), *candidates(hidden, dtype, self.args.only)]:
                    with ExitStack() as stack:
                        try:
                            _overrides(stack, cand.overrides, dtype, hidden)
                            _functional(torch, "bwd", t)
                            out = cake_cute.cake_rmsnorm(t["x"], t["w"], EPS, residual=t.get("r"))
                            out = out if isinstance(out, tuple) else (out,)
                            torch.autograd.grad(out, (t["x"], t["w"]), [torch.ones_like(o) for o in out])
                        except Exception as e:
                            reason = f"{type(e).__name__}: {str(e)[:200]}"
                            self.note(f"precompile H={hidden} residual={residual} {cand.name}: {reason}")
        torch.cuda.synchronize()
        return round(time.perf_counter() - start, 1)

    def import_peers(self) -> None:
        """The peers of ``--vs`` that import; a note for each that does not."""
        from cake_cute.tools.bench.peers import FACTORIES

        found = self.peers
        for name in self.args.vs:
            try:
                found.append(
                    RowsDynamicCompile(self.torch, EPS)
                    if name == "compile"
                    else FACTORIES[name](self.torch, EPS)
                )
            except Exception as e:
                self.note(f"{name}: skipped, import failed ({type(e).__name__}: {str(e)[:200]})")

    def _row(self, impl, op: str, residual: bool, shape, sets, copy: dict, extra: dict) -> None:
        start = time.perf_counter()
        row = self.sweep.measure(impl, op, residual, self.args.dtype, shape, sets, copy)
        row.update(extra)
        self.rows.append(row)
        frac = f"{row['frac_copy']:.3f}" if "frac_copy" in row else row.get("error", "?")[:120]
        checks_text = " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("candidate", "overrides"))
        self.log(
            f"H={shape[1]:<4} T={shape[0]:<8} res={int(residual)} {op} {row['impl']:<9} "
            f"{extra.get('candidate', ''):<18} gpu_us={row.get('gpu_us', float('nan')):9.2f} "
            f"frac_copy={frac} "
            f"{checks_text} [{time.perf_counter() - start:.1f} s]"
        )

    def case(self, hidden: int, rows: int, residual: bool, part: str) -> None:
        """The rows of one (H, T, residual): ``part`` "cake" (the default and every candidate) or
        "peers"."""
        from cake_cute.tools.bench.cases import model_bytes
        from cake_cute.tools.bench.peers import FACTORIES

        torch, dtype, shape = self.torch, self.args.dtype, (rows, hidden)
        sets = self.sweep.input_sets(rows, hidden, dtype, residual)
        copies = {
            op: self.sweep.timer.copy_ceiling(model_bytes(op, residual, rows, hidden, dtype), self.args.reps)
            for op in ("fwd", "bwd")
        }
        if part == "peers":
            for peer in self.peers:
                for op in ("fwd", "bwd"):
                    self._row(peer, op, residual, shape, sets, copies[op], {"candidate": ""})
            return
        cake = FACTORIES["cake_cute"](torch, EPS)
        defaults = {}
        for op in ("fwd", "bwd"):
            defaults[op] = _functional(torch, op, sets[0])
            extra = {"candidate": "default", "overrides": ""} | checks(torch, op, sets[0], None)
            self._row(cake, op, residual, shape, sets, copies[op], extra)
        for cand in candidates(hidden, dtype, self.args.only):
            if self.sweep.fatal:
                return
            extra = {"candidate": cand.name, "overrides": cand.overrides}
            with ExitStack() as stack:
                try:
                    _overrides(stack, cand.overrides, dtype, hidden)
                    backward_config(ARCH, dtype, dtype, hidden, residual)
                    extra |= checks(torch, cand.op, sets[0], defaults[cand.op])
                except Exception as e:  # a choice this mode cannot take, or a compile failure
                    self.sweep.check_context(e, str(e))
                    reason = f"{type(e).__name__}: {str(e)[:200]}"
                    self.log(f"H={hidden} T={rows} res={int(residual)} {cand.name}: skipped ({reason})")
                    continue
                self._row(cake, cand.op, residual, shape, sets, copies[cand.op], extra)
        del sets
        torch.cuda.empty_cache()


def summary(rows: list[dict]) -> str:
    """One line per (H, T, residual, op): the default's fraction of the copy, the best candidate's,
    the peers', and whether every candidate passed its checks."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["H"], r["T"], r["residual"], r["op"]), []).append(r)
    head = (
        f"{'H':>4} {'T':>8} res op  {'default':>7} {'best candidate':<24} {'quack':>6} {'compile':>7} checks"
    )
    lines = [head, "-" * len(head)]
    for (h, t, res, op), group in groups.items():
        frac = {(r["impl"], r.get("candidate", "")): r.get("frac_copy") for r in group}
        default = frac.get(("cake_cute", "default"))
        cands = [r for r in group if r["impl"] == "cake_cute" and r.get("candidate") not in ("default", None)]
        best = max((r for r in cands if "frac_copy" in r), key=lambda r: r["frac_copy"], default=None)
        best_text = f"{best['candidate']} {best['frac_copy']:.3f}" if best else "-"
        ok = all(r.get("deterministic", True) and r.get("batch_invariant", True) for r in group)

        def fmt(v):
            return f"{v:.3f}" if isinstance(v, float) else "-"

        lines.append(
            f"{h:>4} {t:>8} {'on ' if res else 'off'} {op} {fmt(default):>7} {best_text:<24} "
            f"{fmt(frac.get(('quack', ''))):>6} {fmt(frac.get(('compile', ''))):>7} {'ok' if ok else 'FAIL'}"
        )
    return "\n".join(lines)


def _run_part(scan: Scan, todo: list, part: str, deadline: float, start: float, save) -> list:
    """Run ``part`` of each case of ``todo`` until ``deadline`` seconds after ``start``; the cases run."""
    done = []
    for k, (hidden, rows, residual) in enumerate(todo):
        if time.perf_counter() - start > deadline:
            scan.note(f"{part}: {deadline:.0f} s spent, {len(todo) - k} cases not run, from {todo[k]}")
            break
        if scan.sweep.fatal:
            break
        try:
            scan.case(hidden, rows, residual, part)
        except Exception as e:
            scan.note(f"{part} H={hidden} T={rows} residual={residual}: {type(e).__name__}: {str(e)[:300]}")
            scan.sweep.check_context(e, str(e))
        done.append((hidden, rows, residual))
        save()
    return done


def run(args: Namespace) -> int:
    """The scan: compiles (in parallel), cake_cute's rows of every case, then the peers' (imported only
    then: quack patches CuTe classes process-wide, and every override change reloads cake_cute's
    kernels), within ``--budget-s`` (cake_cute's rows get CAKE_SHARE of it)."""
    import torch

    from cake_cute.tools.bench.peers import versions
    from cake_cute.tools.bench.results import TIMING_METHOD, git_commit, write_json

    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    date = _dt.date.today().isoformat()
    folder = out_dir(args, props.name, date)
    folder.mkdir(parents=True, exist_ok=True)
    log = Log(folder / "headdim-scan.log")
    scan = Scan(args, torch, log)
    log(f"{props.name}, commit {git_commit()}\n{listing(args)}")
    problems = compile_all(args.hidden, args.dtype, args.only, max(1, min(16, (os.cpu_count() or 2) - 1)))
    for problem in problems:
        scan.note(f"compile: {problem}")
    log(f"cake_cute kernels compiled in {time.perf_counter() - start:.1f} s, loaded in {scan.precompile()} s")
    header = {
        "gpu": props.name,
        "commit": git_commit(),
        "date": date,
        "sm_count": props.multi_processor_count,
    }

    def save() -> None:
        doc = {
            **header,
            "grid": "headdim-scan",
            "versions": versions(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "notes": scan.sweep.notes,
            "method": TIMING_METHOD,
            "elapsed_s": round(time.perf_counter() - start, 1),
            "rows": scan.rows,
        }
        write_json(folder / "headdim-scan.json", doc)

    scan.sweep.timer.warm_clocks()
    done = _run_part(scan, cases(args.hidden, args.rows), "cake", CAKE_SHARE * args.budget_s, start, save)
    scan.import_peers()
    log(f"peers: {[p.name for p in scan.peers]}")
    if scan.peers:
        _run_part(scan, done, "peers", args.budget_s, start, save)
    log("\n" + summary(scan.rows))
    log(f"{len(scan.rows)} rows in {time.perf_counter() - start:.0f} s -> {folder}")
    return 1 if scan.sweep.fatal else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(listing(args))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/headdim_scan.py needs a CUDA GPU (--list works without one)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
