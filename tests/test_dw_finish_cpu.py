"""The dW finish without a GPU: the fixed summation order of ``dw_reduce.ColumnSum`` (as its teams split
it) against the torch reimplementation of ``dw_reduce``'s order."""

from __future__ import annotations

import pytest
import torch

from cake_cute.kernels.config import reduce_config

from ._helpers import bits, fixed_order_dw


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
@pytest.mark.parametrize("count", [1, 2, 5, 129, 264, 1056])
def test_column_sums_follow_dw_reduces_order(hidden, count):
    """The reduction's teams of R threads split a column's sum over their lanes, shuffles and warps;
    the result is bitwise the fixed order of R lane sums and their tree."""
    from cake_cute.kernels.dw_reduce import ColumnSum

    config = reduce_config("sm_90a", "fp32", hidden)
    team = config.row_lanes
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
