"""The backward's launch plan, without a GPU: how many persistent programs a T gets, and that a workspace
sized for T rows holds exactly the most partial rows any call of up to T rows writes."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import pytest
import torch

from cake_cute.kernels.config import (
    MAX_G_PARTS,
    backward_config,
    backward_ring_depth,
    overridden,
    override_choices,
    reduce_config,
)
from cake_cute.kernels.tiling import backward_tiling, forward_tiling
from cake_cute.launch import backward_launch_plan
from cake_cute.runtime import launch_plan
from cake_cute.runtime.build import config_for
from cake_cute.runtime.device import DeviceFacts
from cake_cute.runtime.operands import Operands
from cake_cute.runtime.specs import KernelSpec

H200 = DeviceFacts(0, "stand-in H200", (9, 0), "sm_90a", 132)


@pytest.fixture(autouse=True)
def occupancy_without_a_driver(monkeypatch):
    """Resident clusters from the per-SM CTA count alone (the driver query needs a GPU)."""
    monkeypatch.setattr(
        launch_plan,
        "resident_clusters",
        lambda index, capability, threads, cluster, per_sm, sms: sms * per_sm // cluster,
    )
    launch_plan.backward_programs.cache_clear()
    yield
    launch_plan.backward_programs.cache_clear()


def _programs(rows, hidden=4096):
    return launch_plan.backward_programs(rows, hidden, "bf16", "bf16", False, H200)


def test_programs_follow_the_row_tiles():
    resident = 2 * 132  # 512-thread CTAs with 64 registers: two per SM
    assert backward_tiling(4096, "bf16").threads_per_cta == 512
    assert [_programs(t) for t in (1, 2, 16, 63)] == [1, 2, 16, 63]  # one tile each
    assert [_programs(t) for t in (64, 129, 256, resident)] == [32, 65, 128, resident // 2]  # two each
    assert [_programs(t) for t in (resident + 1, 4096, 10**6)] == [resident] * 3  # all resident


@pytest.mark.parametrize(
    "hidden, lanes, vecs, cluster",
    [
        (8192, 256, 4, 2),  # clusters of 2 and 16 keep 4 vectors per lane (measured 0-3% slower with 8)
        (16384, 128, 8, 4),
        (32768, 128, 8, 8),
        (65536, 256, 4, 16),
        (131072, 512, 4, 16),
        (4 * (3 * 256 * 4 + 1), 256, 4, 4),  # ragged: 8 vectors with column predicates would spill
    ],
)
def test_fp32_cluster_backward_tilings(hidden, lanes, vecs, cluster):
    tiling = backward_tiling(hidden, "fp32")
    assert (tiling.threads_per_row, tiling.vecs_per_thread, tiling.cluster_n) == (lanes, vecs, cluster)


@pytest.mark.parametrize("hidden", [1024, 4096, 16384, 262144])
def test_workspace_rows_cover_every_smaller_call(hidden):
    most_so_far = 0
    for rows in range(0, 1500):
        launched = launch_plan.backward_programs(max(rows, 1), hidden, "bf16", "bf16", False, H200)
        most_so_far = max(most_so_far, launched)
        assert launch_plan.most_partial_rows(rows, hidden, "bf16", "bf16", False, H200) == most_so_far, rows


@pytest.mark.parametrize(
    "hidden, act, residual, ring_depth, per_sm",
    [
        (8192, "bf16", False, 4, 1),  # four 16 KB stages of g and h: the CTA takes the SM
        (8192, "bf16", True, 2, 2),  # residual mode keeps two stages
        (4096, "fp32", False, 4, 1),
        (4096, "bf16", False, 2, 2),  # 16 warps of one 2-byte vector: measured slower with four
        (1024, "bf16", False, 2, 6),  # one 2-byte vector per lane: two stages win at training shapes
        (5120, "bf16", False, 4, 2),  # two vectors per lane: four stages
        (16384, "bf16", False, 2, 2),  # a cluster row
    ],
)
def test_backward_ring_depth_and_residency(hidden, act, residual, ring_depth, per_sm):
    config = backward_config("sm_90a", act, act, hidden, residual)
    assert (config.ring_depth, config.ctas_per_sm) == (ring_depth, per_sm)


@pytest.mark.parametrize("act", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("residual", [False, True])
def test_backward_shared_memory_fits_one_cta(act, residual):
    """Every backward tiling's shared memory fits the 227 KB one CTA may use (else the launch fails),
    with g in one part or in as many as a backward takes."""
    hiddens = (1, 7, 32, 64, 80, 128, 256, 1000, 1024, 4096, 4097, 5120, 7168, 8192, 12288, 16384, 32768)
    hiddens += (65536, 65537, 131072, 262144)
    for hidden, arch, g_parts in product(hiddens, ("sm_90a", "sm_100a"), range(1, MAX_G_PARTS + 1)):
        config = backward_config(arch, act, "fp32", hidden, residual, g_parts)
        assert config.smem_bytes <= 227 * 1024, (hidden, g_parts, config.describe())


@pytest.mark.parametrize("act", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "hidden, forward_lanes, backward_rows",
    [(32, (2, 2), 64), (64, (4, 2), 32), (80, (4, 3), 16), (96, (4, 3), 16), (128, (8, 2), 16)]
    + [(192, (8, 3), 8), (256, (16, 2), 8)],
)
def test_short_row_tilings(act, hidden, forward_lanes, backward_rows):
    """Rows of at most 32 vectors: the forward's lanes hold two vectors where that covers the row exactly
    (four otherwise, as before); the backward's plain-mode CTAs hold twice the rows of residual mode's
    128 threads. Neither depends on T."""
    forward = forward_tiling(hidden, act)
    assert (forward.threads_per_row, forward.vecs_per_thread) == forward_lanes
    residual = backward_config("sm_90a", act, act, hidden, True).tiling
    plain = backward_config("sm_90a", act, act, hidden, False).tiling
    assert (residual.rows_per_cta, residual.threads_per_cta) == (backward_rows, 128)
    assert plain == replace(residual, rows_per_cta=2 * backward_rows)


@pytest.mark.parametrize(
    "act, hidden", [("bf16", 264), ("fp16", 512), ("bf16", 1000), ("fp32", 64), ("fp32", 192), ("fp32", 500)]
)
def test_backward_ctas_of_several_rows(act, hidden):
    """Rows of fewer than 128 vectors, short or not: plain-mode backward CTAs hold 256 threads' rows;
    in residual mode 2-byte rows keep 128 threads, FP32 rows take 256 as well. A row of 128 vectors
    (bf16 H = 1024, fp32 H = 512) is one CTA's, as before."""
    plain = backward_tiling(hidden, act, residual=False)
    residual = backward_tiling(hidden, act, residual=True)
    assert plain.threads_per_cta == 256 and plain.rows_per_cta > 1
    assert residual.threads_per_cta == (256 if act == "fp32" else 128)
    assert replace(residual, rows_per_cta=plain.rows_per_cta) == plain
    for wide_act, wide in (("bf16", 1024), ("fp32", 512)):
        assert backward_tiling(wide, wide_act).rows_per_cta == 1


