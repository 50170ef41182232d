"""Probe (session 17): the persistent forward to FP8 where its rule does not run it -- 4-byte rows, more
than four programs per SM at H = 2048, and (with cluster-persistent.patch applied) rows split over a
cluster -- against the one-tile grid (0), every output compared bitwise with the one-tile kernel's.
Runs the Python host path (the C++ op kernels fix a signature's launch rule when it registers).
python3 perf/persistent_probe.py OUT.json [family ...]   (families: fp32 narrow cluster)
python3 perf/persistent_probe.py --compile [family ...]   (no GPU: fill the cache for CUTE_DSL_ARCH)"""

import json
import os
import sys

os.environ["CAKE_CUTE_PYTHON_PATH"] = "1"
import torch  # noqa: E402

sys.path.insert(0, "perf")
from cake_cute.kernels import config  # noqa: E402
from fp8_bench import fused_bytes  # noqa: E402

import cake_cute  # noqa: E402
from cake_cute import dispatch  # noqa: E402
from cake_cute.fp8 import quant_kind  # noqa: E402
from cake_cute.specs import KernelSpec  # noqa: E402
from cake_cute.tools import warmup  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAMILIES = {
    "fp32": [
        ("fp32", t, h, "mxfp8", (0, 2, 4))
        for t, h in ((2048, 2048), (4096, 2048), (2048, 4096), (4096, 4096), (2048, 8192), (16384, 4096))
    ]
    + [("fp32", 2048, h, "1x128", (0, 2, 4)) for h in (2048, 4096, 8192)],
    "narrow": [("bf16", t, 2048, r, (0, 4, 6, 8)) for t in (2048, 8192) for r in ("mxfp8", "1x128")]
    + [("fp16", 2048, 2048, "1x128", (0, 4, 6, 8))],
    "cluster": [
        ("bf16", t, h, "mxfp8", (0, 1, 2)) for t, h in ((4096, 32768), (2048, 65536), (1024, 131072))
    ],
}
RULE, HINT = config.persistent_programs_per_sm, config.persistent_register_hint


def use(per_sm: int) -> None:
    """Every forward to FP8 runs ``per_sm`` persistent programs per SM at any T (0: the one-tile grid)."""
    config.persistent_programs_per_sm = dispatch.persistent_programs_per_sm = lambda tiling, act: per_sm
    config.persistent_register_hint = HINT
    config._overrides_changed()  # what an override change clears: configs, launch plans, loaded kernels
    dispatch.PERSISTENT_FP8_MAX_BYTES = (1 << 40) if per_sm else 0


def compile_case(dtype: str, tokens: int, hidden: int, recipe: str, choices) -> None:
    """Bring every kernel ``measure`` launches for this case into the cache, without a GPU."""
    arch = os.environ["CUTE_DSL_ARCH"]
    for per_sm in choices:
        use(per_sm)
        spec = KernelSpec(quant_kind(recipe, False, per_sm > 0), arch, dtype, dtype, hidden, False, 0.0)
        result = warmup.warm([spec], jobs=1)
        print(spec.name(), per_sm, [o.error for o in result.failed] or "ok", flush=True)


def measure(timer, dtype: str, tokens: int, hidden: int, recipe: str, choices) -> dict:
    act = DTYPES[dtype]
    nbytes = fused_bytes(tokens, hidden, act.itemsize, recipe, False)
    sets = buffer_sets_for(nbytes, timer.l2_bytes)
    w = torch.randn(hidden, device="cuda", dtype=act)
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=act) for _ in range(sets)]

    def forward(index):
        return cake_cute.cake_rmsnorm_fp8(xs[index], w, 1e-6, recipe=recipe)

    def output_bytes():
        out = forward(0)
        return [t.contiguous().view(-1).view(torch.uint8) for t in (out.data, out.scales, out.rstd)]

    row = {"dtype": dtype, "T": tokens, "H": hidden, "recipe": recipe}
    use(0)
    shipped = output_bytes()
    for per_sm in choices:
        try:
            use(per_sm)
            row[f"bitwise_{per_sm}"] = all(torch.equal(a, b) for a, b in zip(shipped, output_bytes()))
            row[f"p{per_sm}_us"] = round(timer.device_us(forward, 20, Rotation(sets).next), 2)
        except Exception as error:  # a choice that does not compile or launch is reported, not fatal
            row[f"p{per_sm}_error"] = f"{type(error).__name__}: {error}"[:200]
    row["copy_us"] = timer.copy_ceiling(nbytes, 20)["copy_gpu_us"]
    row["shipped_rule"] = RULE(config.forward_tiling(hidden, dtype), dtype)
    print(row, flush=True)
    return row


if __name__ == "__main__":
    families = sys.argv[2:] or list(FAMILIES)
    if sys.argv[1] == "--compile":
        for family in families:
            for case in FAMILIES[family]:
                compile_case(*case)
        sys.exit(0)
    from cake_cute.tools.bench.timing import DeviceTimer, Rotation, buffer_sets_for

    timer = DeviceTimer(torch, torch.device("cuda"))
    rows = [measure(timer, *case) for family in families for case in FAMILIES[family]]
    json.dump({"commit": os.environ.get("CAKE_CUTE_COMMIT"), "rows": rows}, open(sys.argv[1], "w"), indent=1)
