"""Search the feasible strategies of one global batch for the lowest predicted T(s).

Small spaces (<= search.exhaustive_max) are evaluated exhaustively in one vectorised call. Larger
ones use Bayesian optimisation over log2 (dp, tp, pp, mbs): `skopt.Optimizer` (GP surrogate) proposes
Latin-hypercube initial points, each snapped to the nearest feasible candidate not yet evaluated;
after them the next candidate is the unevaluated feasible one with the largest expected improvement
(EI maximised exactly over the discrete feasible set, instead of snapping a continuous optimum).
The search stops when that EI (on log T, so relative to the best) falls below search.ei_stop, or
after search.budget evaluations.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from skopt import Optimizer
from skopt.acquisition import gaussian_ei
from skopt.learning import GaussianProcessRegressor
from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern
from skopt.space import Real
from threadpoolctl import threadpool_limits

from cona_cli.planner.costmodel import as_array
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.space import Space, enumerate_space
from cona_cli.planner.surrogate import crossover_gns
from cona_core.config import Config, SearchConfig
from cona_core.efficiency import phi
from cona_core.strategy import Strategy


class Predictor(Protocol):
    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of seconds per step for rows x = (dp, tp, pp, mbs, gbs)."""
        ...


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    time_s: float
    time_std: float
    memory_gib: float
    phi: float

    @property
    def samples_per_s(self) -> float:
        return self.strategy.gbs / self.time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.strategy.to_dict(),
            "microbatches": self.strategy.n_microbatches,
            "time_s": self.time_s,
            "time_std": self.time_std,
            "samples_per_s": self.samples_per_s,
            "memory_gib": self.memory_gib,
            "phi": self.phi,
        }


@dataclass(frozen=True)
class SearchResult:
    """Ranked candidates (best first) of one global batch and what was rejected there."""

    gbs: int
    ranked: list[Candidate]
    rejected: list[tuple[Strategy, str]]
    n_feasible: int
    exhaustive: bool

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self, top: int | None = None, rejected: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gbs": self.gbs,
            "n_feasible": self.n_feasible,
            "evaluated": len(self.ranked),
            "exhaustive": self.exhaustive,
            "candidates": [c.to_dict() for c in self.ranked[:top]],
        }
        if rejected:
            out["rejected"] = [{"strategy": str(s), "reason": r} for s, r in self.rejected]
        return out


def _bayesian(coords: np.ndarray, objective: Callable[[int], float], settings: SearchConfig) -> list[int]:
    """Indices of the candidates BO evaluated; `objective(i)` returns log T of candidate i."""
    pts = coords[:, coords.max(axis=0) > coords.min(axis=0)]
    dims = [Real(float(lo), float(hi)) for lo, hi in zip(pts.min(axis=0), pts.max(axis=0))]
    kernel = ConstantKernel(1.0, (0.01, 100.0)) * Matern(
        length_scale=np.ones(len(dims)), length_scale_bounds=(0.1, 5.0), nu=2.5
    )
    gp = GaussianProcessRegressor(
        kernel=kernel, normalize_y=True, noise="gaussian", n_restarts_optimizer=0, random_state=settings.seed
    )  # one hyperparameter fit per tell keeps it fast
    n_initial = min(settings.n_initial, settings.budget)
    opt = Optimizer(
        dims,
        base_estimator=gp,
        n_initial_points=n_initial,
        initial_point_generator="lhs",
        acq_func="EI",
        acq_optimizer="sampling",
        acq_optimizer_kwargs={"n_points": 100},
        random_state=settings.seed,
    )
    seen: dict[int, float] = {}
    with threadpool_limits(1, user_api="blas"):  # tiny GP matrices: BLAS threads only add overhead
        for _ in range(settings.budget):
            unseen = np.setdiff1d(np.arange(len(pts)), list(seen))
            if not len(unseen):
                break
            if len(seen) < n_initial:  # Latin-hypercube start, snapped to the nearest unevaluated candidate
                asked = np.asarray(opt.ask())
                i = int(unseen[np.argmin(((pts[unseen] - asked) ** 2).sum(axis=1))])
            else:  # maximise EI exactly over the (discrete) feasible set
                ei = gaussian_ei(opt.space.transform(pts[unseen].tolist()), opt.models[-1], y_opt=min(seen.values()))
                if ei.max() < settings.ei_stop:  # objective is log T: EI is a relative improvement
                    break
                i = int(unseen[np.argmax(ei)])
            seen[i] = objective(i)
            opt.tell(pts[i].tolist(), seen[i])
    return list(seen)


def search_gbs(space: Space, predictor: Predictor, gbs: int, settings: SearchConfig, gns: float = 0.0) -> SearchResult:
    """Rank the feasible strategies of one global batch by predicted seconds per step."""
    sub = space.at_gbs(gbs)
    x = as_array(sub.feasible)
    exhaustive = len(sub.feasible) <= max(settings.exhaustive_max, 1)
    if exhaustive:
        idx = np.arange(len(x))
        mean, std = predictor.predict(x)
    else:

        def objective(i: int) -> float:
            return float(np.log(predictor.predict(x[i : i + 1])[0][0]))

        idx = np.array(_bayesian(np.log2(x[:, :4].astype(np.float64)), objective, settings))
        mean, std = predictor.predict(x[idx])
    order = np.argsort(mean, kind="stable")
    ranked = [
        Candidate(
            sub.feasible[idx[k]],
            float(mean[k]),
            float(std[k]),
            float(sub.memory_gib[idx[k]]),
            float(phi(gbs, mean[k], gns)),
        )
        for k in order
    ]
    return SearchResult(gbs, ranked, sub.rejected, len(sub.feasible), exhaustive)


def plan(
    cfg: Config, hw: HardwareProfile, predictor: Predictor, ladder: list[int], gns: float = 0.0
) -> list[SearchResult]:
    """Search every rung of the ladder (one space enumeration for all)."""
    space = enumerate_space(cfg, hw, ladder)
    return [search_gbs(space, predictor, g, cfg.search, gns) for g in ladder]


def crossovers(results: list[SearchResult]) -> list[tuple[int, int, float]]:
    """(smaller gbs, larger gbs, GNS above which the larger rung's best beats the smaller's) for
    consecutive rungs that have a feasible strategy; GNS 0.0: always, inf: never."""
    best = [r.best for r in results if r.best is not None]
    return [
        (a.strategy.gbs, b.strategy.gbs, crossover_gns(a.strategy.gbs, a.time_s, b.strategy.gbs, b.time_s))
        for a, b in itertools.pairwise(best)
    ]