@pytest.mark.parametrize("hidden, residual", [(64, False), (64, True), (7, False), (1024, False)])
def test_a_program_writes_one_partial_row(hidden, residual):
    """The row groups of a CTA fold their dW before the program writes it: as many partial rows as
    programs, whatever the rows per CTA."""
    operands = Operands(torch.device("cuda"), hidden, "sm_90a", "bf16", "bf16", H200)
    for rows in (1, 100, 5000, 10**6):
        plan = backward_launch_plan(operands, rows, residual)
        assert plan.partial_rows == plan.programs
        assert plan.programs == launch_plan.backward_programs(rows, hidden, "bf16", "bf16", residual, H200)
        assert plan.workspace_bytes == launch_plan.partial_rows_bytes(plan.programs, hidden) + 16


@pytest.mark.parametrize("groups", range(1, 300))
def test_the_fold_adds_every_row_group_into_group_zero_once(groups):
    """``fold_levels``' tree: each level's adders read groups nobody writes in that level, and group 0
    ends holding every group's sum exactly once."""
    from cake_cute.kernels.dw_partial_rows import fold_levels

    held = [[g] for g in range(groups)]
    for adders, stride in fold_levels(groups):
        assert adders <= stride and adders + stride <= groups
        for r in range(adders):
            held[r] = held[r] + held[r + stride]
        groups = stride
    assert sorted(held[0]) == list(range(len(held)))


def test_an_override_changes_one_entry_and_leaves_with_its_context():
    default = backward_config("sm_90a", "bf16", "bf16", 5120, False)
    assert default.ring_depth == 4
    with overridden("bwd", "sm_90a", "bf16", 5120, ring_depth=2, register_budget=128):
        changed = backward_config("sm_90a", "bf16", "bf16", 5120, False)
        assert (changed.ring_depth, changed.register_budget) == (2, 128)
        assert changed.min_ctas_per_sm == 65536 // (128 * changed.tiling.threads_per_cta)  # derived
        assert changed.smem_bytes < default.smem_bytes  # follows the shallower ring
        assert backward_config("sm_100a", "bf16", "bf16", 5120, False).ring_depth == 4  # other arch
        assert backward_config("sm_90a", "bf16", "bf16", 8192, False).ring_depth == 4  # other H
        assert override_choices("bwd", "sm_90a", "bf16", 5120) == {"ring_depth": 2, "register_budget": 128}
    assert backward_config("sm_90a", "bf16", "bf16", 5120, False) == default
    assert override_choices("bwd", "sm_90a", "bf16", 5120) == {}


