"""dW on the GPU, by its two finishes: the reduction launched behind the backward (``dw_reduce``) and the
backward's own CTAs after a grid barrier (``dw_finish``, chosen by the config override ``dw_in_launch``).

* Both write bitwise the fixed-order sum of the backward's FP32 partial rows (read back from the
  workspace) as the torch reimplementation of the order computes it (``fixed_order_dw``): the order of
  the two-launch backward before the finish moved, for every form (plain, residual, weight offset, g in
  parts, reading y, gated, FlashInfer's gated functional), dtype, dW dtype, odd H and T = 1, 2, 129.
* The finish in the launch gives bitwise the two-launch dx and dw, leaves its counter zero (the
  workspace's, the stream's), replays twice from a CUDA graph with no host reset, and runs on two
  streams at once.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cake_cute import (
    cake_rmsnorm,
    cake_rmsnorm_silu_gate_train_backward,
    cake_rmsnorm_silu_gate_train_backward_workspace,
    cake_rmsnorm_train_backward,
    cake_rmsnorm_train_backward_workspace,
    cake_rmsnorm_train_forward,
)
from cake_cute.calls import gated_call
from cake_cute.gated import ops as gated_ops
from cake_cute.kernels.config import overridden, reduce_config
from cake_cute.runtime import launch_plan
from cake_cute.runtime.device import device_facts
from cake_cute.vocab import dtype_name

from ._helpers import (  # noqa: F401 (fixed_seed, prewarm_kernels: fixtures)
    assert_bitwise_equal,
    fixed_order_dw,
    fixed_seed,
    prewarm_kernels,
    warm_up_before_capture,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prewarm_kernels")]

DEV = "cuda"
F32 = torch.float32
FINISHES = ("reduce", "launch")
ROWS = (1, 2, 129, 2048)
# (dtype, H): odd and short rows, one CTA, several row groups, clusters, the widest rows (dW in shared
# memory); the dW dtypes are FP32 (functional) and x's (autograd).
SHAPES = [
    (torch.bfloat16, 1),
    (torch.bfloat16, 7),
    (torch.bfloat16, 64),
    (torch.bfloat16, 1000),
    (torch.bfloat16, 4096),
    (torch.bfloat16, 4097),
    (torch.bfloat16, 8192),
    (torch.float16, 7168),
    (torch.bfloat16, 65536),
    (torch.float32, 7),
    (torch.float32, 4096),
    (torch.float32, 131072),
]


def arch() -> str:
    return device_facts(torch.device(DEV)).arch


def finish_as(finish: str, kind: str, dtype, hidden: int):
    """The config override that picks ``finish`` for one (kind, dtype, H), or no override."""
    if finish == "reduce":
        return contextlib.nullcontext()
    return overridden(kind, arch(), dtype_name(dtype), hidden, dw_in_launch=True)


def inputs(dtype, rows: int, hidden: int, residual: bool):
    x = torch.randn(rows, hidden, device=DEV, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    g = torch.randn_like(x)
    rstd = cake_rmsnorm_train_forward(x, w, 1e-6)[1]
    return g, x, w, rstd, torch.randn_like(x) if residual else None


def partial_rows(workspace, programs: int, hidden: int) -> torch.Tensor:
    stride = launch_plan.partial_row_stride(hidden)
    return workspace[: programs * stride * 4].view(F32).view(programs, stride)[:, :hidden]


def counter_of(workspace) -> int:
    return int(workspace[-16:].view(torch.int32)[0])


def plain_backward(finish, g, x, w, rstd, gr, dw_dtype=F32, weight_offset=0.0):
    """(dx, dw, partial rows, the workspace) of one functional backward with ``finish``."""
    rows, hidden = x.shape[0], x.shape[-1]
    workspace = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV, residual=gr is not None)
    with finish_as(finish, "bwd", x.dtype, hidden):
        dx, dw = cake_rmsnorm_train_backward(
            g, x, w, rstd, g_residual=gr, workspace=workspace, dw_dtype=dw_dtype, weight_offset=weight_offset
        )
    torch.cuda.synchronize()
    names = (dtype_name(x.dtype), dtype_name(w.dtype), gr is not None)
    programs = launch_plan.backward_programs(rows, hidden, *names, device_facts(x.device))
    return dx, dw, partial_rows(workspace, programs, hidden), workspace


@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype, hidden", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_dw_is_the_fixed_order_sum_of_the_partial_rows(finish, residual, rows, dtype, hidden):
    g, x, w, rstd, gr = inputs(dtype, rows, hidden, residual)
    for dw_dtype in dict.fromkeys((F32, dtype)):
        dx, dw, partials, workspace = plain_backward(finish, g, x, w, rstd, gr, dw_dtype)
        order = reduce_config(arch(), dtype_name(dw_dtype), hidden).row_lanes
        assert_bitwise_equal(dw, fixed_order_dw(partials, order).to(dw_dtype), f"dw ({dtype_name(dw_dtype)})")
        assert counter_of(workspace) == 0
        again = plain_backward(finish, g, x, w, rstd, gr, dw_dtype)
        assert_bitwise_equal(again[0], dx, "dx, again")
        assert_bitwise_equal(again[1], dw, "dw, again")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype, hidden", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_the_finish_in_the_launch_gives_the_two_launch_bits(rows, dtype, hidden):
    """Plain and residual, with Gemma's offset, and g in three parts (which finishes dW in its launch
    where its own residency holds the programs, else in the reduction)."""
    for residual in (False, True):
        g, x, w, rstd, gr = inputs(dtype, rows, hidden, residual)
        for grads in (g, (g, torch.randn_like(g), torch.randn_like(g))):
            for offset in (0.0, 1.0):
                both = []
                for finish in FINISHES:
                    with finish_as(finish, "bwd", dtype, hidden):
                        both.append(
                            cake_rmsnorm_train_backward(
                                grads, x, w, rstd, g_residual=gr, weight_offset=offset
                            )
                        )
                assert_bitwise_equal(both[1][0], both[0][0], "dx")
                assert_bitwise_equal(both[1][1], both[0][1], "dw")


@pytest.mark.parametrize(
    "dtype, hidden", [(torch.bfloat16, 64), (torch.bfloat16, 4096), (torch.float32, 4097)]
)
def test_the_memory_efficient_backward_finishes_dw_alike(dtype, hidden):
    """Reading y in h's place (autograd's memory-efficient mode, dW in w's dtype)."""
    x0 = torch.randn(129, hidden, device=DEV, dtype=dtype)
    w0 = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    g = torch.randn_like(x0)
    grads = []
    for finish in FINISHES:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with finish_as(finish, "bwd", dtype, hidden):
            cake_rmsnorm(x, w, memory_efficient=True).backward(g)
        grads.append((x.grad, w.grad))
    assert_bitwise_equal(grads[1][0], grads[0][0], "dx")
    assert_bitwise_equal(grads[1][1], grads[0][1], "dw")


