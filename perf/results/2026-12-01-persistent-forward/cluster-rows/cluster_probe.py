"""Probe (with cluster-persistent.patch applied): the forward to MXFP8 for rows split over clusters, run
by persistent programs of 1-3 CTAs per SM against the shipped one-tile grid (0), every output compared
bitwise with the shipped one. Copy to perf/ and run on a GPU: python3 perf/cluster_probe.py OUT.json"""

import json
import sys

import torch

sys.path.insert(0, "perf")
from fp8_bench import fused_bytes  # noqa: E402

import cake_cute  # noqa: E402
from cake_cute import dispatch  # noqa: E402
from cake_cute.kernels import config  # noqa: E402
from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for  # noqa: E402

SHAPES = [(1024, 32768), (4096, 32768), (512, 65536), (2048, 65536), (256, 131072), (1024, 131072)]
RULE, HINT = config.persistent_programs_per_sm, config.persistent_register_hint


def use(per_sm: int) -> None:
    """Cluster rows run by ``per_sm`` persistent CTAs per SM at any T (0: the shipped one-tile grid),
    held resident by a register hint."""

    def rule(tiling, act_dtype):
        return per_sm if tiling.cluster_n > 1 else RULE(tiling, act_dtype)

    def hint(tiling, programs):
        return programs if tiling.cluster_n > 1 else HINT(tiling, programs)

    config.persistent_programs_per_sm = dispatch.persistent_programs_per_sm = rule
    config.persistent_register_hint = hint
    config.quant_forward_config.cache_clear()
    dispatch.fp8_persistent_programs.cache_clear()
    dispatch.PERSISTENT_FP8_MAX_ELEMENTS = (1 << 40) if per_sm else 0


def measure(timer, tokens: int, hidden: int, recipe: str) -> dict:
    nbytes = fused_bytes(tokens, hidden, 2, recipe, False)
    sets = buffer_sets_for(nbytes, timer.l2_bytes)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]

    def forward(index):
        return cake_cute.cake_rmsnorm_fp8(xs[index], w, 1e-6, recipe=recipe)

    def output_bytes():
        out = forward(0)
        return [t.contiguous().view(-1).view(torch.uint8) for t in (out.data, out.scales, out.rstd)]

    row = {"T": tokens, "H": hidden, "recipe": recipe}
    use(0)
    shipped = output_bytes()
    for per_sm in (0, 1, 2, 3):
        use(per_sm)
        row[f"bitwise_{per_sm}"] = all(torch.equal(a, b) for a, b in zip(shipped, output_bytes()))
        row[f"p{per_sm}_us"] = round(timer.device_us(forward, 20, Rotation(sets).next), 2)
    row["copy_us"] = timer.copy_ceiling(nbytes, 20)["copy_gpu_us"]
    print(row, flush=True)
    return row


if __name__ == "__main__":
    timer = DeviceTimer(torch, torch.device("cuda"))
    rows = [measure(timer, t, h, "mxfp8") for t, h in SHAPES]
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
