#!/usr/bin/env python
"""``python perf/dw_columns_experiment.py OUT.json``: would a weight gradient summed by columns, on SMs
of its own, concurrently with the row kernel, remove the backward's fixed dW cost? (Issue #13.)

Today the backward writes FP32 partial rows of dW (one per program) and a second kernel,
``dw_reduce``, sums them once the row kernel's grid has finished: 2-3 us of device time and a launch
that the copy of the same bytes does not pay, which keeps T·H = 2^22-2^23 at 0.64-0.8 of the copy. The
alternative measured here needs no partial rows and no dependency on the row kernel: ``ColumnDW``
computes ``dw[j] = sum_t g[t, j] * (h[t, j] * rstd[t])`` from g, h and rstd directly (all known before
the backward starts), each CTA owning ``col_lanes * vec`` columns for every row (row lane l adds rows
l, l + row_lanes, ... in order, then a fixed binary tree over the row lanes: deterministic, whatever
the row kernel's program count). Run concurrently with the row kernel on a second stream, it reads g
and h while the row kernel reads them too, so one of the two reads is an L2 hit if they keep pace.

Per (T, H), bf16, plain mode, inputs rotated past the L2, device time as the sweep measures it
(``DeviceTimer.device_us``), one row with:

* ``backward_us``: today's call (row kernel + dw_reduce); ``row_kernel_us``, ``dw_reduce_us``: the
  profiler's median durations of those two kernels in it (``tune.kernel_us``); ``copy_us``: a device
  copy of the backward's bytes;
* ``columns_us``: ColumnDW alone; ``columns_rel_err``: its dw against an FP64 reference (relative norm);
* ``concurrent_us``: today's call with ColumnDW beside it on a second stream;
* ``rows_only_us``: the row kernel compiled without dW (``RMSNormBackward(with_dw=False)``: no
  accumulator, no partial row), alone, with today's program count; ``rows_only_dx_bitwise``: its dx
  against today's;
* ``target_us``: that row kernel with ColumnDW beside it on a second stream -- the design's time;
  ``target_pdl_us``: the same pair on one stream, ColumnDW first (it allows the dependent launch at its
  start) and the row kernel behind it with programmatic dependent launch (it waits for ColumnDW only at
  its end) -- the launch a shipped design would use (no second stream, CUDA-graph capturable);
* where the backward's rule puts two or more CTAs on an SM, ``concurrent_fewer_us`` and
  ``target_fewer_us``: the same with the row programs of one CTA per SM fewer (``fewer_programs``),
  leaving ColumnDW's CTAs room.

Build the design (the variant, the split of SMs per (H, T) in ``kernels/config.py``, one launch
sequence in ``ops`` and the native path) if ``target_us`` (or ``target_fewer_us``) is close to
``rows_only_us`` and well below ``backward_us``.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402

SHAPES = [(256, 4096), (2048, 2048), (2048, 4096), (4096, 4096), (8192, 4096), (16384, 4096), (2048, 8192)]


def column_dw_kernel(act_dtype, hidden: int, col_lanes: int, threads: int = 256):
    """The ColumnDW kernel object for (act dtype, H); ``col_lanes`` vectors of 16 bytes per row side by
    side (8: one 128-byte line per row and tensor), ``threads // col_lanes`` row lanes."""
    import cutlass
    import cutlass.cute as cute
    from cake_cute.kernels.common import global_vector, sum_over_row_lanes
    from cutlass import Float32

    vec = 128 // act_dtype.width
    row_lanes = threads // col_lanes
    cols_per_cta = col_lanes * vec

    class ColumnDW:
        @cute.jit
        def __call__(self, mG: cute.Tensor, mH: cute.Tensor, mRstd: cute.Tensor, mDW: cute.Tensor, stream):
            self.kernel(mG, mH, mRstd, mDW).launch(
                grid=[cute.ceil_div(hidden, cols_per_cta), 1, 1], block=[threads, 1, 1], stream=stream
            )

        @cute.kernel
        def kernel(self, mG: cute.Tensor, mH: cute.Tensor, mRstd: cute.Tensor, mDW: cute.Tensor):
            # A row kernel launched behind this one with programmatic dependent launch may start now.
            cute.arch.griddepcontrol_launch_dependents()
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            col_lane = tidx % col_lanes
            row_lane = tidx // col_lanes
            col0 = (bidx * col_lanes + col_lane) * vec
            rows = mG.shape[0]
            smem = cutlass.memory.SmemAllocator()
            sums = smem.allocate_tensor(
                Float32, cute.make_ordered_layout((row_lanes, cols_per_cta), order=(1, 0)), byte_alignment=16
            )
            acc = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
            acc.fill(0.0)
            g = cute.make_rmem_tensor(cute.make_layout(vec), act_dtype)
            h = cute.make_rmem_tensor(cute.make_layout(vec), act_dtype)
            if col0 < hidden:
                for t in cutlass.range(row_lane, rows, row_lanes, unroll=4):
                    cute.autovec_copy(global_vector(mG, t, col0, vec), g)
                    cute.autovec_copy(global_vector(mH, t, col0, vec), h)
                    xhat = h.load().to(Float32) * mRstd[t]
                    acc.store(acc.load() + g.load().to(Float32) * xhat)
            sum_over_row_lanes(sums, acc, row_lane, col_lane, vec, row_lanes)
            if row_lane == 0 and col0 < hidden:
                for v in cutlass.range_constexpr(vec):
                    mDW[col0 + v] = sums[0, col_lane * vec + v]

    return ColumnDW(), vec


