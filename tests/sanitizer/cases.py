"""The workload compute-sanitizer runs: forward and backward over the dtypes x H in {7, 1024, 4096, 4097,
7168, 16384, 32768, 65536} x residual off/on at T = 3 (FP32 H = 16384 and 32768, rows split over clusters
of 4 and 8 CTAs with lanes of 8 vectors, also at T = 300), T = 100 at H = 4096 (persistent programs with
two row tiles each), and plain rows with a 4-stage ring that wraps around several times (bf16 H = 8192 and
fp32 H = 4096 at T = 700, bf16 H = 1024 at T = 4000), each output checked against the FP64 reference so a
silent corruption would also show; and the quantizing forward (both FP8 recipes, bf16, H in {33, 4096,
4097, 65536}, residual off/on, y emitted) at T = 3 and T = 100, and in plain mode at T where its
persistent programs each quantize several row tiles (bf16 H in {33, 4096, 4097, 7168}, fp32 H in {2048,
8192}), its e4m3 bytes and scales compared bitwise with the torch reference of ``cake_cute.fp8_numerics``;
and rows of fewer than 128 vectors (bf16 and fp32, H in {7, 32, 64, 80, 128, 192, 256, 500}, residual
off/on, T = 3 and 5000), whose CTAs hold several row groups that fold their dW in shared memory; and the
backwards that sum dW in their own launch (``kernels.dw_finish``, the config override
``dw_in_launch``: plain bf16 / fp32 rows of H in {7, 64, 4096, 4097, 65536} and the gated form at H =
128, T = 3 and 300), compared bitwise with the two-launch backward's dx and dw. Run by
``tests/sanitizer/run.sh`` under memcheck, racecheck and synccheck (a GPU is needed); it prints one line
per case and exits non-zero on any mismatch. ``python3 cases.py PREFIX`` runs only the cases whose label
(``float32 H=16384``, ``fp8 persistent H=4096``) starts with PREFIX (``short`` for the rows of fewer than
128 vectors)."""

import sys
from functools import partial

import torch

import cake_cute
from cake_cute import fp8_numerics
from cake_cute.reference import backward_reference, forward_reference, rel_error, tolerance


def run_case(dtype, hidden, residual, rows=3):
    torch.manual_seed(hidden + rows)
    dev = torch.device("cuda")
    x = torch.randn(rows, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    res = torch.randn_like(x) if residual else None
    outs = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6, residual=res)
    h = outs[2] if residual else x
    g = torch.randn_like(x)
    gr = torch.randn_like(x) if residual else None
    dx, dw = cake_cute.cake_rmsnorm_train_backward(g, h, w, outs[1], g_residual=gr)
    torch.cuda.synchronize()
    y_ref, _, _ = forward_reference(x, w, 1e-6, residual=res)
    dx_ref, dw_ref = backward_reference(g, h, w, outs[1], g_residual=gr)
    errors = (rel_error(outs[0], y_ref), rel_error(dx, dx_ref), rel_error(dw, dw_ref))
    ok = errors[0] <= tolerance(dtype) and errors[1] <= tolerance(dtype) and errors[2] <= 1e-4
    print(
        f"{'ok ' if ok else 'BAD'} {str(dtype)[6:]:9s} H={hidden:6d} residual={residual!s:5s} "
        f"err y={errors[0]:.1e} dx={errors[1]:.1e} dw={errors[2]:.1e}",
        flush=True,
    )
    return ok


