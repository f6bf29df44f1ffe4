"""The strategy space: candidates (dp, tp, pp, mbs, gbs), feasibility with reasons, memory per device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cona_cli.planner.costmodel import as_array
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.memory import memory_bytes, startup_bytes, training_budget
from cona_cli.planner.workload import Workload
from cona_core.config import Config
from cona_core.strategy import Strategy, divisibility_problems


@dataclass(frozen=True)
class Space:
    """Feasible strategies (with their estimated peak memory) and the rejected ones with reasons."""

    feasible: list[Strategy]
    memory_gib: np.ndarray
    rejected: list[tuple[Strategy, str]]

    def without(self, strategies: set[Strategy], reason: str) -> Space:
        """This space with `strategies` moved to the rejected ones, for `reason`."""
        keep = [i for i, s in enumerate(self.feasible) if s not in strategies]
        dropped = [(s, reason) for s in self.feasible if s in strategies]
        return Space([self.feasible[i] for i in keep], self.memory_gib[keep], self.rejected + dropped)

    def at_gbs(self, gbs: int) -> Space:
        keep = [i for i, s in enumerate(self.feasible) if s.gbs == gbs]
        return Space(
            [self.feasible[i] for i in keep], self.memory_gib[keep], [(s, r) for s, r in self.rejected if s.gbs == gbs]
        )


def gbs_ladder(cfg: Config) -> list[int]:
    """The global batch rungs: `search.gbs_ladder`, else powers of two from gbs_min to gbs_max.

    gbs_min defaults to gbs_static or the world size, gbs_max to 16 x gbs_min.
    """
    s = cfg.search
    if s.gbs_ladder:
        return sorted(set(s.gbs_ladder))
    lo = s.gbs_min or s.gbs_static or cfg.cluster.world
    hi = s.gbs_max or lo * 16
    ladder = [lo]
    while ladder[-1] * 2 <= hi:
        ladder.append(ladder[-1] * 2)
    return ladder


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_space(cfg: Config, hw: HardwareProfile, ladder: list[int] | None = None) -> Space:
    """Every (dp, tp, pp) with dp*tp*pp = world, each allowed mbs and each rung; feasibility checked.

    Rules: divisibility (`divisibility_problems`), search.max_tp, tp inside a node when
    search.tp_within_node, and peak memory <= (1 - memory_margin) * device memory.
    """
    w = Workload.from_config(cfg)
    world, ppn = cfg.cluster.world, cfg.cluster.procs_per_node
    ladder = ladder or gbs_ladder(cfg)
    mbs_list = cfg.search.mbs or [2**k for k in range(max(ladder).bit_length())]
    limits = []
    if cfg.search.max_tp:
        limits.append((lambda s: s.tp > cfg.search.max_tp, f"tp > search.max_tp {cfg.search.max_tp}"))
    if cfg.model.dropout > 0:  # TP ranks would share dropout masks (launch.parallelize refuses it)
        limits.append((lambda s: s.tp > 1, f"tp > 1 with model.dropout {cfg.model.dropout:g}"))
    if cfg.search.tp_within_node:
        limits.append((lambda s: s.tp > ppn, f"tp spans nodes (> procs_per_node {ppn})"))
    candidates, rejected = [], []
    for gbs in ladder:
        for pp in _divisors(world):
            for tp in _divisors(world // pp):
                for mbs in mbs_list:
                    s = Strategy(world // (tp * pp), tp, pp, mbs, gbs)
                    problems = divisibility_problems(s, world, w.shape.n_layers, w.shape.n_heads, w.shape.kv_heads)
                    problems += [reason for broken, reason in limits if broken(s)]
                    if problems:
                        rejected.append((s, "; ".join(problems)))
                    else:
                        candidates.append(s)
    x = as_array(candidates)
    reserved = hw.reserved_gib * 2**30
    need = memory_bytes(x, w, hw, training_budget(hw, ppn, cfg.search.memory_margin)) + reserved
    start = startup_bytes(x, w) + reserved
    budget = (1 - cfg.search.memory_margin) * hw.device_memory_bytes(ppn)
    fits = (need <= budget) & (start <= budget)
    feasible = [s for s, ok in zip(candidates, fits) if ok]
    margin = f"{budget / 2**30:.1f} GiB available ({cfg.search.memory_margin:.0%} margin)"
    rejected += [
        (s, f"memory {n / 2**30:.1f} GiB > {margin}")
        if n > budget
        else (s, f"memory {b / 2**30:.1f} GiB > {margin} while it starts (its pieces and the largest whole parameter)")
        for s, n, b, ok in zip(candidates, need, start, fits)
        if not ok
    ]
    return Space(feasible, need[fits] / 2**30, rejected)
