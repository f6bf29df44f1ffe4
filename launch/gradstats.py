"""Whole-model gradient norms under any layout, and the small-batch norms of the GNS estimator.

Every quantity here is this rank's *share*: summed over all ranks (one all-reduce, batched with the
step's other scalars) it covers the whole model exactly once, whatever dp/tp/pp layout holds it
(the clip_grad_norm_ traps under TP and PP avoided).
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.parallelize import ParallelModel, _local, counts_here


def _sq(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.stack(torch._foreach_norm(tensors)).double().pow(2).sum())


def local_grad_sq(pm: ParallelModel) -> float:
    """This rank's share of |g|^2 of the (data-parallel reduced) gradient."""
    return _sq(pm.counted_grads(("dp", "tp")))


@torch.no_grad()
def scale_grads(pm: ParallelModel, factor: float) -> None:
    grads = [_local(p.grad) for p in pm.model.parameters() if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


class SmallBatchNorms:
    """Squared gradient norms of the GNS estimator's small batches, measured during the step.

    dp > 1: the small batch is one replica's batch (gbs/dp samples); its gradient is each replica's
    local gradient *before* the data-parallel reduction (read in DDP's communication hook, or just
    before our own all-reduce). dp = 1: the small batches are the step's micro-batches (mbs
    samples); their gradients are the increments of the accumulated gradient, read in
    post-accumulate hooks. `local_share()` is this rank's share of the sum over small batches;
    summed over ranks and divided by `n_small` it is the mean |G_small|^2.
    """

    def __init__(self, pm: ParallelModel) -> None:
        s = pm.strategy
        self.pm = pm
        self.available = s.dp > 1 or s.n_microbatches > 1
        self.b_small = s.gbs // s.dp if s.dp > 1 else s.mbs
        self.n_small = s.dp if s.dp > 1 else s.n_microbatches
        self._share = 0.0
        self._increments: list[torch.Tensor] = []  # 0-d tensors: no host sync inside the hooks
        self._prev: dict[torch.nn.Parameter, torch.Tensor] = {}  # accumulated gradient so far
        if not self.available:
            return
        if isinstance(pm.wrapped, DDP):
            pm.wrapped.register_comm_hook(pm.wrapped.process_group, self._ddp_hook)
        elif s.dp == 1:
            # Accumulated micro-batch gradients are g_i / m with pp = 1 (we scale the loss), g_i with
            # pipelining (the schedule rescales after the last backward).
            self._inc_scale = float(s.n_microbatches) if s.pp == 1 else 1.0
            for p in pm.model.parameters():
                p.register_post_accumulate_grad_hook(self._accumulate_hook)

    def begin_step(self) -> None:
        self._share = 0.0
        self._increments.clear()
        for buf in self._prev.values():
            buf.zero_()

    def before_dp_reduce(self) -> None:
        """Our own dp all-reduce is about to run: read the local replica gradients first."""
        if self.pm.dp_group is not None:
            self._share += _sq(self.pm.counted_grads(("tp",)))

    def local_share(self) -> float:
        if self._increments:
            self._share += float(torch.stack(self._increments).sum()) * self._inc_scale ** 2
            self._increments.clear()
        return self._share

    def _ddp_hook(self, state, bucket):  # noqa: ANN001, ANN201
        # Unannotated on purpose: DDP checks the annotations' objects, and postponed annotations
        # make them strings it rejects. (state: the process group; returns allreduce's future.)
        # Pure data parallelism (tp = pp = 1): every local gradient is the whole replica's.
        self._share += float(bucket.buffer().double().pow(2).sum())
        return allreduce_hook(state, bucket)

    @torch.no_grad()
    def _accumulate_hook(self, p: torch.nn.Parameter) -> None:
        if not counts_here(p.grad, self.pm.coord, ("tp",)):
            return
        g = _local(p.grad)
        prev = self._prev.get(p)
        if prev is None:
            prev = self._prev[p] = torch.zeros_like(g)
        prev.sub_(g)  # = -(this micro-batch's gradient increment), in place
        flat = prev.view(-1)
        self._increments.append(torch.dot(flat, flat))
        prev.copy_(g)
