"""The backward's launch plan, without a GPU: how many persistent programs a T gets, and that a workspace
sized for T rows holds exactly the most partial rows any call of up to T rows writes."""

from __future__ import annotations

import pytest
from cake_cute.kernels.config import backward_config
from cake_cute.kernels.tiling import backward_tiling

from cake_cute import dispatch
from cake_cute.device import DeviceFacts

H200 = DeviceFacts(0, "stand-in H200", (9, 0), "sm_90a", 132)


@pytest.fixture(autouse=True)
def occupancy_without_a_driver(monkeypatch):
    """Resident clusters from the per-SM CTA count alone (the driver query needs a GPU)."""
    monkeypatch.setattr(
        dispatch,
        "resident_clusters",
        lambda index, capability, threads, cluster, per_sm, sms: sms * per_sm // cluster,
    )
    for cached in (dispatch.backward_programs, dispatch.backward_launch):
        cached.cache_clear()
    yield
    for cached in (dispatch.backward_programs, dispatch.backward_launch):
        cached.cache_clear()


def _programs(rows, hidden=4096):
    return dispatch.backward_programs(rows, hidden, "bf16", "bf16", False, H200)


def test_programs_follow_the_row_tiles():
    resident = 2 * 132  # 512-thread CTAs with 64 registers: two per SM
    assert backward_tiling(4096, "bf16").threads_per_cta == 512
    assert [_programs(t) for t in (1, 2, 16, 63)] == [1, 2, 16, 63]  # one tile each
    assert [_programs(t) for t in (64, 129, 256, resident)] == [32, 65, 128, resident // 2]  # two each
    assert [_programs(t) for t in (resident + 1, 4096, 10**6)] == [resident] * 3  # all resident


@pytest.mark.parametrize("hidden", [1024, 4096, 16384, 262144])
def test_workspace_rows_cover_every_smaller_call(hidden):
    most_so_far = 0
    for rows in range(0, 1500):
        launched = dispatch.backward_launch(max(rows, 1), hidden, "bf16", "bf16", False, H200)[1]
        most_so_far = max(most_so_far, launched)
        assert dispatch.most_partial_rows(rows, hidden, "bf16", "bf16", False, H200) == most_so_far, rows


@pytest.mark.parametrize(
    "hidden, act, residual, ring_depth, per_sm",
    [
        (8192, "bf16", False, 4, 1),  # four 16 KB stages of g and h: the CTA takes the SM
        (8192, "bf16", True, 2, 2),  # residual mode keeps two stages
        (4096, "fp32", False, 4, 1),
        (4096, "bf16", False, 2, 2),  # 16 warps of one 2-byte vector: measured slower with four
        (1024, "bf16", False, 4, 6),  # a small tile: more stages cost no residency
        (16384, "bf16", False, 2, 2),  # a cluster row
    ],
)
def test_backward_ring_depth_and_residency(hidden, act, residual, ring_depth, per_sm):
    config = backward_config("sm_90a", act, act, hidden, residual)
    assert (config.ring_depth, config.ctas_per_sm) == (ring_depth, per_sm)


@pytest.mark.parametrize("act", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("residual", [False, True])
def test_backward_shared_memory_fits_one_cta(act, residual):
    """Every backward tiling's shared memory fits the 227 KB one CTA may use (else the launch fails)."""
    for hidden in [1, 7, 1000, 1024, 4096, 4097, 5120, 7168, 8192, 12288, 16384, 65537, 131072, 262144]:
        for arch in ("sm_90a", "sm_100a"):
            config = backward_config(arch, act, "fp32", hidden, residual)
            assert config.smem_bytes <= 227 * 1024, (hidden, config.describe())
