"""Learning rate as a pure function of tokens consumed and the current global batch.

Warmup and decay are defined in tokens, so the schedule stays consistent when gbs changes; the
batch-size scaling rule multiplies the peak rate relative to `lr_base_gbs`.
"""

from __future__ import annotations

import math

from cona_cli.config import TrainConfig


def batch_scale(rule: str, gbs: int, base_gbs: int, gns: float | None = None) -> float:
    """Peak-LR multiplier for running at `gbs` when the config's lr was tuned at `base_gbs`.

    adascale: the AdaScale gain (GNS/b_base + 1) / (GNS/b_new + 1), which tends to linear scaling
    when gradient noise dominates and to 1 when it does not; without a GNS estimate it is 1.
    """
    ratio = gbs / base_gbs
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "adascale" and gns is not None and gns > 0:
        return (gns / base_gbs + 1) / (gns / gbs + 1)
    return 1.0


def schedule_factor(t: TrainConfig, tokens: int) -> float:
    """Warmup (linear from 0) then constant, cosine or linear decay to min_lr_ratio over decay_tokens."""
    if t.warmup_tokens and tokens < t.warmup_tokens:
        return (tokens + 1) / t.warmup_tokens
    if t.schedule == "constant" or not t.decay_tokens:
        return 1.0
    progress = min(1.0, (tokens - t.warmup_tokens) / t.decay_tokens)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape


def learning_rate(t: TrainConfig, tokens: int, gbs: int, gns: float | None = None) -> float:
    base = t.lr_base_gbs or gbs
    return t.lr * batch_scale(t.lr_scaling, gbs, base, gns) * schedule_factor(t, tokens)
