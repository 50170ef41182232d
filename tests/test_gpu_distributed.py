"""DTensor calls on the GPU in one process (a one-rank NCCL group): the CUDA custom ops under the
sharding rules, bitwise equal to the plain eager path, placements as on CPU, no collective; and the
compiled path with a sequence-sharded input. The two-GPU matrix is ``tests/distributed_harness/matrix.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import cake_cute
from cake_cute import cake_rmsnorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and cake_cute.is_cake_rmsnorm_train_supported("cuda")),
        reason="needs an NVIDIA Hopper or Blackwell GPU",
    ),
]

EPS = 1e-6


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _run(fn, x, w, r, g, g_h):
    """Outputs and gradients of ``fn(x, w, r)`` for fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, r)]
    out = fn(*leaves)
    torch.autograd.backward(out, [g, g_h])
    return [*out, *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dtensor_matches_the_plain_path_bitwise(mesh, placement, compiled):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, r, g, g_h = (torch.randn(2, 48, 1024, device="cuda", generator=gen).bfloat16() for _ in range(4))
    w = torch.rand(1024, device="cuda", generator=gen).bfloat16() + 0.5
    expected = _run(lambda x, w, r: cake_rmsnorm(x, w, EPS, r), x, w, r, g, g_h)

    def norm(x, w, r):
        return cake_rmsnorm(x, w, EPS, r)

    fn = torch.compile(norm, fullgraph=True) if compiled else norm
    xd, rd = (distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, r))
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    grads = [distribute_tensor(t, mesh, [placement]) for t in (g, g_h)]
    # CommDebugMode is a dispatch mode, which torch.compile does not trace under: eager only.
    comm = CommDebugMode()
    with comm if not compiled else contextlib.nullcontext():
        out = fn(xd, wd, rd)
        torch.autograd.backward(out, grads)
    assert comm.get_total_counts() == 0
    assert all(o.placements == (placement,) for o in (*out, xd.grad, rd.grad))
    assert wd.grad.placements == ((Replicate(),) if placement == Replicate() else (Partial(),))
    got = [t.full_tensor() for t in (*out, xd.grad, wd.grad, rd.grad)]
    for name, a, e in zip(("y", "h_new", "dx", "dw", "dresidual"), got, expected):
        assert torch.equal(a, e), name


def test_dw_is_partial_for_a_sequence_shard(mesh):
    x = torch.randn(2, 8, 256, device="cuda", dtype=torch.bfloat16)
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    wd = distribute_tensor(torch.ones(256, device="cuda", dtype=torch.bfloat16), mesh, [Replicate()])
    wd.requires_grad_()
    cake_rmsnorm(xd, wd, EPS).sum().backward()
    assert wd.grad.placements == (Partial(),)
