"""The gated backward of wide segments (groups of 6144 and 8192 columns) over clusters of CTAs of 128,
256 and 512 threads (``gated_config.CLUSTER_CTA_THREADS``), switched in one process and interleaved;
device time as a fraction of a copy (``benchmarks/gated_bench.py``'s method). Writes
``$OUT/cluster_ab.json``. It ran on the tree just before 08bcd54, where
``gated_config.WIDE_SEGMENTS_IN_CLUSTERS = False`` (``threads == 0`` here) still selected the single
CTA of 512 lanes that read g, x and z twice; ``cluster_ab_reread.json`` is the earlier run of this
script comparing that CTA with clusters of 256-thread CTAs, in bf16 and fp32."""

import json
import os
import sys

import torch

from cake_cute import compile_cache
from cake_cute.kernels import gated_config
from cake_cute.tools.bench.timing import DeviceTimer, buffer_sets_for
from cake_cute.vocab import dtype_name

sys.path.insert(0, "benchmarks")
import gated_bench  # noqa: E402

# (T, H, group, norm_before_gate)
TIMED = (
    (8192, 8192, 8192, False),
    (16384, 8192, 8192, False),
    (4096, 65536, 8192, False),
    (8192, 16384, 8192, False),
    (8192, 12288, 6144, False),
    (16384, 8192, 8192, True),
)


def use_clusters(threads: int) -> None:
    gated_config.WIDE_SEGMENTS_IN_CLUSTERS = threads > 0
    gated_config.CLUSTER_CTA_THREADS = threads
    gated_config.gated_backward_config.cache_clear()
    compile_cache.clear_memory()


def timings(dtype, shapes) -> list[dict]:
    timer = DeviceTimer(torch, torch.device("cuda"))
    out = []
    for rows, hidden, group, nbg in shapes:
        inputs = gated_bench._sets(rows, hidden, dtype, buffer_sets_for(6 * rows * hidden, timer.l2_bytes))
        size = torch.tensor([], dtype=dtype).element_size()
        moved = gated_bench.nbytes("backward", rows, hidden, group, size)
        copy = timer.copy_ceiling(moved, 20)["copy_gpu_us"]
        for clusters in (256, 128, 512, 256, 128, 512):
            use_clusters(clusters)
            cake = gated_bench.Cake(hidden, group, nbg, dtype)
            us = gated_bench.time_impl(timer, cake, inputs, 20)["backward"]
            config = gated_config.gated_backward_config(dtype_name(dtype), hidden, group)
            out.append(dict(dtype=str(dtype), rows=rows, hidden=hidden, group=group, nbg=nbg,
                            clusters=clusters, config=config.describe(), bwd_us=round(us, 2),
                            copy_us=round(copy, 2), fraction=round(copy / us, 3)))  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    results = timings(torch.bfloat16, TIMED)
    with open(os.path.join(os.environ["OUT"], "cluster_ab.json"), "w") as f:
        f.write(json.dumps(results, indent=1))