def run_fp8_case(recipe, hidden, residual, rows=3, dtype=torch.bfloat16):
    torch.manual_seed(hidden + rows)
    dev = torch.device("cuda")
    x = torch.randn(rows, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    res = torch.randn_like(x) if residual else None
    out = cake_cute.cake_rmsnorm_fp8(x, w, 1e-6, residual=res, recipe=recipe, emit_y=True)
    torch.cuda.synchronize()
    data, scales, y, _, _ = fp8_numerics.rmsnorm_fp8_reference(x, w, 1e-6, res, recipe, True, rstd=out.rstd)
    ok = (
        torch.equal(out.data.view(torch.uint8), data.view(torch.uint8))
        and torch.equal(out.scales.view(torch.uint8), scales.view(torch.uint8))
        and torch.equal(out.y, y)
    )
    print(
        f"{'ok ' if ok else 'BAD'} fp8 {recipe:6s} {str(dtype)[6:]:9s} H={hidden:6d} T={rows:4d} "
        f"residual={residual!s:5s}",
        flush=True,
    )
    return ok


def run_finish_case(dtype, hidden, rows, gated=False):
    """A backward that sums dW in its launch (grid barrier, counter, the column sums) against the
    two-launch backward, bitwise."""
    from cake_cute.gated import ops as gated_ops
    from cake_cute.kernels.config import overridden
    from cake_cute.runtime.device import device_facts
    from cake_cute.vocab import dtype_name

    torch.manual_seed(hidden + rows)
    dev = torch.device("cuda")
    x, g, z = (torch.randn(rows, hidden, device=dev, dtype=dtype) for _ in range(3))
    w = torch.randn(hidden, device=dev, dtype=dtype)
    if gated:
        rstd = gated_ops.gated_rmsnorm_forward(x, z, w)[1]
        backward = partial(gated_ops.gated_rmsnorm_backward, g, x, z, w, rstd)
    else:
        rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)[1]
        backward = partial(cake_cute.cake_rmsnorm_train_backward, g, x, w, rstd)
    expected = backward()
    kind = "gated_bwd" if gated else "bwd"
    with overridden(kind, device_facts(dev).arch, dtype_name(dtype), hidden, dw_in_launch=True):
        got = [backward(), backward()]
    torch.cuda.synchronize()
    ok = all(torch.equal(a, b) for outs in got for a, b in zip(outs, expected))
    form = "gated " if gated else ""
    print(f"{'ok ' if ok else 'BAD'} finish {form}{str(dtype)[6:]:9s} H={hidden:6d} T={rows:4d}", flush=True)
    return ok


def main(only: str = ""):
    cases = [
        (f"{str(dtype)[6:]} H={hidden}", partial(run_case, dtype, hidden, residual, rows))
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
        for hidden in (7, 1024, 4096, 4097, 7168, 16384, 32768, 65536)
        for residual in (False, True)
        for rows in ((3, 300) if dtype == torch.float32 and hidden in (16384, 32768) else (3,))
    ]
    cases += [("", partial(run_case, torch.bfloat16, 4096, residual, rows=100)) for residual in (False, True)]
    cases += [
        ("", partial(run_case, dtype, hidden, False, rows=rows))
        for dtype, hidden, rows in (
            (torch.bfloat16, 8192, 700),
            (torch.float32, 4096, 700),
            (torch.bfloat16, 1024, 4000),
        )
    ]
    cases += [
        ("", partial(run_fp8_case, recipe, hidden, residual, rows))
        for recipe in fp8_numerics.RECIPES
        for hidden in (33, 4096, 4097, 65536)
        for residual in (False, True)
        for rows in (3, 100)
    ]
    # Persistent programs that each quantize several row tiles (two staged slots reused in turn).
    cases += [
        (f"fp8 persistent H={hidden}", partial(run_fp8_case, recipe, hidden, False, rows))
        for recipe in fp8_numerics.RECIPES
        for hidden, rows in ((33, 40000), (4096, 1200), (4097, 1200), (7168, 700))
    ]
    cases += [
        (f"fp8 persistent fp32 H={hidden}", partial(run_fp8_case, recipe, hidden, False, rows, torch.float32))
        for recipe in fp8_numerics.RECIPES
        for hidden, rows in ((2048, 1200), (8192, 700))
    ]
    # Rows of fewer than 128 vectors (per-head q/k norms): several row groups per CTA fold their dW in
    # shared memory, at T = 3 (one program) and T = 5000 (many programs, several row tiles each).
    cases += [
        (f"short {str(dtype)[6:]} H={hidden}", partial(run_case, dtype, hidden, residual, rows))
        for dtype in (torch.bfloat16, torch.float32)
        for hidden in (7, 32, 64, 80, 128, 192, 256, 500)
        for residual in (False, True)
        for rows in (3, 5000)
    ]
    # Backwards that sum dW in their own launch: the grid barrier's counter and the column sums.
    cases += [
        (f"finish {str(dtype)[6:]} H={hidden}", partial(run_finish_case, dtype, hidden, rows))
        for dtype in (torch.bfloat16, torch.float32)
        for hidden in (7, 64, 4096, 4097, 65536)
        for rows in (3, 300)
    ]
    cases += [
        ("finish gated", partial(run_finish_case, torch.bfloat16, 128, rows, True)) for rows in (3, 300)
    ]
    results = [case() for label, case in cases if label.startswith(only)]
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
