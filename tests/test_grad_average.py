"""The dp average under TP or PP: buckets all-reduce during backward, once their gradients are final."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launch.grad_average import GradAverager


@pytest.fixture
def one_process(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_buckets_launch_in_backward_order_after_the_last_pass_and_finish_divides(one_process: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    unused = nn.Parameter(torch.ones(3))
    tied = model[0].bias
    reference = copy.deepcopy(model)
    params = [unused, *model.parameters()]  # defined first, so last in backward order
    avg = GradAverager(params, dist.group.WORLD, deferred=(tied,), bucket_bytes=1)  # one tensor a bucket
    seen: list[list[nn.Parameter]] = []
    avg.before_reduce = seen.append
    assert [b[0] for b in avg.buckets] == [p for p in reversed(params) if p is not tied]

    x = torch.randn(6, 4)
    avg.arm(backwards=2, divide=4)
    model(x[:3]).sum().backward()
    assert avg.launched == 0 and not seen  # no gradient is final after the first of two passes
    model(x[3:]).sum().backward()
    # every bucket up to the unused parameter's (last in backward order, it never becomes final)
    assert avg.launched == len(avg.buckets) - 1 == 5
    assert [ps[0] for ps in seen] == [p for p in reversed(params[1:]) if p is not tied]
    avg.finish()
    assert seen[-1] == [tied]  # the deferred copy goes last, in finish()
    assert unused.grad is None and avg.launched == 0
    reference(x[:3]).sum().backward()
    reference(x[3:]).sum().backward()
    for p, ref in zip(model.parameters(), reference.parameters()):  # world 1: the sum, divided as asked
        torch.testing.assert_close(p.grad, ref.grad / 4)

    model.zero_grad()
    model(x).sum().backward()  # not armed (e.g. outside a step): the hooks do nothing
    assert avg.launched == 0 and len(seen) == 6
