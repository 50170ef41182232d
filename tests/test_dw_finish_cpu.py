"""The dW finish without a GPU: the fixed summation order of ``dw_reduce.ColumnSum`` (as its teams split
it) against the torch reimplementation of ``dw_reduce``'s order, the in-launch backwards' machine code
(no spill, no atomic on data, the grid barrier's two integer atomics), the workspace's counter slot,
and which launches a backward makes with the finish in its launch."""

from __future__ import annotations

import pytest
import torch

from cake_cute import launch
from cake_cute.kernels.config import finish_cells_bytes, finish_team, overridden, reduce_config
from cake_cute.runtime import cache as compile_cache
from cake_cute.runtime import launch_plan
from cake_cute.runtime.device import DeviceFacts
from cake_cute.runtime.operands import Operands
from cake_cute.runtime.specs import GatedSpec, KernelSpec, ReduceSpec
from cake_cute.runtime.views import barrier_counter
from cake_cute.tools import cubin

from ._helpers import bits, fixed_order_dw

H200 = DeviceFacts(0, "stand-in H200", (9, 0), "sm_90a", 132)


def column_sum_model(columns, partials: torch.Tensor) -> torch.Tensor:
    """What ``ColumnSum.column_vector`` computes, step by step with its own lane mapping
    (``ColumnSum.lane_of``), in FP32 torch additions: member 0's sum of every column of ``partials``."""
    lanes, team, batch = columns.lanes, columns.team, columns.config.rows_in_flight
    count = partials.shape[0]
    zero = torch.zeros(partials.shape[1])

    def lane_sum(lane):
        acc = zero.clone()
        most = -(-count // lanes)  # the rows of the lane that has the most
        for b in range(-(-most // batch)):
            rows = [lane + (b * batch + k) * lanes for k in range(batch)]
            for row in rows:
                acc = acc + (partials[row] if row < count else zero)
        return acc

    def butterfly(values, width):
        while width > 1:
            width //= 2
            values = [v + values[i ^ width] for i, v in enumerate(values)]
        return values

    sums = []
    for member in range(team):
        own = [lane_sum(columns.lane_of(member, k)) for k in range(columns.lanes_per_thread)]
        while len(own) > 1:
            half = len(own) // 2
            own = [own[k] + own[k + half] for k in range(half)]
        sums.append(own[0])
    width = min(team, 32)
    warps = [butterfly(sums[w * width : (w + 1) * width], width) for w in range(team // width)]
    if columns.warps == 1:
        return warps[0][0]
    cells = [warp[0] for warp in warps] + [zero] * (32 - columns.warps)
    return butterfly(cells, columns.warps)[0]


def awkward_partials(count: int, seed: int) -> torch.Tensor:
    """FP32 partial rows of three columns with magnitudes over many binades, zeros of both signs and
    infinities, so that any change of the order changes some bit."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(count, 3, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (count, 3), generator=gen)
    )
    values[torch.rand(count, 3, generator=gen) < 0.1] = -0.0
    values[torch.rand(count, 3, generator=gen) < 0.1] = 0.0
    if count > 3:
        values[count // 2, 2] = float("inf")
    return values


@pytest.mark.parametrize("hidden", [1, 7, 64, 1000, 4096, 8192, 65536])
@pytest.mark.parametrize("threads", [None, 128, 448, 512])
@pytest.mark.parametrize("count", [1, 2, 5, 129, 264, 1056])
def test_column_sums_follow_dw_reduces_order(hidden, threads, count):
    """The reduction's teams (``threads`` None: the dw_reduce kernel's, of R threads) and a backward
    CTA's of ``threads`` threads split a column's sum over their lanes, shuffles and warps; the
    result is bitwise the fixed order of R lane sums and their tree."""
    from cake_cute.kernels.dw_reduce import ColumnSum

    config = reduce_config("sm_90a", "fp32", hidden)
    team = config.row_lanes if threads is None else finish_team(config, threads)
    partials = awkward_partials(count, seed=hidden + count)
    got = column_sum_model(ColumnSum(config, team, None), partials)
    assert torch.equal(bits(got), bits(fixed_order_dw(partials, config.row_lanes)))


def test_fixed_order_dw_is_not_a_plain_sum():
    """The reference order is a specific one: summing the same rows from the first to the last gives
    other bits (so the tests above can fail)."""
    partials = awkward_partials(1056, seed=1)
    partials[:, 2] = partials[:, 0]  # finite columns only
    sequential = torch.zeros(3)
    for row in partials:
        sequential = sequential + row
    assert not torch.equal(bits(sequential), bits(fixed_order_dw(partials, 64)))


def test_finish_cells_fit_the_scratch_a_backward_gives_them():
    """Threads beyond the largest power of two form teams of their own; a team of several warps keeps
    one FP32 column vector per warp."""
    config = reduce_config("sm_90a", "fp32", 4096)  # 64 row lanes of 4 columns
    assert finish_team(config, 448) == 64 and finish_cells_bytes(config, 448) == 7 * 2 * 4 * 4
    narrow = reduce_config("sm_90a", "fp32", 64)  # 1024 row lanes
    assert finish_team(narrow, 256) == 256 and finish_cells_bytes(narrow, 256) == 8 * 4 * 4


IN_LAUNCH_SPECS = [
    KernelSpec("bwd", "ARCH", "bf16", "bf16", 4096, False, 0.0, 1, False, "fp32"),
    KernelSpec("bwd", "ARCH", "bf16", "bf16", 4096, True, 1.0, 1, False, "bf16"),
    KernelSpec("bwd", "ARCH", "bf16", "bf16", 64, False, 0.0, 1, True, "bf16"),
    KernelSpec("bwd", "ARCH", "fp16", "fp32", 7168, True, 0.0, 1, False, "fp32"),
    KernelSpec("bwd", "ARCH", "bf16", "bf16", 4097, False, 0.0, 1, False, "fp32"),
    KernelSpec("bwd", "ARCH", "bf16", "bf16", 65536, False, 0.0, 1, False, "bf16"),
    KernelSpec("bwd", "ARCH", "fp32", "fp32", 131072, False, 0.0, 1, False, "fp32"),
    KernelSpec("bwd", "ARCH", "bf16", "bf16", 8192, False, 0.0, 2, False, "fp32"),
    GatedSpec("gated_bwd", "ARCH", "bf16", "bf16", 128, 128, True, 0.0, dw_dtype="fp32"),
    GatedSpec("gated_bwd", "ARCH", "bf16", "bf16", 4096, 4096, True, 0.0, dw_dtype="bf16"),
    GatedSpec("gated_bwd", "ARCH", "fp32", "fp32", 2048, 256, False, 0.0, dw_dtype="fp32"),
    GatedSpec("gated_bwd", "ARCH", "bf16", "bf16", 16384, 8192, False, 0.0, dw_dtype="fp32"),
]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("spec", IN_LAUNCH_SPECS, ids=lambda s: s.name().replace("ARCH", ""))
def test_backwards_that_finish_dw_compile_spill_free_without_atomics_on_data(
    tmp_path, monkeypatch, arch, spec
):
    """Every form of the backward with the dW finish in its launch (plain, residual, offset, reading y,
    g in parts, short, odd, cluster and widest rows, the gated forms): no spill, no atomic on data, and
    exactly the grid barrier's two integer atomics (its arrival and its departure)."""
    from dataclasses import replace

    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    report = cubin.kernel_report(replace(spec, arch=arch))
    assert cubin.spill_free(report) and report["local_loads"] == report["local_stores"] == 0, report
    assert report["data_atomics"] == 0 and report["global_atomics"] == 2, report


def test_a_workspace_ends_with_the_counter_slot():
    """The counter is the last 16-byte slot of the caller's workspace, after every partial row the
    workspace was sized for, whatever a call's own row count."""
    hidden, programs = 1000, 264
    nbytes = launch_plan.workspace_bytes(programs, hidden)
    assert nbytes == launch_plan.partial_rows_bytes(programs, hidden) + 16
    workspace = torch.zeros(nbytes + 5, dtype=torch.uint8)  # a larger one: the slot stays aligned
    counter = barrier_counter(workspace, workspace.device)
    offset = counter.data_ptr() - workspace.data_ptr()
    assert counter.dtype == torch.int32 and counter.shape == (1,)
    assert offset % 16 == 0 and offset >= launch_plan.partial_rows_bytes(programs, hidden)
    assert offset + 16 <= workspace.numel()


class Recorder:
    def __init__(self, spec, calls):
        self.spec, self.calls = spec, calls

    def __call__(self, *args):
        self.calls.append((self.spec, args))


@pytest.fixture
def plain_launches(monkeypatch):
    """The plain backward's host path down to its launches, on CPU tensors of a stand-in H200."""
    import contextlib

    calls = []
    monkeypatch.setattr(launch, "get_kernel", lambda spec: Recorder(spec, calls))
    monkeypatch.setattr(launch, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(launch_plan, "resident_clusters", lambda *args: 264)
    return calls


def _call(hidden, rows, workspace=None, dw_dtype=torch.float32, g_parts=1):
    from cake_cute.calls import BackwardCall

    operands = Operands(torch.device("cpu"), hidden, "sm_90a", "bf16", "bf16", H200)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    gs = tuple(torch.randn_like(x) for _ in range(g_parts))
    w, rstd = torch.ones(hidden, dtype=torch.bfloat16), torch.ones(rows)
    fields = (gs, x, w, rstd, None, 0.0, dw_dtype, operands, False)
    return BackwardCall(*fields, workspace=workspace)


def test_the_two_launch_backward_launches_the_reduction(plain_launches):
    launch.launch_backward(_call(4096, 2048))
    (bwd, args), (reduce, reduce_args) = plain_launches
    assert bwd == KernelSpec("bwd", "sm_90a", "bf16", "bf16", 4096)
    assert reduce == ReduceSpec("sm_90a", "fp32", 4096) and reduce_args[0] is args[6]


def test_a_backward_that_finishes_dw_launches_once_with_dw_and_the_workspace_counter(plain_launches):
    rows, hidden = 2048, 4096
    plan = launch.backward_launch_plan(
        Operands(torch.device("cpu"), hidden, "sm_90a", "bf16", "bf16", H200), rows, False
    )
    workspace = torch.zeros(plan.workspace_bytes, dtype=torch.uint8)
    with overridden("bwd", "sm_90a", "bf16", hidden, dw_in_launch=True):
        dx, dw = launch.launch_backward(_call(hidden, rows, workspace, torch.bfloat16))
    ((spec, args),) = plain_launches
    assert spec == KernelSpec("bwd", "sm_90a", "bf16", "bf16", hidden, dw_dtype="bf16")
    partials, dw_arg, counter, programs = args[6:10]
    assert dw_arg is dw and dw.dtype == torch.bfloat16 and programs == plan.programs
    assert counter.data_ptr() == workspace.data_ptr() + plan.workspace_bytes - 16
    assert partials.data_ptr() == workspace.data_ptr()


def test_g_in_parts_finishes_dw_in_the_launch_only_where_its_programs_are_resident(monkeypatch):
    """A parts variant launches the one-g program count; where its own residency holds fewer (a second
    wave: bf16 H = 8192 in residual mode, two CTAs per SM with one g, one with parts), a grid barrier
    would wait for programs that cannot start: dW goes to the reduction. Without the override the
    backward never finishes dW in its launch."""
    from cake_cute.kernels.config import backward_config

    monkeypatch.setattr(launch_plan, "resident_clusters", lambda *args: args[4] * args[5] // args[3])
    launch_plan.backward_programs.cache_clear()
    assert [backward_config("sm_90a", "bf16", "bf16", 8192, True, g).ctas_per_sm for g in (1, 3)] == [2, 1]
    plan = ("bf16", "bf16", True)
    with overridden("bwd", "sm_90a", "bf16", 8192, dw_in_launch=True):
        assert launch_plan.finishes_dw_in_launch(4096, 8192, *plan, 1, H200)
        assert not launch_plan.finishes_dw_in_launch(4096, 8192, *plan, 3, H200)  # 264 programs, 132 fit
        assert launch_plan.finishes_dw_in_launch(100, 8192, *plan, 3, H200)  # 100 programs
    assert not launch_plan.finishes_dw_in_launch(4096, 8192, *plan, 1, H200)
    launch_plan.backward_programs.cache_clear()


def test_the_gated_backward_that_finishes_dw_launches_once(launches, monkeypatch):
    from cake_cute.gated import ops as gated_ops

    counters = []
    monkeypatch.setattr(gated_ops, "barrier_counter", lambda space, device: counters.append(space) or "ctr")
    x = torch.randn(300, 128, dtype=torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    rstd = torch.ones(300)
    with overridden("gated_bwd", "sm_90a", "bf16", 128, dw_in_launch=True):
        dx, dz, dw = gated_ops.gated_rmsnorm_backward(x, x, x, w, rstd)
    ((spec, args),) = launches
    form = dict(group_size=128, norm_before_gate=True, dw_dtype="fp32")
    assert spec == GatedSpec("gated_bwd", "sm_90a", "bf16", "bf16", 128, **form)
    assert args[8] is dw and args[9] == "ctr" and counters == [None]


def test_flashinfers_workspace_gives_the_gated_finish_its_counter(launches, monkeypatch):
    from cake_cute.gated import flashinfer as gated_flashinfer
    from cake_cute.gated import ops as gated_ops

    counters = []
    monkeypatch.setattr(gated_ops, "barrier_counter", lambda space, device: counters.append(space) or "ctr")
    monkeypatch.setattr(gated_flashinfer, "on_device", lambda device: __import__("contextlib").nullcontext())
    x = torch.randn(300, 128, dtype=torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    programs = gated_ops.backward_programs_of(*_gated(x, w))
    nbytes = gated_flashinfer._scratch_bytes(300, 128) + launch_plan.workspace_bytes(programs, 128)
    workspace = torch.zeros(nbytes, dtype=torch.uint8)
    with overridden("gated_bwd", "sm_90a", "bf16", 128, dw_in_launch=True):
        gated_flashinfer.cake_rmsnorm_silu_gate_train_backward(x, x, x, w, workspace=workspace)
        gated_flashinfer.cake_rmsnorm_silu_gate_train_backward(x, x, x, w, compute_grad_weight=False)
    assert counters[0] is workspace and counters[1] is None
    assert [spec.kind for spec, _ in launches] == ["gated_rstd", "gated_bwd"] * 2  # no reduction


def _gated(x, w):
    from cake_cute.calls import gated_call
    from cake_cute.gated import ops as gated_ops

    call = gated_call(x, x, w, 1e-6, None, True, 0.0)
    return call, gated_ops.forward_spec(call)
