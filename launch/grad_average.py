"""The data-parallel gradient average where DDP does not wrap the model (tp or pp > 1), overlapped
with the backward passes.

Each parameter's post-accumulate-grad hook counts the step's backward passes through it; after its
last one the gradient is final, and a bucket (`cona_core.buckets`) whose gradients are all final is
all-reduced over the dp group at once, while backward goes on through the earlier layers (DDP's
overlap). Buckets hold parameters in reverse definition order, the order backward finalises them,
and are launched in index order so that every rank issues the same collectives in the same order.
At most `IN_FLIGHT` are in flight; `finish()` launches what never became final (unused parameters,
the tied copies, which the pipeline sums over its end stages first) and waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from cona_core.buckets import BUCKET_BYTES, IN_FLIGHT, buckets
from launch.dtensor_pieces import local_tensor

BeforeReduce = Callable[[list[nn.Parameter]], None]


class GradAverager:
    """Average the local (TP-sharded) gradients of `params` over `group` (dp ranks) during backward.

    `divide`: what the reduced sums are divided by (dp, times the micro-batch count where the
    pipeline schedule leaves the gradients as sums). `before_reduce`, if set, is called with each
    bucket's parameters just before their all-reduce is launched (the noise scale reads the replica's
    own gradients there)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        deferred: tuple[nn.Parameter, ...] = (),
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.group = group
        later = {id(p) for p in deferred}
        self.params = [p for p in reversed(params) if p.requires_grad and id(p) not in later]
        self.deferred = [p for p in params if id(p) in later]
        sizes = [local_tensor(p).numel() * local_tensor(p).element_size() for p in self.params]
        self.buckets = [[self.params[i] for i in group_] for group_ in buckets(sizes, bucket_bytes)]
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.before_reduce: BeforeReduce | None = None
        self._armed = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def arm(self, backwards: int, divide: int) -> None:
        """Before a step's backward passes: each parameter's gradient is final after `backwards` of them."""
        self._expect, self._divide = backwards, divide
        self._count: dict[int, int] = {}
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._in_flight: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
        self._armed = True

    @property
    def launched(self) -> int:
        """Buckets of this step whose all-reduce has started (the deferred one not counted)."""
        return self._next if self._armed else 0

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's backward passes: launch what is left, wait for every bucket, unpack."""
        if not self._armed:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        if self.deferred:
            self._launch(self.deferred)
        for pending in self._in_flight:
            self._unpack(*pending)
        self._in_flight.clear()
        self._armed = False

    @torch.no_grad()
    def _accumulated(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        n = self._count[id(p)] = self._count.get(id(p), 0) + 1
        if n != self._expect:
            return
        self._missing[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, params: list[nn.Parameter]) -> None:
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        if self.before_reduce is not None:
            self.before_reduce(params)
        if len(self._in_flight) == IN_FLIGHT:  # before this bucket's copy is allocated
            self._unpack(*self._in_flight.pop(0))
        grads = [local_tensor(p.grad) for p in params]
        if len(grads) == 1 and grads[0].is_contiguous():
            flat = grads[0].view(-1)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
        self._in_flight.append((grads, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def _unpack(self, grads: list[torch.Tensor], flat: torch.Tensor, work: dist.Work) -> None:
        """Wait for one bucket's all-reduce and put the averages back into its gradients."""
        work.wait()
        flat /= self._divide
        if len(grads) == 1 and flat.data_ptr() == grads[0].data_ptr():
            return
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