@pytest.mark.parametrize("with_workspace", [False, True], ids=["stream-counter", "workspace"])
@pytest.mark.parametrize("rows, hidden", [(129, 4096), (2048, 1024), (70000, 128)])
def test_a_captured_finish_replays_twice_without_a_host_reset(with_workspace, rows, hidden):
    g, x, w, rstd, _ = inputs(torch.bfloat16, rows, hidden, False)
    expected = cake_rmsnorm_train_backward(g, x, w, rstd)
    workspace = cake_rmsnorm_train_backward_workspace(rows, hidden, DEV) if with_workspace else None
    with finish_as("launch", "bwd", torch.bfloat16, hidden):
        warm_up_before_capture(lambda: cake_rmsnorm_train_backward(g, x, w, rstd, workspace=workspace))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dx, dw = cake_rmsnorm_train_backward(g, x, w, rstd, workspace=workspace)
        for replay in range(2):
            dx.fill_(float("nan"))
            dw.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise_equal(dx, expected[0], f"dx, replay {replay}")
            assert_bitwise_equal(dw, expected[1], f"dw, replay {replay}")
            if workspace is not None:
                assert counter_of(workspace) == 0
        # An eager call afterwards (its own counter) leaves the graph's result as it was.
        assert_bitwise_equal(cake_rmsnorm_train_backward(g, x, w, rstd)[1], expected[1], "eager dw")


TWO_STREAMS = """
import torch
import cake_cute
from cake_cute.kernels.config import overridden
from cake_cute.runtime.device import device_facts

torch.manual_seed(0)
x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
g = torch.randn_like(x)
rstd = cake_cute.cake_rmsnorm_train_forward(x, w, 1e-6)[1]
expected = cake_cute.cake_rmsnorm_train_backward(g, x, w, rstd)
streams = [torch.cuda.Stream() for _ in range(2)]
results = []
with overridden("bwd", device_facts(x.device).arch, "bf16", 4096, dw_in_launch=True):
    cake_cute.cake_rmsnorm_train_backward(g, x, w, rstd)
    torch.cuda.synchronize()
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(10):
        for stream in streams:
            with torch.cuda.stream(stream):
                results.append(cake_cute.cake_rmsnorm_train_backward(g, x, w, rstd))
    torch.cuda.synchronize()
ok = all(torch.equal(dx, expected[0]) and torch.equal(dw, expected[1]) for dx, dw in results)
print("same bits" if ok else "DIFFERENT BITS")
"""


