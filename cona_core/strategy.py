"""A parallelism strategy (dp, tp, pp, mbs, gbs): parsing, formatting and divisibility rules."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_STRATEGY_RE = re.compile(r"^dp(\d+)-tp(\d+)-pp(\d+)-mbs(\d+)-gbs(\d+)$")
FIELDS = ("dp", "tp", "pp", "mbs", "gbs")


class StrategyError(ValueError):
    """A strategy string or mapping that cannot be parsed."""


@dataclass(frozen=True, order=True)
class Strategy:
    """Data, tensor and pipeline parallel degrees, micro-batch and global batch (in sequences)."""

    dp: int
    tp: int
    pp: int
    mbs: int
    gbs: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per replica per step: pipeline micro-batches, or accumulation steps when pp = 1."""
        return self.gbs // (self.dp * self.mbs)

    @property
    def replica_batch(self) -> int:
        """Sequences each data-parallel replica sees per step (B_small of the GNS estimator)."""
        return self.gbs // self.dp

    def __str__(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}-mbs{self.mbs}-gbs{self.gbs}"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Parse `dp2-tp1-pp2-mbs2-gbs16`."""
        m = _STRATEGY_RE.match(text.strip())
        if not m:
            raise StrategyError(f"strategy {text!r}: expected the form dp2-tp1-pp2-mbs2-gbs16")
        values = [int(v) for v in m.groups()]
        for name, value in zip(FIELDS, values):
            if value < 1:
                raise StrategyError(f"strategy {text!r}: {name} must be >= 1")
        return cls(*values)

    @classmethod
    def from_mapping(cls, data: dict, where: str = "strategy") -> Strategy:
        missing = [f for f in FIELDS if f not in data]
        if missing:
            raise StrategyError(f"{where}: missing {', '.join(missing)}")
        values = {}
        for f in FIELDS:
            v = data[f]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise StrategyError(f"{where}.{f}: must be an integer >= 1")
            values[f] = v
        return cls(**values)


def resizable(current: Strategy, target: Strategy) -> bool:
    """Whether a running job can move from `current` to `target` in place, without a relaunch: the same
    mesh (dp, tp, pp) with another micro- and/or global batch, and no pipeline (its schedule and stage
    buffers are built for one micro-batch shape and count)."""
    same_mesh = (current.dp, current.tp, current.pp) == (target.dp, target.tp, target.pp)
    return same_mesh and current.pp == 1 and current != target


def divisibility_problems(s: Strategy, world: int, n_layers: int, n_heads: int, n_kv_heads: int) -> list[str]:
    """Reasons why `s` cannot run on `world` ranks for this model shape (empty when it can)."""
    problems = []
    if s.world != world:
        problems.append(f"dp*tp*pp = {s.world} != world size {world}")
    if n_heads % s.tp:
        problems.append(f"n_heads {n_heads} not divisible by tp {s.tp}")
    elif n_kv_heads % s.tp:
        problems.append(f"n_kv_heads {n_kv_heads} not divisible by tp {s.tp}")
    if n_layers % s.pp:
        problems.append(f"n_layers {n_layers} not divisible by pp {s.pp}")
    if s.gbs % (s.dp * s.mbs):
        problems.append(f"gbs {s.gbs} not divisible by dp*mbs = {s.dp * s.mbs}")
    elif s.pp > 1 and s.n_microbatches < s.pp:
        problems.append(f"{s.n_microbatches} micro-batches < pp {s.pp} (pipeline schedules need at least pp)")
    return problems
