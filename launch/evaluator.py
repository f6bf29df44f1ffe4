"""The validation loss of a launch: a fixed slice of the validation split, the same under every layout,
cut into steps like the training batch of the running strategy; and when an evaluation is due.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from cona_core.config import TrainConfig
from cona_core.strategy import Strategy
from launch.data.prefetch import to_device
from launch.data.sampling import eval_batches
from launch.models.spec import IGNORE_INDEX, Batch, BatchFn
from launch.parallelize import ParallelModel
from launch.step_control import sum_over_ranks


class Evaluator:
    def __init__(
        self,
        pm: ParallelModel,
        strategy: Strategy,
        train: TrainConfig,
        valid_path: str,
        seq_len: int,
        batch: BatchFn,
        target_fraction: float,
        dp_rank: int,
        counts_loss: bool,
        device: torch.device,
    ) -> None:
        """`batch`: the family's (windows, sample ids) -> (inputs, targets); `target_fraction`: the share of
        positions that are targets (the loss divides by it); `counts_loss`: this rank's loss is the one its
        replica counts."""
        self.pm, self.strategy, self.train = pm, strategy, train
        self.valid_path, self.seq_len, self.batch = valid_path, seq_len, batch
        self.target_fraction, self.dp_rank, self.counts_loss, self.device = (
            target_fraction,
            dp_rank,
            counts_loss,
            device,
        )

    def due(self, step: int, since_eval_s: float) -> bool:
        """Whether an evaluation follows step `step + 1`, `since_eval_s` seconds after the last one."""
        t = self.train
        by_steps = t.eval_interval is not None and (step + 1) % t.eval_interval == 0
        by_time = t.eval_interval_s is not None and since_eval_s >= t.eval_interval_s
        return by_steps or by_time

    def evaluate(self) -> tuple[float, float]:
        """Mean loss per target over the slice and its perplexity, identical under every layout (padded to
        whole batches): the exact loss sum over the exact number of targets (masked LM: the masked tokens)."""
        self.pm.model.eval()
        loss_sum: torch.Tensor | float = 0.0
        n_targets: torch.Tensor | float = 0.0
        scale = self.strategy.mbs * self.seq_len * self.target_fraction  # what loss_fn divides the sum by
        for micro in self.eval_set:
            loss_sum = loss_sum + self.pm.evaluate(micro) * scale
            n_targets = n_targets + sum((y != IGNORE_INDEX).sum() for _, y in micro)
        self.pm.model.train()
        mine = [loss_sum, n_targets] if self.counts_loss else [0.0, 0.0]
        total, n = sum_over_ranks(mine, self.device).tolist()
        val_loss = total / max(n, 1.0)
        return val_loss, math.exp(min(val_loss, 50.0))

    def seconds(self) -> float:
        """Seconds of one evaluation under the running strategy (its batches built first)."""
        if not self.eval_set:  # (builds the batches first: the timing is of the evaluation alone)
            return 0.0
        t0 = time.perf_counter()
        self.evaluate()
        return time.perf_counter() - t0

    def resize(self, strategy: Strategy) -> None:
        """Evaluate under `strategy` from now on (its batches built when next needed)."""
        self.strategy = strategy
        self.__dict__.pop("eval_set", None)

    @functools.cached_property
    def eval_set(self) -> list[list[Batch]]:
        """This replica's share of the fixed validation slice, built once per strategy."""
        s = self.strategy
        steps = eval_batches(
            self.valid_path, self.seq_len, self.train.eval_tokens, s.gbs, s.dp, self.dp_rank, s.mbs, self.batch
        )
        return [to_device(micro, self.device) for micro in steps]