def compile_column_dw(arch: str, act_dtype, hidden: int, col_lanes: int = 8):
    """ColumnDW compiled for ``arch`` against the package's fake tensors (a symbolic T, the backward's
    row strides and alignment); runs without a GPU."""
    import cutlass
    import cutlass.cute as cute

    from cake_cute.build import _rows_tensor, _vector

    kernel, vec = column_dw_kernel(act_dtype, hidden, col_lanes)
    rows = cute.sym_int()
    g, h = (_rows_tensor(act_dtype, rows, hidden, vec) for _ in range(2))
    rstd, dw = _vector(cutlass.Float32, rows, 1), _vector(cutlass.Float32, hidden, 1)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, g, h, rstd, dw, stream, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compile_rows_without_dw(arch: str, hidden: int):
    """The shipped bf16 plain backward of H (its config and arguments) compiled with ``with_dw=False``:
    dx only, no dW accumulator, no partial row. Runs without a GPU."""
    import cutlass
    import cutlass.cute as cute
    from cake_cute.kernels.rmsnorm_bwd import RMSNormBackward

    from cake_cute.build import _backward_arguments, config_for, make_spec

    spec = make_spec("bwd", arch, "bf16", "bf16", hidden, False, 0.0)
    config = config_for(spec)
    kernel = RMSNormBackward(config, cutlass.BFloat16, cutlass.BFloat16, False, 0.0, with_dw=False)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kernel, *_backward_arguments(spec, config), stream, options=f"--enable-tvm-ffi --gpu-arch {arch}"
    )


def beside(side_stream, main_call, side_call):
    """A call that runs ``side_call`` on ``side_stream`` and ``main_call`` on the current stream, both
    after what the current stream has queued, and joins them."""

    def call(index):
        main = torch.cuda.current_stream()
        side_stream.wait_stream(main)
        with torch.cuda.stream(side_stream):
            side_call(index)
        main_call(index)
        main.wait_stream(side_stream)

    return call


def backward_inputs(device, tokens: int, hidden: int, sets: int):
    """w and ``sets`` input sets (g, x, rstd, dx) of a bf16 plain backward, rstd from the forward."""
    from cake_cute import cake_rmsnorm_train_forward

    w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    inputs = []
    for _ in range(sets):
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        _, rstd = cake_rmsnorm_train_forward(x, w, 1e-6)
        inputs.append((torch.randn_like(x), x, rstd, torch.empty_like(x)))
    return w, inputs


def rows_only_launcher(rows_without_dw, w, inputs: list, hidden: int):
    """``launch(count)``: a call of set ``index`` through the row kernel without dW (``count`` programs),
    writing dx into the set's dx."""
    from cake_cute import launch_plan

    unused_partials = torch.empty(1, launch_plan.partial_row_stride(hidden), device=w.device)[:, :hidden]

    def launch(count):
        def call(index):
            g, x, rstd, dx = inputs[index]
            rows_without_dw(g, x, w, rstd, None, dx, unused_partials, count)

        return call

    return launch


