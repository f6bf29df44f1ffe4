"""Training samples by global sample index, and the fixed evaluation slice (see `launch.data`)."""

from __future__ import annotations

import numpy as np
import torch

from launch.data.sources import DataError
from launch.models.spec import IGNORE_INDEX, Batch, BatchFn, next_token_batch


class TokenStream:
    """One split, memory-mapped: seq_len + 1 token windows addressed by global sample index."""

    def __init__(self, path: str, seq_len: int, seed: int, batch: BatchFn = next_token_batch) -> None:
        self.path = path
        self.batch = batch  # the model family's (windows, sample ids) -> (inputs, targets)
        self.seq_len = seq_len
        self.seed = seed
        self.tokens = np.load(path, mmap_mode="r")
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"{path}: {len(self.tokens)} tokens, too few for one window of {seq_len + 1}")
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Windows per epoch."""
        return self.n

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n)
        return self._perms[epoch]

    def windows(self, ks: np.ndarray, ids: np.ndarray | None = None) -> Batch:
        """Windows `ks` (positions in the unpermuted split) as the family's inputs and targets, e.g.
        LongTensor [len(ks), seq_len] each; `ids` are the samples' global indices (default `ks`)."""
        ks = np.asarray(ks, dtype=np.int64)
        offsets = ks[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        w = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return self.batch(w, torch.from_numpy(ks if ids is None else ids))

    def samples(self, start: int, count: int) -> Batch:
        """Global sample indices [start, start + count): inputs [count, seq_len], targets shifted by one."""
        idx = np.arange(start, start + count, dtype=np.int64)
        epochs, js = np.divmod(idx, self.n)
        ks = np.empty_like(idx)
        for e in np.unique(epochs):
            sel = epochs == e
            ks[sel] = self._perm(int(e))[js[sel]]
        return self.windows(ks, idx)


def _split(batch: Batch, mbs: int) -> list[Batch]:
    return list(zip(batch[0].split(mbs), batch[1].split(mbs)))


def replica_microbatches(stream: TokenStream, consumed: int, gbs: int, dp: int, dp_rank: int, mbs: int) -> list[Batch]:
    """Replica `dp_rank`'s micro-batches of the step whose global batch is samples [consumed, consumed + gbs):
    the contiguous slice [consumed + r*gbs/dp, consumed + (r+1)*gbs/dp) in gbs/(dp*mbs) micro-batches of mbs."""
    if gbs % (dp * mbs):
        raise ValueError(f"gbs {gbs} is not a multiple of dp*mbs = {dp * mbs}")
    per = gbs // dp
    return _split(stream.samples(consumed + dp_rank * per, per), mbs)


def eval_batches(
    path: str,
    seq_len: int,
    eval_tokens: int,
    gbs: int,
    dp: int,
    dp_rank: int,
    mbs: int,
    batch: BatchFn = next_token_batch,
) -> list[list[Batch]]:
    """The fixed validation slice (the first max(1, eval_tokens // seq_len) windows, the same under every
    layout) cut into steps of gbs samples; each step is replica `dp_rank`'s micro-batches of mbs, like a
    training step. The last step is padded: inputs with token 0, targets with IGNORE_INDEX (no loss)."""
    stream = TokenStream(path, seq_len, seed=0, batch=batch)
    n = max(1, eval_tokens // seq_len)
    if len(stream) < n:
        raise DataError(f"{path}: {len(stream)} windows of {seq_len + 1} tokens, eval_tokens needs {n}")
    x, y = stream.windows(np.arange(n))
    pad = -n % gbs
    if pad:
        x = torch.cat([x, torch.zeros(pad, seq_len, dtype=x.dtype)])
        y = torch.cat([y, torch.full((pad, seq_len), IGNORE_INDEX, dtype=y.dtype)])
    per = gbs // dp
    steps = []
    for start in range(0, n + pad, gbs):
        lo = start + dp_rank * per
        steps.append(_split((x[lo : lo + per], y[lo : lo + per]), mbs))
    return steps
