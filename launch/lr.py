"""Learning rate and the progress clock that the schedule follows: pure functions of the run's state.

`train.lr_scaling` picks the recipe; `lr_base_gbs` (b₀) is the batch the config's `lr` was tuned at.
- adascale (the default): AdaScale's gain ratio in Adam's form. With G the noise scale of the
  Adam-preconditioned gradients, one step at batch b is worth r = (b/b₀)(b₀ + G)/(b + G) steps at b₀
  (Johnson et al. 2020; `cona_core.efficiency.gain`). The LR is lr·r^½ (the square-root form for Adam,
  as AdaptDL's AdamScale), and the decay runs on the progress clock, Σ r·b₀ tokens, instead of raw
  tokens. The loss then follows progress whatever sequence of batches produced it, and progress per
  second is (b/T)(b₀ + G)/(b + G)/b₀, proportional to Φ = (b/T)/(b + G): the quantity the cona policy
  ranks strategies by is the one the training follows. Until G is measured, r = 1.
- sqrt, linear, none: the peak LR times √(b/b₀), b/b₀ or 1; the decay follows raw tokens.

Warmup, under every recipe, counts the raw tokens consumed (`train.warmup_tokens` as Megatron's
`--lr-warmup-samples`): a run at a larger batch warms up in fewer steps. The decay starts where the
progress clock passes warmup_tokens, so under adascale the peak LR holds in between.
"""

from __future__ import annotations

import math

from cona_core.config import TrainConfig
from cona_core.efficiency import gain


def batch_scale(rule: str, gbs: int, base_gbs: int, gns: float | None = None) -> float:
    """Peak-LR multiplier for running at `gbs` when the config's lr was tuned at `base_gbs`."""
    if rule == "adascale":
        return math.sqrt(gain(gbs, base_gbs, gns))
    if rule == "linear":
        return gbs / base_gbs
    if rule == "sqrt":
        return math.sqrt(gbs / base_gbs)
    return 1.0


def progress_tokens(rule: str, gbs: int, base_gbs: int, gns: float | None, seq_len: int) -> float:
    """How far one step moves the schedule's clock, in tokens: r·b₀ sequences under adascale, else gbs."""
    if rule == "adascale":
        return gain(gbs, base_gbs, gns) * base_gbs * seq_len
    return float(gbs * seq_len)


def schedule_factor(t: TrainConfig, progress: float, tokens: float) -> float:
    """Warmup (linear from 0) over the raw `tokens` consumed, then constant, cosine or linear decay to
    min_lr_ratio over decay_tokens of the progress clock (raw tokens unless the recipe is adascale)."""
    if t.warmup_tokens and tokens < t.warmup_tokens:
        return (tokens + 1) / t.warmup_tokens
    if t.schedule == "constant" or not t.decay_tokens:
        return 1.0
    done = min(1.0, max(0.0, progress - t.warmup_tokens) / t.decay_tokens)
    shape = 0.5 * (1 + math.cos(math.pi * done)) if t.schedule == "cosine" else 1 - done
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape


def learning_rate(t: TrainConfig, progress: float, tokens: float, gbs: int, gns: float | None = None) -> float:
    """The LR of a step at `gbs` after `tokens` raw tokens and `progress` on the schedule's clock."""
    base = t.lr_base_gbs or gbs
    return t.lr * batch_scale(t.lr_scaling, gbs, base, gns) * schedule_factor(t, progress, tokens)