def measure(tokens: int, hidden: int, columns, rows_without_dw, reps: int) -> dict:
    from cake_cute.kernels.config import backward_config, overridden
    from tune import kernel_us

    from cake_cute import cake_rmsnorm_train_backward, launch_plan
    from cake_cute.device import device_arch, device_facts
    from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for

    device = torch.device("cuda")
    timer = DeviceTimer(torch, device)
    element = 2 * tokens * hidden
    sets = buffer_sets_for(3 * element, timer.l2_bytes)
    w, inputs = backward_inputs(device, tokens, hidden, sets)
    dw_columns = torch.empty(hidden, device=device, dtype=torch.float32)
    rows_only = rows_only_launcher(rows_without_dw, w, inputs, hidden)
    arch, facts = device_arch(device), device_facts(device)

    def programs() -> int:
        return launch_plan.backward_launch(tokens, hidden, "bf16", "bf16", False, facts)[0]

    def backward(index):
        g, x, rstd, _ = inputs[index]
        cake_rmsnorm_train_backward(g, x, w, rstd)

    def column_dw(index):
        g, x, rstd, _ = inputs[index]
        columns(g, x, rstd, dw_columns)

    g, x, rstd, dx = inputs[0]
    column_dw(0)
    expected = (g.double() * (x.double() * rstd.double()[:, None])).sum(0)
    rel_err = float((dw_columns.double() - expected).norm() / expected.norm())
    reference_dx = cake_rmsnorm_train_backward(g, x, w, rstd)[0]
    rows_only(programs())(0)
    row = {
        "T": tokens,
        "H": hidden,
        "columns_rel_err": rel_err,
        "rows_only_dx_bitwise": torch.equal(dx, reference_dx),
    }

    def time(call) -> float:
        call(0)  # outside the timer: a first call may compile a variant
        torch.cuda.synchronize()
        rotation = Rotation(sets)
        timer.device_us(call, 3, rotation.next)
        return round(timer.device_us(call, reps, rotation.next), 2)

    side = torch.cuda.Stream()
    default_programs = programs()
    row["programs"] = default_programs
    row["backward_us"] = time(backward)
    row["columns_us"] = time(column_dw)
    row["concurrent_us"] = time(beside(side, backward, column_dw))
    row["rows_only_us"] = time(rows_only(default_programs))
    row["target_us"] = time(beside(side, rows_only(default_programs), column_dw))

    def in_sequence(index):  # one stream: ColumnDW, then the row kernel with programmatic launch
        column_dw(index)
        rows_only(default_programs)(index)

    row["target_pdl_us"] = time(in_sequence)
    # Fewer row programs (one CTA per SM below the rule), leaving ColumnDW's CTAs room beside them.
    ctas = backward_config(arch, "bf16", "bf16", hidden, False).ctas_per_sm
    if ctas >= 2:
        with overridden("bwd", arch, "bf16", hidden, ctas_per_sm=ctas - 1):
            fewer = programs()
            row["fewer_programs"] = fewer
            row["concurrent_fewer_us"] = time(beside(side, backward, column_dw))
        row["target_fewer_us"] = time(beside(side, rows_only(fewer), column_dw))
    rotation = Rotation(sets)
    kernels = kernel_us(lambda: backward(rotation.next()), reps)
    row["row_kernel_us"] = round(kernels["rmsnorm_bwd"], 2)
    row["dw_reduce_us"] = round(kernels["dw_reduce"], 2)
    row["copy_us"] = timer.copy_ceiling(3 * element, reps)["copy_gpu_us"]
    print(row, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--col-lanes",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[4, 8],
        help="ColumnDW's 16-byte vectors side by side per row, one row of results each (default 4,8)",
    )
    args = p.parse_args(argv)
    _use_source_tree()
    import cutlass

    from cake_cute.device import device_arch

    arch = device_arch(torch.device("cuda"))
    rows = []
    for hidden in sorted({h for _, h in SHAPES}):
        rows_without_dw = compile_rows_without_dw(arch, hidden)
        for col_lanes in args.col_lanes:
            columns = compile_column_dw(arch, cutlass.BFloat16, hidden, col_lanes)
            for tokens in (t for t, h in SHAPES if h == hidden):
                rows.append(
                    {"col_lanes": col_lanes, **measure(tokens, hidden, columns, rows_without_dw, args.reps)}
                )
    write_results(args.out, "perf/dw_columns_experiment.py", torch.cuda.get_device_name(), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
