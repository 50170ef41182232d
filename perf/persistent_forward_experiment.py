"""Experiment (issues #15 and #13): a persistent forward that stages its next row tile while it normalizes
the current one, against the shipped one-tile-per-CTA forward, for the plain bf16 forward and the
forward to block-scaled FP8.

    python perf/persistent_forward_experiment.py OUT.json [--reps 30] [--per-sm 2,4,8]

Why: at T·H = 2^22-2^25 the forward to FP8 is 0.83-0.89 of a device copy of its bytes, and takes
about the plain forward's time although it moves 22% fewer bytes. Nsight Compute at 2048 x 4096
(perf/results/2026-12-01-h200-backward-timeline/) has a quarter of the elapsed cycles with SMs idle --
the ramp of a grid of one-tile CTAs (each waits out its tile's load before it computes) and its
partial last wave -- and more resident CTAs did not help (perf/results/2026-12-01-h200-fp8-tilings/).

The variant (``persistent``, a subclass of the shipped kernel class; plain mode, rows a CTA covers
alone): ``min(tiles, per_sm * SMs)`` programs; program p normalizes row tiles p, p +
programs, ... Two shared-memory slots of x: before tile i's row sum, tile i + 1's cp.async is issued
into the other slot, so its load is in flight while tile i is reduced, normalized, quantized and
stored; a CTA barrier closes each tile, so no lane stages into a slot another lane still reads.
``row_sum`` alternates its reduction slots with the tiles. The arithmetic per row is the shipped
kernel's (``RMSNormForward.row_rstd``, the same epilogue), so every output is compared bitwise.

Rows (per T, H and op: ``fwd`` (bf16 y), ``mxfp8``, ``1x128``): ``shipped_us`` (the public op),
``persistent_<per_sm>_us`` per program count, ``copy_us`` (a device copy of the op's minimal bytes, the same
rotation), ``bitwise`` (every output of every program count equal to the shipped op's), all by the
sweep's timer (``cake_cute.tools.bench.timing``: events behind a spin, inputs rotated past the L2).
Ship it (the program count per (H, T) in ``kernels/config.py``, the launch in ``ops`` and the
native path) only where ``persistent_us`` beats ``shipped_us`` at the training shapes without losing
at T·H = 2^27.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402

SHAPES = [(T, H) for H in (2048, 4096, 8192) for T in (2048, 4096, 8192)] + [(32768, 4096)]
OPS = ("fwd", "mxfp8", "1x128")


def persistent(base, programs: int):
    """``base`` (``RMSNormForward`` or ``RMSNormForwardQuant``) as a persistent kernel of ``programs``
    programs at most, staging tile i + 1 while it normalizes tile i."""
    import cutlass
    import cutlass.cute as cute
    from cake_cute.kernels.common import allocate_reduction_buffers, allocate_tile, copy_atom, staging_atom
    from cake_cute.kernels.rmsnorm_fwd import NormalizedTile
    from cutlass import Int32

    class Persistent(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            t = self.tiling
            if t.cluster_n > 1 or self.residual:
                raise ValueError("the persistent forward covers plain rows one CTA holds")
            self.programs = programs

        @cute.jit
        def launch(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps, stream):
            tiles = cute.ceil_div(mX.shape[0], self.tiling.rows_per_cta)
            self.kernel(mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps).launch(
                **self.launch_shape(cutlass.min(tiles, Int32(self.programs))), stream=stream
            )

        @cute.jit
        def stage(self, mX, sX, thr, tiler, async_copy, tile, slot, row_in_cta):
            """Issue the cp.async of row tile ``tile`` into ``slot`` (nothing past the last row)."""
            if tile * self.tiling.rows_per_cta + row_in_cta < mX.shape[0]:
                tXgX = thr.partition_S(cute.local_tile(mX, tiler, (tile, 0)))
                async_copy(tXgX, thr.partition_D(sX[None, None, slot]))

        @cute.kernel
        def kernel(self, mX, mRes, mW, mY, mHOut, mRstd, mQ, mScale, eps):
            t = self.tiling
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            programs, _, _ = cute.arch.grid_dim()
            rows = mX.shape[0]
            tiles = cute.ceil_div(rows, t.rows_per_cta)
            smem = cutlass.memory.SmemAllocator()
            buffers = allocate_reduction_buffers(smem, t)
            sX = allocate_tile(smem, self.act_dtype, t, slots=2)
            tiler, thr, _, pred = self.row_tile(mX, tidx, bidx, 0)
            row_in_cta = tidx // t.threads_per_row
            lane_in_row = tidx % t.threads_per_row
            copy_act = partial(cute.copy, copy_atom(self.act_dtype, t.vec), pred=pred)
            async_copy = partial(cute.copy, staging_atom(self.act_dtype, t.vec), pred=pred)

            self.stage(mX, sX, thr, tiler, async_copy, bidx, 0, row_in_cta)
            cute.arch.cp_async_commit_group()
            tXrW = self.load_weight(mW, thr, tiler, 0, pred)

            for i in cutlass.range((tiles - bidx + programs - 1) // programs, unroll=1):
                b = bidx + i * programs
                slot = i % 2
                following = b + programs
                self.stage(mX, sX, thr, tiler, async_copy, following, 1 - slot, row_in_cta)
                cute.arch.cp_async_commit_group()  # an empty group at the end keeps the count uniform
                cute.arch.cp_async_wait_group(1)
                row = b * t.rows_per_cta + row_in_cta
                tXgX = thr.partition_S(cute.local_tile(mX, tiler, (b, 0)))
                tXsX = thr.partition_D(sX[None, None, slot])
                tXrX = cute.make_rmem_tensor_like(tXgX)
                tXrX.fill(0)
                copy_act(tXsX, tXrX)
                rstd = self.row_rstd(self.widen(tXrX), buffers, row_in_cta, lane_in_row, slot, eps)
                if row < rows and lane_in_row == 0:
                    mRstd[row] = rstd
                tXrX.fill(0)
                copy_act(tXsX, tXrX)
                w = self.widen_weight(self.widen(tXrW))
                y = self.widen(tXrX) * rstd * w
                tile = NormalizedTile(
                    y, tXgX, thr, tiler, b, Int32(0), row, rows, pred, row_in_cta, lane_in_row
                )
                self.epilogue(smem, tile, mY, mQ, mScale)
                cute.arch.barrier()

    return Persistent


def compile_persistent(arch: str, op: str, hidden: int, programs: int):
    """The persistent variant of the shipped bf16 plain kernel of ``op`` (``fwd``, ``mxfp8``, ``1x128``;
    its config and arguments), compiled for ``arch`` against the package's fake tensors; runs without
    a GPU."""
    import cutlass
    import cutlass.cute as cute
    from cake_cute.kernels.rmsnorm_fwd import RMSNormForward
    from cake_cute.kernels.rmsnorm_fwd_quant import RMSNormForwardQuant

    from cake_cute.build import _forward_arguments, _quant_arguments, config_for, make_spec, quant_kind

    kind = "fwd" if op == "fwd" else quant_kind(op, False)
    spec = make_spec(kind, arch, "bf16", "bf16", hidden, False, 0.0)
    config = config_for(spec)
    dtypes = (cutlass.BFloat16, cutlass.BFloat16)
    if op == "fwd":
        kernel = persistent(RMSNormForward, programs)(config, *dtypes, False, 0.0)
        arguments = _forward_arguments(spec, config)
    else:
        kernel = persistent(RMSNormForwardQuant, programs)(config, *dtypes, False, 0.0, False)
        arguments = _quant_arguments(spec, config, False)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *arguments, stream, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def op_bytes(op: str, tokens: int, hidden: int) -> int:
    """The op's minimal traffic: x read, its output (bf16 y, or e4m3 + scales) and rstd written, w read."""
    if op == "fwd":
        return 2 * tokens * hidden * 2 + 4 * tokens + 2 * hidden
    from fp8_bench import fused_bytes

    return fused_bytes(tokens, hidden, 2, op, False)