def test_an_override_clears_the_launch_plans_built_from_the_config():
    before = launch_plan.backward_programs(4096, 1024, "bf16", "bf16", False, H200)
    with overridden("bwd", "sm_90a", "bf16", 1024, ctas_per_sm=1):
        assert launch_plan.backward_programs(4096, 1024, "bf16", "bf16", False, H200) == 132
    assert launch_plan.backward_programs(4096, 1024, "bf16", "bf16", False, H200) == before != 132


@pytest.mark.parametrize(
    "kind, choices, message",
    [
        ("bwd", {"stages": 4}, r"a bwd config has no choice stages"),
        ("fwd", {"ring_depth": 4}, r"a fwd config has no choice ring_depth"),
        ("conv", {}, r"kind must be one of fwd, bwd, dw"),
        ("fwd", {"tiling": replace(forward_tiling(1024, "bf16"), vec=4)}, r"must keep vec=8"),
        ("fwd", {"tiling": forward_tiling(2048, "bf16")}, r"must be one of H = 1024, got one of H = 2048"),
    ],
)
def test_an_override_is_checked(kind, choices, message):
    with pytest.raises(ValueError, match=message), overridden(kind, "sm_90a", "bf16", 1024, **choices):
        pass


def test_residual_mode_refuses_a_deeper_ring():
    with overridden("bwd", "sm_90a", "bf16", 1024, ring_depth=4):
        assert backward_config("sm_90a", "bf16", "bf16", 1024, False).ring_depth == 4
        with pytest.raises(ValueError, match="residual mode keeps a ring of 2"):
            backward_config("sm_90a", "bf16", "bf16", 1024, True)


def test_one_g_part_is_the_backward_as_before():
    """g_parts = 1, the default, names and configures the backward as before g could come in parts
    (the ring depth of the rule; the shared memory of one g: the g_parts = 1 column below)."""
    variant = ("bwd", "sm_90a", "bf16", "bf16", 4096)
    spec = KernelSpec(*variant, residual=True)
    assert spec == KernelSpec(*variant, residual=True, g_parts=1) and spec.g_parts == 1
    assert spec.name() == "cake_bwd_sm_90a_bf16_wbf16_h4096_res_off0"
    assert (
        KernelSpec(*variant, residual=True, g_parts=3).name()
        == "cake_bwd_sm_90a_bf16_wbf16_h4096_res_off0_g3"
    )
    for arch, act, hidden, residual in product(
        ("sm_90a", "sm_100a"), ("bf16", "fp32"), (7, 1024, 4096, 5120, 8192, 65536, 131072), (False, True)
    ):
        config = backward_config(arch, act, "fp32", hidden, residual)
        assert config_for(KernelSpec("bwd", arch, act, "fp32", hidden, residual=residual)) == config
        rule = backward_ring_depth(config.tiling, act, residual)
        assert config.ring_depth == (0 if config.dw_in_smem else rule)


@pytest.mark.parametrize(
    "hidden, act, residual, ring_depths, smem_bytes, per_sm",
    [
        # 4 x 2 tiles of 16 KB become 2 x 3 and 2 x 4: the staging stays at or below one g's.
        (8192, "bf16", False, (4, 2, 2), (148872, 116104, 148872), (1, 1, 1)),
        (5120, "bf16", False, (4, 2, 2), (93592, 73112, 93592), (2, 2, 2)),
        # Two slots stay two and stage one 8 KB tile more per part: two CTAs still fit.
        (4096, "bf16", False, (2, 2, 2), (42440, 58824, 75208), (2, 2, 2)),
        # Residual mode keeps two slots; 16 KB tiles then leave one CTA per SM instead of two.
        (8192, "bf16", True, (2, 2, 2), (99720, 132488, 165256), (2, 1, 1)),
        # Without a ring the parts are read from global memory: nothing more is staged.
        (131072, "fp32", False, (0, 0, 0), (67016, 67016, 67016), (1, 1, 1)),
    ],
)
def test_parts_ring_keeps_the_staged_tiles(hidden, act, residual, ring_depths, smem_bytes, per_sm):
    configs = [backward_config("sm_90a", act, act, hidden, residual, parts) for parts in (1, 2, 3)]
    assert [c.ring_depth for c in configs] == list(ring_depths)
    assert [c.smem_bytes for c in configs] == list(smem_bytes)
    assert [c.ctas_per_sm for c in configs] == list(per_sm)


