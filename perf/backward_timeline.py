"""Where the backward's time goes around its row kernel: the profiler's start and end of each kernel of
a call, next to the row kernel compiled without dW and a copy kernel of the same bytes.

    python perf/backward_timeline.py OUT.json [--reps 30]

Per (T, H), bf16, plain, inputs rotated so none is L2-resident (``cake_cute.tools.bench.timing``):

* ``row_us``, ``dw_us``: profiler durations of ``rmsnorm_bwd`` and ``dw_reduce`` (medians);
* ``dw_end_after_row_end``: how long the call runs on after its row kernel (dw_reduce is launched
  early with programmatic dependent launch and waits for the rows); ``dw_start_after_row_end`` is
  negative where it was already waiting. Calls follow each other without a spin, so at small T the host's
  launch gap can show here;
* ``row_start_to_dw_end``: the call's span on the device;
* ``rows_only_us``: the row kernel compiled without dW (no accumulator, no partial row), profiler;
* ``copy_kernel_us``: the profiler's duration of a device copy moving the backward's bytes (read +
  write = 3 T H 2 bytes), the ceiling the kernels compare to;
* ``events_backward_us``, ``copy_events_us``: the sweep's event timings of the same (they add the
  events' own overhead).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_doc import write_results  # noqa: E402
from sweep import _use_source_tree  # noqa: E402

SHAPES = [(T, H) for H in (4096, 2048) for T in (256, 2048, 4096, 8192, 16384)]


def _median_us(values) -> float:
    return round(statistics.median(values), 2)


def measure(timer, rows_kernel, tokens: int, hidden: int, reps: int) -> dict:
    from dw_columns_experiment import backward_inputs, rows_only_launcher
    from tune import _kernel_label, profiled_kernels

    from cake_cute import cake_rmsnorm_train_backward, launch_plan
    from cake_cute.device import device_facts
    from cake_cute.tools.bench.timing import Rotation, buffer_sets_for

    device = timer.device
    nbytes = 3 * 2 * tokens * hidden
    sets = buffer_sets_for(nbytes, timer.l2_bytes)
    w, inputs = backward_inputs(device, tokens, hidden, sets)
    rotation = Rotation(sets)

    def backward(index):
        g, x, rstd, _ = inputs[index]
        cake_rmsnorm_train_backward(g, x, w, rstd)

    events = profiled_kernels(lambda: backward(rotation.next()), reps)
    rows = [e.time_range for e in events if _kernel_label(e.name) == "rmsnorm_bwd"]
    dws = [e.time_range for e in events if _kernel_label(e.name) == "dw_reduce"]
    record = {
        "T": tokens,
        "H": hidden,
        "row_us": _median_us([r.elapsed_us() for r in rows]),
        "dw_us": _median_us([d.elapsed_us() for d in dws]),
        "dw_start_after_row_end": _median_us([d.start - r.end for r, d in zip(rows, dws)]),
        "dw_end_after_row_end": _median_us([d.end - r.end for r, d in zip(rows, dws)]),
        "row_start_to_dw_end": _median_us([d.end - r.start for r, d in zip(rows, dws)]),
    }
    programs = launch_plan.backward_launch(tokens, hidden, "bf16", "bf16", False, device_facts(device))[0]
    rows_only = rows_only_launcher(rows_kernel, w, inputs, hidden)(programs)
    rows_only_events = profiled_kernels(lambda: rows_only(rotation.next()), reps)
    record["rows_only_us"] = _median_us([e.time_range.elapsed_us() for e in rows_only_events])
    copy = timer.copy_ceiling(nbytes, reps, kernel_time=True)
    record["copy_kernel_us"] = round(copy["copy_kernel_us"], 2)
    record["events_backward_us"] = round(timer.device_us(backward, reps, rotation.next), 2)
    record["copy_events_us"] = copy["copy_gpu_us"]
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    _use_source_tree()
    from dw_columns_experiment import compile_rows_without_dw

    from cake_cute.device import device_arch
    from cake_cute.tools.bench.timing import DeviceTimer

    device = torch.device("cuda")
    timer = DeviceTimer(torch, device)
    records = []
    for hidden in sorted({h for _, h in SHAPES}, reverse=True):
        rows_kernel = compile_rows_without_dw(device_arch(device), hidden)
        for tokens in [t for t, h in SHAPES if h == hidden]:
            records.append(measure(timer, rows_kernel, tokens, hidden, args.reps))
            print(records[-1], flush=True)
    write_results(args.out, "perf/backward_timeline.py", torch.cuda.get_device_name(device), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
