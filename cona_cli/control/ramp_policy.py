"""Megatron-LM's batch-size ramp (`--rampup-batch-size START INCREMENT SAMPLES`, GPT-3's recipe) on cona's
engine: the peer a user would pick instead of cona when a fixed batch is not enough.

The global batch starts at START and grows by INCREMENT every SAMPLES / ((B − START) / INCREMENT)
consumed samples until it reaches B, the strategy's global batch, after SAMPLES samples (Megatron's
RampupBatchsizeNumMicroBatchesCalculator). The layout (dp, tp, pp) stays the strategy's; each batch
runs at the largest micro-batch up to the strategy's that divides it, so the job resizes in place
(pp = 1) or relaunches (pp > 1) at each increment, as any other switch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cona_cli.control.policies import Policy, Stage
from cona_core.config import Config, ConfigError
from cona_core.strategy import Strategy


def ramp_gbs(start: int, increment: int, samples: int, final: int, consumed: int) -> int:
    """The global batch Megatron's ramp runs after `consumed` samples."""
    if consumed >= samples or final <= start:
        return final
    per_increment = samples / ((final - start) // increment)
    return min(final, start + increment * int(consumed / per_increment))


class RampPolicy(Policy):
    name = "ramp"

    def __init__(self, cfg: Config, strategy: Strategy) -> None:
        super().__init__()
        assert cfg.train.rampup_batch_size is not None
        self.start, self.increment, self.samples = cfg.train.rampup_batch_size
        self.final, self.cfg = strategy, cfg
        if self.start > strategy.gbs or (strategy.gbs - self.start) % self.increment:
            raise ConfigError(
                f"train.rampup_batch_size: the ramp {self.start} + k·{self.increment} must reach the strategy's "
                f"global batch {strategy.gbs}"
            )
        for gbs in range(self.start, strategy.gbs + 1, self.increment):
            self.at(gbs)  # every step of the ramp must have a layout, or the config is refused now
        self.in_place = cfg.search.in_place
        self.current = Stage(self.at(self.start), None, "start")

    def at(self, gbs: int) -> Strategy:
        """The strategy's layout at global batch `gbs`: the largest micro-batch up to its own that divides
        gbs / dp."""
        s = self.final
        mbs = next((m for m in range(s.mbs, 0, -1) if gbs % (s.dp * m) == 0), None)
        target = replace(s, mbs=mbs or 1, gbs=gbs)
        problems = self.cfg.problems(target) if mbs else [f"gbs {gbs} is not divisible by dp {s.dp}"]
        if problems:
            raise ConfigError(f"train.rampup_batch_size: no layout for gbs {gbs}: {problems[0]}")
        return target

    def first(self) -> Stage:
        return self.current

    def strategies(self) -> list[Strategy]:
        return [self.at(gbs) for gbs in range(self.start, self.final.gbs + 1, self.increment)]

    def may_switch(self) -> bool:
        return self.current.strategy.gbs < self.final.gbs

    def may_relaunch(self) -> bool:
        return self.may_switch() and not self.in_place  # the ramp keeps the final strategy's mesh

    def expected_next(self) -> Strategy | None:
        return self.at(min(self.current.strategy.gbs + self.increment, self.final.gbs)) if self.may_switch() else None

    def on_metric(self, row: dict[str, Any]) -> Stage | None:
        gbs = ramp_gbs(self.start, self.increment, self.samples, self.final.gbs, int(row["consumed_samples"]))
        if gbs == self.current.strategy.gbs:
            return None
        return Stage(self.at(gbs), None, "ramp")

    def after_launch(self, outcome: dict[str, Any], requested: Stage | None) -> Stage | None:
        if requested is not None:
            self.current = requested
        return requested

    def resized(self, stage: Stage, seconds: float) -> None:
        self.current = stage

    def restart(self, step: int, stage: Stage, trainer: dict[str, Any] | None = None) -> Stage | None:
        if step == 0:  # from the run's start: where the ramp starts (a checkpoint's batch is set by recovery)
            self.current = Stage(self.at(self.start), None, "start")
        return self.current

    def state_dict(self) -> dict[str, Any]:
        return {"current": str(self.current.strategy)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.current = Stage(Strategy.parse(state["current"]), None, "resume")