def test_finishes_on_two_streams_at_once_keep_their_bits():
    """Per-stream counters: backwards queued on two streams run side by side (each grid barrier waits
    only for its own CTAs; a cooperative launch starts once all of them can be resident). In a process
    of its own with a time limit: were two grids to wait on each other, the test fails instead of
    hanging the suite."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TWO_STREAMS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same bits", done.stdout + done.stderr


GATED = [(128, 128, True), (4096, 4096, True), (2048, 256, False), (16384, 8192, False)]


@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("rows", (1, 2, 129, 5000))
@pytest.mark.parametrize("hidden, group, norm_before_gate", GATED)
def test_the_gated_dw_is_the_fixed_order_sum_of_its_partial_rows(
    finish, rows, hidden, group, norm_before_gate
):
    dtype = torch.bfloat16
    x, z, g = (torch.randn(rows, hidden, device=DEV, dtype=dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    options = dict(group_size=group, norm_before_gate=norm_before_gate)
    rstd = gated_ops.gated_rmsnorm_forward(x, z, w, **options)[1]
    call = gated_call(x, z, w, None, group, norm_before_gate, 0.0)
    spec = gated_ops.forward_spec(call)
    programs = gated_ops.backward_programs_of(call, spec)
    workspace = torch.zeros(launch_plan.workspace_bytes(programs, hidden), dtype=torch.uint8, device=DEV)
    for dw_dtype in (F32, dtype):
        dx, dz, dw = (
            torch.empty_like(x),
            torch.empty_like(x),
            torch.empty(hidden, device=DEV, dtype=dw_dtype),
        )
        with finish_as(finish, "gated_bwd", dtype, hidden):
            gated_ops.launch_backward(call, spec, g, rstd, dx, dz, dw, programs, workspace, workspace)
        torch.cuda.synchronize()
        order = reduce_config(arch(), dtype_name(dw_dtype), hidden).row_lanes
        expected = fixed_order_dw(partial_rows(workspace, programs, hidden), order).to(dw_dtype)
        assert_bitwise_equal(dw, expected, f"dw ({dtype_name(dw_dtype)})")
        assert counter_of(workspace) == 0
        public = gated_ops.gated_rmsnorm_backward(g, x, z, w, rstd, **options)
        assert_bitwise_equal(public[0], dx, "dx")
        assert_bitwise_equal(public[1], dz, "dz")


@pytest.mark.parametrize("accumulate", [False, True])
def test_flashinfers_gated_backward_finishes_dw_alike_and_leaves_its_counter_zero(accumulate):
    rows, hidden, dtype = 4096, 128, torch.bfloat16
    x, z, g = (torch.randn(rows, hidden, device=DEV, dtype=dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    start = torch.randn(hidden, device=DEV, dtype=dtype)
    got = []
    for finish in FINISHES:
        workspace = cake_rmsnorm_silu_gate_train_backward_workspace(rows, DEV)
        grad_weight = start.clone()
        with finish_as(finish, "gated_bwd", dtype, hidden):
            for _ in range(2):  # the second call finds the counter the first one left
                out = cake_rmsnorm_silu_gate_train_backward(
                    g, x, z, w, grad_weight=grad_weight.copy_(start), accumulate_grad_weight=accumulate,
                    workspace=workspace,
                )  # fmt: skip
            dx_only = cake_rmsnorm_silu_gate_train_backward(g, x, z, w, compute_grad_weight=False)
        torch.cuda.synchronize()
        assert counter_of(workspace) == 0 and dx_only[2] is None
        assert_bitwise_equal(dx_only[0], out[0], "dx without dw")
        got.append(out)
    for name, a, b in zip(("dx", "dz", "dw"), got[1], got[0]):
        assert_bitwise_equal(a, b, name)


def test_the_native_path_finishes_dw_in_the_launch_as_python_does():
    """The C++ host path launches the same backward (dw and its stream's counter among its
    arguments) once the Python path has handed the signature over."""
    from cake_cute import dispatch
    from cake_cute.runtime import native

    if not dispatch.prepare():
        pytest.skip("the native host path is not available here")
    g, x, w, rstd, _ = inputs(torch.bfloat16, 2048, 4096, False)
    with finish_as("launch", "bwd", torch.bfloat16, 4096):
        cake_rmsnorm_train_forward(x, w, 1e-6)  # hands the signature over
        workspace = cake_rmsnorm_train_backward_workspace(2048, 4096, DEV)
        python = cake_rmsnorm_train_backward(g, x, w, rstd, workspace=workspace)
        served = native.extension.backward(g, x, w, rstd, None, 0.0, F32)
        assert served is not None
        again = native.extension.backward(g, x, w, rstd, None, 0.0, F32)
    for name, a, b, c in zip(("dx", "dw"), served, again, python):
        assert_bitwise_equal(a, c, name)
        assert_bitwise_equal(b, c, f"{name}, again")
