"""Whole-model gradient norms under any layout, and the small-batch norms of the GNS estimator.

Every quantity here is this rank's *share*: summed over all ranks (one all-reduce, batched with the
step's other scalars) it covers the whole model exactly once, whatever dp/tp/pp layout holds it
(the clip_grad_norm_ traps under TP and PP avoided). Shares are 0-d float64 tensors on the gradients'
device: reading them is left to the step's one host sync.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.parallelize import ParallelModel, counts_here, in_param_layout, local_tensor


def _sq(tensors: list[torch.Tensor]) -> torch.Tensor | float:
    if not tensors:
        return 0.0
    return torch.stack(torch._foreach_norm(tensors)).double().pow(2).sum()


def _dot(g: torch.Tensor) -> torch.Tensor:
    flat = local_tensor(g).reshape(-1)
    return torch.dot(flat, flat)


def local_grad_sq(pm: ParallelModel) -> torch.Tensor | float:
    """This rank's share of |g|^2 of the (data-parallel reduced) gradient."""
    return _sq(pm.counted_grads(("dp", "tp")))


@torch.no_grad()
def scale_grads(pm: ParallelModel, factor: float) -> None:
    grads = [local_tensor(p.grad) for p in pm.model.parameters() if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


class SmallBatchNorms:
    """Squared gradient norms of the GNS estimator's small batches, measured during the step.

    dp > 1: the small batches are the replicas' batches (gbs/dp samples each); their gradients are
    each replica's local gradient *before* the data-parallel reduction (read in DDP's communication
    hook, or just before our own all-reduce). dp = 1: the small batch is the step's first
    micro-batch (mbs samples), whose gradient is what the first accumulation writes into each
    `.grad` (read in post-accumulate hooks: one dot product per parameter and step). Summed over
    ranks and divided by `n_small`, `local_share()` is the mean |G_small|^2. Hooks only queue 0-d
    tensors, and `local_share()` returns one without reading it.
    """

    def __init__(self, pm: ParallelModel) -> None:
        self.pm = pm
        self._share: torch.Tensor | float = 0.0
        self._pending: list[torch.Tensor] = []
        self._tied_first: list[torch.Tensor] = []  # first micro-batch gradients of tied copies (pp > 1)
        self._hooks: dict[torch.nn.Parameter, torch.utils.hooks.RemovableHandle] = {}
        if isinstance(pm.wrapped, DDP):  # DDP is only built with dp > 1
            pm.wrapped.register_comm_hook(pm.wrapped.process_group, self._ddp_hook)
        self.resize()

    def resize(self) -> None:
        """Follow the strategy's batch sizes (after an in-place resize: the layout is the same)."""
        s = self.pm.strategy
        self.available = s.dp > 1 or s.n_microbatches > 1
        self.b_small = s.gbs // s.dp if s.dp > 1 else s.mbs
        self.n_small = s.dp if s.dp > 1 else 1
        # dp = 1: the first micro-batch's gradient arrives as g_0 / m with pp = 1 (we scale the loss),
        # as g_0 under pipelining (the schedule rescales after the last backward).
        self._first_microbatch = self.available and s.dp == 1
        self._scale = float(s.n_microbatches) ** 2 if self._first_microbatch and s.pp == 1 else 1.0

    def begin_step(self) -> None:
        self._share = 0.0
        self._pending.clear()
        self._tied_first.clear()
        if self._first_microbatch:  # each hook removes itself after the first micro-batch
            for p in self.pm.model.parameters():
                self._hooks[p] = p.register_post_accumulate_grad_hook(self._first_microbatch_hook)

    def before_dp_reduce(self) -> None:
        """The step's backward passes are done and our own dp all-reduce (if any) is about to run: read the
        local replica gradients first; sum the tied copies' first micro-batch gradients over the end stages."""
        if self._tied_first:
            self.pm.sum_tied(self._tied_first)
            if self.pm.is_first:
                self._pending += [_dot(g) for g in self._tied_first if counts_here(g, self.pm.coord, ("tp",))]
        if self.pm.dp_group is not None:
            self._share = self._share + _sq(self.pm.counted_grads(("tp",)))

    def local_share(self) -> torch.Tensor | float:
        if self._pending:
            self._share = self._share + torch.stack(self._pending).double().sum() * self._scale
            self._pending.clear()
        return self._share

    def _ddp_hook(self, state, bucket):
        # Unannotated on purpose: DDP checks the annotations' objects, and postponed annotations
        # make them strings it rejects. (state: the process group; returns allreduce's future.)
        # Pure data parallelism (tp = pp = 1): every local gradient is the whole replica's.
        flat = bucket.buffer()
        self._pending.append(torch.dot(flat, flat))
        return allreduce_hook(state, bucket)

    @torch.no_grad()
    def _first_microbatch_hook(self, p: torch.nn.Parameter) -> None:
        self._hooks.pop(p).remove()
        if any(p is t for t in self.pm.tied):  # one end stage's part of the gradient: summed later
            self._tied_first.append(in_param_layout(p, p.grad).clone())
        elif counts_here(p.grad, self.pm.coord, ("tp",)):
            self._pending.append(_dot(p.grad))
