"""The next step's batch, built while this step runs.

Sampling a step's windows (and BERT's masking) is host work. On a GPU it would run while the device
idles between steps; here it runs on a background thread during the previous step, into pinned memory,
so that the copy to the device is asynchronous. A step whose batch was not the one foreseen (the first,
one after a resize or a restore) builds it at once. On CPU ranks there is nothing to overlap with (the
host is the device): batches are built when they are needed.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from launch.data.sampling import TokenStream, replica_microbatches
from launch.models.spec import Batch


def to_device(micro: list[Batch], device: torch.device) -> list[Batch]:
    """Micro-batches on `device`, copied asynchronously (from pinned memory on CUDA)."""
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in micro]


class BatchKey(NamedTuple):
    """What decides a replica's micro-batches of one step."""

    consumed: int
    gbs: int
    dp: int
    dp_rank: int
    mbs: int

    def following(self) -> BatchKey:
        """The next step's, if the batch sizes stay."""
        return self._replace(consumed=self.consumed + self.gbs)


class Prefetcher:
    """A replica's micro-batches by step, each next one built ahead (`background`: on a thread)."""

    def __init__(self, stream: TokenStream, device: torch.device, background: bool | None = None) -> None:
        self.stream, self.device = stream, device
        self.pin = device.type == "cuda"
        background = self.pin if background is None else background
        self._pool = None
        if background:  # a CUDA thread starts on device 0: pinning there would open a context on it
            init = (torch.cuda.set_device, (device,)) if self.pin else (None, ())
            self._pool = ThreadPoolExecutor(1, "cona-prefetch", *init)
        self._ahead: tuple[BatchKey, Future[list[Batch]]] | None = None
        self.hits = 0  # steps whose batch had been built ahead

    def _build(self, key: BatchKey) -> list[Batch]:
        micro = replica_microbatches(self.stream, *key)
        if self.pin:
            micro = [(x.pin_memory(), y.pin_memory()) for x, y in micro]
        return micro

    def take(self, key: BatchKey) -> list[Batch]:
        """The step's micro-batches on the device; starts building the next step's."""
        micro = None
        if self._ahead is not None:
            ahead, future = self._ahead
            built = future.result()  # also when unused: one builder at a time on the stream
            if ahead == key:
                micro, self.hits = built, self.hits + 1
        if micro is None:
            micro = self._build(key)
        self._ahead = None
        if self._pool is not None:
            self._ahead = (key.following(), self._pool.submit(self._build, key.following()))
        return to_device(micro, self.device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
