"""Online calibration of T(s): fit the profile's free parameters to measured step times, then model
what the analytic form still misses with a Gaussian process over log2 (dp, tp, pp, mbs, gbs).

`Calibrator.predict` returns mean and std seconds per step; strategies that were measured return
their measured median (std: spread of the samples). The error of a prediction has two parts: the GP's,
and the fitted parameters' own (their Gauss-Newton posterior, carried to log T by the delta method).
The second is what an extrapolation is uncertain about: two measured strategies fit ten parameters
exactly, so the GP sees no residual and alone would state an error near zero at the next global batch,
while the parameters the two measurements leave free move the prediction there. A strategy off the
span of the measured ones (it differs from them along a direction of the features in which no two of
them differ, as the first step that accumulates micro-batches after steps that all ran one) keeps at
least the uncalibrated model's error: neither the fit nor the GP saw that direction. The state
round-trips through a plain dict.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from sklearn.exceptions import ConvergenceWarning
from skopt.learning import GaussianProcessRegressor
from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel
from threadpoolctl import threadpool_limits

from cona_cli.planner.costmodel import as_array, iteration_time
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.workload import Workload
from cona_core.strategy import Strategy

FREE_PARAMS = (
    "mfu_max",
    "eff_half_gflop",
    "intra_bw_gbs",
    "intra_latency_us",
    "inter_bw_gbs",
    "overlap",
    "step_overhead_ms",
    "layer_overhead_us",
    "tp_overhead_us",
    "microbatch_overhead_us",
)
_UPPER = {"mfu_max": 1.0, "overlap": 1.0}  # fractions; every other parameter may move 100x either way
_FLOOR = 1e-6  # parameters are fitted in log space, so never exactly 0
_STEP = 1e-4  # log-space step of the forward differences of log T
MEASUREMENT_NOISE = 0.05  # relative noise of one median step time
PRIOR_LOG_STD = 1.5  # how far (in log units) data may pull a parameter from the profile's value
UNCALIBRATED_REL_STD = 0.3  # relative std of the analytic model before any measurement


def read_recording(path: Path) -> dict[Strategy, list[float]]:
    """Step times recorded by scripts/bench_layouts.py: a JSON list of {dp, tp, pp, mbs, gbs, iter_s}."""
    times: dict[Strategy, list[float]] = {}
    for r in json.loads(path.read_text()):
        times.setdefault(Strategy(r["dp"], r["tp"], r["pp"], r["mbs"], r["gbs"]), []).append(r["iter_s"])
    return times


def features(x: np.ndarray) -> np.ndarray:
    """GP inputs: log2 of (dp, tp, pp, mbs, gbs)."""
    return np.log2(x.astype(np.float64))


def off_span(f: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """For each row of features f, whether it differs from the rows `seen` (two or more) along a direction
    in which no two of them differ: there the data constrain neither the fit nor the residual model."""
    basis = (seen[1:] - seen[0]).T  # (5, k): the directions the seen rows span
    delta = (f - seen[0]).T
    coef, *_ = np.linalg.lstsq(basis, delta, rcond=None)
    return np.linalg.norm(delta - basis @ coef, axis=0) > 1e-9


class Calibrator:
    """Predictor of seconds per step: analytic model with fitted parameters times a GP residual."""

    def __init__(
        self, workload: Workload, profile: HardwareProfile, seed: int = 0, free: tuple[str, ...] = FREE_PARAMS
    ) -> None:
        self.workload = workload
        self.prior = profile
        self.fitted = profile
        self.seed = seed
        self.free = free
        self.measurements: dict[Strategy, list[float]] = {}
        self._gp: GaussianProcessRegressor | None = None
        self._cov: np.ndarray | None = None  # posterior covariance of the fitted log parameters

    def add(self, strategy: Strategy, seconds: float) -> None:
        """Record one measured step time (call `fit` afterwards)."""
        self.measurements.setdefault(strategy, []).append(float(seconds))

    def _measured(self) -> tuple[np.ndarray, np.ndarray]:
        strategies = list(self.measurements)
        return as_array(strategies), np.array([np.median(self.measurements[s]) for s in strategies])

    def fit(self) -> None:
        """Least-squares fit of the free parameters (log space, pulled towards the profile), then the GP."""
        if not self.measurements:
            return
        x, y = self._measured()
        z0 = np.log([max(getattr(self.prior, p), _FLOOR) for p in self.free])
        upper = np.log([_UPPER.get(p, np.exp(z) * 100) for p, z in zip(self.free, z0)])
        lower = np.minimum(z0 - np.log(100), upper - 1e-9)
        z0 = np.clip(z0, lower, upper - 1e-9)

        def residuals(z: np.ndarray) -> np.ndarray:
            t = iteration_time(x, self.workload, self._with(z))
            return np.concatenate([(np.log(t) - np.log(y)) / MEASUREMENT_NOISE, (z - z0) / PRIOR_LOG_STD])

        fit = least_squares(residuals, z0, bounds=(lower, upper), x_scale=1.0)
        self.fitted = self._with(fit.x)
        self._fit_errors()

    def _with(self, z: np.ndarray) -> HardwareProfile:
        return dataclasses.replace(self.prior, **{p: float(np.exp(v)) for p, v in zip(self.free, z)})

    def _log_z(self) -> np.ndarray:
        return np.log([max(getattr(self.fitted, p), _FLOOR) for p in self.free])

    def _log_time_gradient(self, x: np.ndarray) -> np.ndarray:
        """d log T(x) / d log parameter at the fitted parameters, (n, free)."""
        z = self._log_z()
        base = np.log(iteration_time(x, self.workload, self.fitted))
        steps = np.eye(len(z)) * _STEP
        return (
            np.stack([np.log(iteration_time(x, self.workload, self._with(z + h))) - base for h in steps], axis=1)
            / _STEP
        )

    def _fit_errors(self) -> None:
        """The parameters' posterior covariance (the fit's measurement rows and prior, linearised at the fit),
        then the GP on what the fitted model still misses."""
        self._gp = self._cov = None
        if len(self.measurements) < 2:  # predict keeps the uncalibrated error until both exist
            return
        x, y = self._measured()
        g = self._log_time_gradient(x) / MEASUREMENT_NOISE
        self._cov = np.linalg.inv(g.T @ g + np.eye(len(self.free)) / PRIOR_LOG_STD**2)
        r = np.log(y) - np.log(iteration_time(x, self.workload, self.fitted))
        kernel = ConstantKernel(MEASUREMENT_NOISE**2 * 4, (1e-4, 1.0)) * Matern(
            length_scale=np.full(5, 2.0), length_scale_bounds=(0.5, 20.0), nu=2.5
        ) + WhiteKernel(MEASUREMENT_NOISE**2, (1e-6, 0.05))
        gp = GaussianProcessRegressor(kernel=kernel, normalize_y=False, n_restarts_optimizer=2, random_state=self.seed)
        with warnings.catch_warnings(), threadpool_limits(1, user_api="blas"):
            warnings.simplefilter("ignore", ConvergenceWarning)  # few points: bounds are often hit
            self._gp = gp.fit(features(x), r)

    def misfit(self) -> tuple[Strategy, float] | None:
        """The measured strategy the fitted model (before the GP) is furthest from, and measured / modelled
        there (None before a measurement): far from 1, the profile cannot describe the host at any setting
        of the free parameters (a GPU's step times against a CPU's peak)."""
        if not self.measurements:
            return None
        x, y = self._measured()
        ratio = y / iteration_time(x, self.workload, self.fitted)
        worst = int(np.argmax(np.abs(np.log(ratio))))
        return list(self.measurements)[worst], float(ratio[worst])

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of seconds per step for rows x = (dp, tp, pp, mbs, gbs)."""
        mean = iteration_time(x, self.workload, self.fitted)
        if self._gp is None:  # fewer than two measured strategies: no residual model yet
            std = mean * UNCALIBRATED_REL_STD
        else:
            f = features(x)
            mu, sd = self._gp.predict(f, return_std=True)
            mean = mean * np.exp(mu)
            g = self._log_time_gradient(x)
            sd = np.sqrt(sd**2 + np.einsum("ni,ij,nj->n", g, self._cov, g))
            unseen = off_span(f, self._gp.X_train_)  # the features the GP was fitted on
            std = mean * np.where(unseen, np.maximum(sd, UNCALIBRATED_REL_STD), sd)
        for s, samples in self.measurements.items():
            hit = np.all(x == (s.dp, s.tp, s.pp, s.mbs, s.gbs), axis=1)
            mean = np.where(hit, np.median(samples), mean)
            std = np.where(hit, np.std(samples), std)
        return mean, std

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.prior.name,
            "seed": self.seed,
            "free": list(self.free),
            "params": {p: getattr(self.fitted, p) for p in self.free},
            "measurements": [{"strategy": str(s), "seconds": v} for s, v in self.measurements.items()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], workload: Workload, profile: HardwareProfile) -> Calibrator:
        """Restore a calibrator saved by `to_dict` (the GP is refitted, deterministically)."""
        if data["profile"] != profile.name:
            raise ValueError(f"calibration is for hardware {data['profile']!r}, not {profile.name!r}")
        cal = cls(workload, profile, seed=data["seed"], free=tuple(data["free"]))
        for row in data["measurements"]:
            for seconds in row["seconds"]:
                cal.add(Strategy.parse(row["strategy"]), seconds)
        cal.fitted = dataclasses.replace(profile, **data["params"])
        cal._fit_errors()
        return cal