@pytest.mark.parametrize(
    "arch, hidden, budgets, min_ctas, per_sm",
    [
        # Shared memory leaves one CTA per SM with one g already: the parts' hint lets go of 128.
        ("sm_100a", 8192, (128, 255, 255), (2, 1, 1), (1, 1, 1)),
        # Two CTAs still fit: the lean budget holds.
        ("sm_90a", 4096, (64, 64, 64), (2, 2, 2), (2, 2, 2)),
    ],
)
def test_parts_registers_follow_the_residency(arch, hidden, budgets, min_ctas, per_sm):
    configs = [backward_config(arch, "bf16", "bf16", hidden, False, parts) for parts in (1, 2, 3)]
    assert [c.register_budget for c in configs] == list(budgets)
    assert [c.min_ctas_per_sm for c in configs] == list(min_ctas)
    assert [c.ctas_per_sm for c in configs] == list(per_sm)


def test_an_overridden_ring_is_cut_for_parts():
    with overridden("bwd", "sm_90a", "bf16", 5120, ring_depth=6):
        depths = [
            backward_config("sm_90a", "bf16", "bf16", 5120, False, parts).ring_depth for parts in (1, 2, 3)
        ]
    assert depths == [6, 4, 3]


@pytest.mark.parametrize("g_parts", [0, 4])
def test_g_comes_in_one_to_three_parts(g_parts):
    with pytest.raises(ValueError, match="g arrives as 1 to 3 parts"):
        backward_config("sm_90a", "bf16", "bf16", 4096, False, g_parts)


def test_a_parts_backward_launches_the_one_g_program_count():
    """bf16 H = 8192 in residual mode: two CTAs per SM with one g, one with g in two parts -- and yet
    the same 264 programs (the row partition fixes dw's bits, which must be those of the rounded sum)."""
    one_g = backward_config("sm_90a", "bf16", "bf16", 8192, True)
    two_parts = backward_config("sm_90a", "bf16", "bf16", 8192, True, 2)
    assert (one_g.ctas_per_sm, two_parts.ctas_per_sm) == (2, 1)
    assert two_parts.tiling == one_g.tiling
    assert launch_plan.backward_programs(10**6, 8192, "bf16", "bf16", True, H200) == 264


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("act", ["bf16", "fp32"])
@pytest.mark.parametrize("hidden", [7, 1024, 4096, 8192, 16384, 131072])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_a_memory_efficient_backward_keeps_the_default_residency(arch, act, hidden, residual):
    """The memory-efficient variant recomputes 1 / s from w's cells and keeps no tile of its own: its
    tiling, ring, shared memory and residency are the default's, so it launches the default's
    programs (at bf16 H = 8192 in residual mode two CTAs per SM too). Only its register budget may
    grow, and only to the share shared memory leaves free."""
    variant = ("bwd", arch, act, act, hidden)
    default = config_for(KernelSpec(*variant, residual=residual))
    mode = config_for(KernelSpec(*variant, residual=residual, memory_efficient=True))
    registers = {"register_budget": default.register_budget, "min_ctas_per_sm": default.min_ctas_per_sm}
    assert replace(mode, **registers) == default
    assert mode.register_budget >= default.register_budget
    assert mode.ctas_per_sm * mode.register_budget * default.tiling.threads_per_cta <= 65536
    if (arch, act, hidden, residual) == ("sm_90a", "bf16", 8192, True):
        assert default.ctas_per_sm == 2


def test_reduce_config_spreads_narrow_rows():
    assert [reduce_config("sm_90a", "fp32", h).col_lanes for h in (1, 1024, 4096, 65536, 262144)] == [
        1,
        1,
        4,
        32,
        32,
    ]
    assert reduce_config("sm_90a", "fp32", 4097).vec == 1


def test_reduce_config_widens_narrow_grids():
    """Rows of at most 64 column vectors (H <= 256, the per-head norms) get 1024-thread CTAs, wider ones
    256 threads; every lane has 8 partial rows in flight."""
    configs = {h: reduce_config("sm_90a", "fp32", h) for h in (1, 7, 64, 256, 257, 260, 1024, 8192)}
    narrow = {1, 7, 64, 256}
    assert {h: (c.threads, c.rows_in_flight) for h, c in configs.items()} == {
        h: (1024, 8) if h in narrow else (256, 8) for h in configs
    }
    with overridden("dw", "sm_90a", "fp32", 64, threads=256, rows_in_flight=1):
        overridden_config = reduce_config("sm_90a", "fp32", 64)
    assert (overridden_config.threads, overridden_config.rows_in_flight) == (256, 1)
