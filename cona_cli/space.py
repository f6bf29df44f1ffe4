"""The strategy space: candidates (dp, tp, pp, mbs, gbs), feasibility with reasons, memory per device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cona_cli.config import Config
from cona_cli.costmodel import HardwareProfile, Workload, as_array
from cona_cli.strategy import Strategy, divisibility_problems


@dataclass(frozen=True)
class Space:
    """Feasible strategies (with their estimated peak memory) and the rejected ones with reasons."""

    feasible: list[Strategy]
    memory_gib: np.ndarray
    rejected: list[tuple[Strategy, str]]

    def at_gbs(self, gbs: int) -> "Space":
        keep = [i for i, s in enumerate(self.feasible) if s.gbs == gbs]
        return Space([self.feasible[i] for i in keep], self.memory_gib[keep],
                     [(s, r) for s, r in self.rejected if s.gbs == gbs])


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


def memory_bytes(x: np.ndarray, w: Workload) -> np.ndarray:
    """Peak bytes per device (without the runtime reservation) for rows x = (dp, tp, pp, mbs, gbs).

    Model states: 16 bytes per parameter for AdamW in fp32 or mixed precision (weights + grads +
    fp32 master/moments), sharded over dp under FSDP. Activations per layer and micro-batch after
    Korthikanti et al. 2022 without the s^2 score term (SDPA / flash attention keeps no scores):
    s*b*h*(10 + 24/tp) bytes at 2-byte precision; with recomputation only each layer's input plus
    one layer's working set. 1F1B keeps up to pp micro-batches in flight on stage 0, GPipe all m;
    the last stage also holds fp32 logits and their gradient for one micro-batch.
    """
    dp, tp, pp, mbs, gbs = (x[:, i].astype(np.float64) for i in range(5))
    m = gbs / (dp * mbs)
    states = w.stage_params(tp, pp) * 16
    if w.dp_impl == "fsdp":
        states = states / dp + 2 * w.layer_params / tp * 2 * w.act_bytes  # plus two gathered layers
    sbh = w.seq_len * mbs * w.d_model * w.act_bytes / 2
    full_layer = sbh * (10 + 24 / tp)
    layers = w.n_layers / pp
    per_microbatch = layers * 2 * sbh + full_layer if w.recompute else layers * full_layer
    first_in_flight = np.where(pp == 1, 1, np.minimum(pp, m) if w.pp_schedule == "1f1b" else m)
    last_in_flight = np.where(pp == 1, 1, 1 if w.pp_schedule == "1f1b" else m)
    logits = 2 * mbs * w.seq_len * w.vocab / tp * 4
    first = first_in_flight * per_microbatch + np.where(pp == 1, logits, 0.0)
    last = last_in_flight * per_microbatch + logits
    return states + np.maximum(first, last)


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
    if cfg.search.tp_within_node:
        limits.append((lambda s: s.tp > ppn, f"tp spans nodes (> procs_per_node {ppn})"))
    candidates, rejected = [], []
    for gbs in ladder:
        for pp in _divisors(world):
            for tp in _divisors(world // pp):
                for mbs in mbs_list:
                    s = Strategy(world // (tp * pp), tp, pp, mbs, gbs)
                    problems = divisibility_problems(s, world, w.n_layers, w.n_heads, w.kv_heads)
                    problems += [reason for broken, reason in limits if broken(s)]
                    if problems:
                        rejected.append((s, "; ".join(problems)))
                    else:
                        candidates.append(s)
    need = memory_bytes(as_array(candidates), w) + hw.reserved_gib * 2**30
    budget = (1 - cfg.search.memory_margin) * hw.device_memory_bytes(ppn)
    fits = need <= budget
    feasible = [s for s, ok in zip(candidates, fits) if ok]
    rejected += [(s, f"memory {n / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB available "
                     f"({cfg.search.memory_margin:.0%} margin)")
                 for s, n, ok in zip(candidates, need, fits) if not ok]
    return Space(feasible, need[fits] / 2**30, rejected)
