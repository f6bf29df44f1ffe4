"""Whole-model gradient norms under any layout (the clip_grad_norm_ traps of TP and PP avoided)."""

from __future__ import annotations

import torch

from launch.parallelize import ParallelModel, _local


def local_grad_sq(pm: ParallelModel) -> torch.Tensor:
    """This rank's share of |g|^2: the squares of the gradient shards it is the counting rank for.

    Summed over all ranks (one all-reduce, batched with the step's other scalars) it gives the
    squared norm of the whole model's gradient exactly once, whatever dp/tp/pp/FSDP layout holds it.
    """
    grads = [_local(p.grad) for p, count in zip(pm.model.parameters(), pm.count_grad)
             if count and p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(grads)
    return torch.stack(norms).double().pow(2).sum()


@torch.no_grad()
def scale_grads(pm: ParallelModel, factor: float) -> None:
    grads = [_local(p.grad) for p in pm.model.parameters() if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)