def measure(timer, tokens: int, hidden: int, op: str, compiled: dict, reps: int) -> dict:
    import cake_cute
    from cake_cute.fp8_numerics import scale_blocks
    from cake_cute.tools.bench.timing import Rotation, buffer_sets_for

    device = timer.device
    nbytes = op_bytes(op, tokens, hidden)
    sets = buffer_sets_for(nbytes, timer.l2_bytes)
    w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(sets)]

    def shipped(index):
        if op == "fwd":
            return cake_cute.cake_rmsnorm_train_forward(xs[index], w, 1e-6)
        out = cake_cute.cake_rmsnorm_fp8(xs[index], w, 1e-6, recipe=op)
        return out.data, out.scales, out.rstd

    def outputs():
        """Fresh outputs, poisoned (NaN, 0xFF bytes)."""
        rstd = torch.full((tokens,), float("nan"), device=device)
        if op == "fwd":
            return torch.full_like(xs[0], float("nan")), rstd
        data = torch.full((tokens, hidden), 0xFF, dtype=torch.uint8, device=device)
        blocks = scale_blocks(hidden, op)
        if op == "1x128":
            scales = torch.full((tokens, blocks), float("nan"), device=device)
        else:
            scales = torch.full((tokens, blocks), 0xFF, dtype=torch.uint8, device=device)
        return data, scales, rstd

    def run(fn, index, out):
        if op == "fwd":
            fn(xs[index], None, w, out[0], None, out[1], 1e-6)
        else:
            fn(xs[index], None, w, None, None, out[2], out[0], out[1], 1e-6)
        return out

    def as_bytes(t):
        return t.contiguous().view(-1).view(torch.uint8)

    # Outside the timer (a first call may compile the shipped variant): what every variant must match.
    reference = [as_bytes(t) for t in shipped(0)]
    rotation = Rotation(sets)
    row = {"T": tokens, "H": hidden, "op": op, "bytes": nbytes}
    row["shipped_us"] = round(timer.device_us(shipped, reps, rotation.next), 2)
    bitwise = True
    for per_sm, fn in compiled.items():
        outs = [outputs() for _ in range(sets)]
        bitwise &= all(torch.equal(r, as_bytes(o)) for r, o in zip(reference, run(fn, 0, outs[0])))
        row[f"persistent_{per_sm}_us"] = round(
            timer.device_us(lambda index, fn=fn, outs=outs: run(fn, index, outs[index]), reps, rotation.next),
            2,
        )
    row["bitwise"] = bitwise
    row["copy_us"] = timer.copy_ceiling(nbytes, reps)["copy_gpu_us"]
    print(row, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--per-sm", default="2,4,8", help="program counts to time, per SM")
    args = p.parse_args(argv)
    _use_source_tree()
    from cake_cute.device import device_arch
    from cake_cute.tools.bench.timing import DeviceTimer

    device = torch.device("cuda")
    timer = DeviceTimer(torch, device)
    arch, sms = device_arch(device), torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = [int(k) for k in args.per_sm.split(",")]
    rows = []
    for hidden in sorted({h for _, h in SHAPES}):
        for op in OPS:
            compiled = {k: compile_persistent(arch, op, hidden, k * sms) for k in per_sm}
            rows += [measure(timer, t, hidden, op, compiled, args.reps) for t, h in SHAPES if h == hidden]
    write_results(args.out, "perf/persistent_forward_experiment.py", torch.cuda.get_device_name(device), rows)
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
