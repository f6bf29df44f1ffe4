"""The GNS estimator: exact on synthetic gradients, and whole-model under TP/PP sharding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cona_core.gns import NoiseWindow, two_batch_estimate
from tests.support import REPO, TINY, torchrun


def _synthetic(true_g: np.ndarray, sigma: float, b_small: int, n_small: int, rng: np.random.Generator):
    """Per-sample gradients g + N(0, sigma^2 I); returns mean |G_small|^2 and |G_big|^2."""
    samples = true_g + sigma * rng.standard_normal((b_small * n_small, true_g.size))
    small = samples.reshape(n_small, b_small, -1).mean(axis=1)
    big = samples.mean(axis=0)
    return float((small**2).sum(axis=1).mean()), float((big**2).sum())


def test_two_batch_estimator_recovers_known_values() -> None:
    rng = np.random.default_rng(0)
    dim, sigma = 200, 3.0
    g = rng.standard_normal(dim) * 0.5
    true_grad_sq, true_trace = float((g**2).sum()), sigma**2 * dim
    ests = []
    for _ in range(400):
        small, big = _synthetic(g, sigma, b_small=8, n_small=4, rng=rng)
        ests.append(two_batch_estimate(8, small, 32, big))
    est_g, est_tr = np.mean(ests, axis=0)
    assert abs(est_g - true_grad_sq) / true_grad_sq < 0.05
    assert abs(est_tr - true_trace) / true_trace < 0.02
    assert abs(est_tr / est_g - true_trace / true_grad_sq) / (true_trace / true_grad_sq) < 0.06


def test_accumulation_path_first_micro_batch_as_small_batch() -> None:
    """dp = 1: the step's first micro-batch (B_small = mbs) against the whole batch (B_big = gbs)."""
    rng = np.random.default_rng(1)
    g = rng.standard_normal(100)
    ests = []
    for _ in range(3000):
        samples = g + 2.0 * rng.standard_normal((16, g.size))  # 8 micro-batches of 2
        small = float((samples[:2].mean(axis=0) ** 2).sum())
        big = float((samples.mean(axis=0) ** 2).sum())
        ests.append(two_batch_estimate(2, small, 16, big))
    est_g, est_tr = np.mean(ests, axis=0)
    assert abs(est_g - (g**2).sum()) / (g**2).sum() < 0.08
    assert abs(est_tr - 400.0) / 400.0 < 0.05


def test_window_pools_the_last_samples_and_forgets_a_spike() -> None:
    ns = NoiseWindow(window=64)
    assert ns.gns is None and ns.means is None
    ns.add(8, 2.0, 20.0)
    assert ns.means == pytest.approx((2.0, 20.0)) and ns.gns == pytest.approx(10.0)
    # One loss spike: |G|² 10⁵ times its neighbours' pulls the pooled estimate to its own ratio ...
    ns.add(8, 2e5, 4e4)
    assert ns.gns == pytest.approx((20.0 + 4e4) / (2.0 + 2e5))
    # ... until the window's 64 samples hold only later steps: then it reads theirs exactly.
    for i in range(8):
        ns.add(8, 1.0, 50.0)
        assert (ns.gns == pytest.approx(50.0)) == (i >= 7)
    assert len(ns.entries) == 8
    # The window is in samples: a larger batch keeps fewer steps.
    big = NoiseWindow(window=64)
    for _ in range(5):
        big.add(32, 1.0, 10.0)
    assert len(big.entries) == 2
    restored = NoiseWindow(64, ns.state_dict()["entries"])
    assert restored.entries == ns.entries and restored.gns == ns.gns
    assert ns.interval(0.99).value == pytest.approx(50.0)


def test_one_window_two_reset_rules() -> None:
    """The workers' LR keeps an earlier batch's steps; the policy's window (per_batch) starts again at a new
    batch, also on a step without an estimate. Both save the same entries."""
    kept, per_batch = NoiseWindow(64), NoiseWindow(64, per_batch=True)
    for window in (kept, per_batch):
        window.add(8, 1.0, 10.0)
        window.add(8, 1.0, 12.0)
        window.add(16, None, None)  # held after the change of batch
    assert list(kept.entries) == [(8, 1.0, 10.0), (8, 1.0, 12.0)] and not per_batch.entries
    for window in (kept, per_batch):
        window.add(16, 1.0, 40.0)
    assert kept.gns == pytest.approx(62.0 / 3) and per_batch.gns == pytest.approx(40.0)
    restored = NoiseWindow(64, kept.state_dict()["entries"], per_batch=True)  # a worker's entries, replayed
    assert list(restored.entries) == [(16, 1.0, 40.0)]


def test_estimator_rejects_degenerate_batches() -> None:
    with pytest.raises(ValueError):
        two_batch_estimate(16, 1.0, 16, 1.0)


def _family_run_dir(run_dir: Path, family: str) -> None:
    """Turn the tiny run folder into one of `family` (its model, and its corpus with its special tokens)."""
    from cona_core.config import config_from_dict
    from cona_core.shape import SPECIAL_TOKENS
    from launch.data.corpus import prepare_corpus

    cfg = config_from_dict({**TINY, "model": {**TINY["model"], "family": family, **FAMILY_MODEL[family]}}, "tiny")
    (run_dir / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    corpus = prepare_corpus(cfg.data, seed=cfg.train.seed, special_tokens=SPECIAL_TOKENS[family])
    (run_dir / "corpus.json").write_text(corpus.to_json())


FAMILY_MODEL = {"gpt": {}, "llama": {"n_heads": 8, "n_kv_heads": 4}, "bert": {}}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "nproc,layouts,family",
    [
        (4, "2-2-1,1-2-2,fsdp-2-2-1", "gpt"),
        (2, "1-1-2,2-1-1,fsdp-2-1-1,1-2-1", "gpt"),
        (4, "1-2-2,2-1-2", "llama"),
        (4, "1-2-2,2-1-2", "bert"),
    ],
)
def test_shard_sums_equal_single_process(tiny_run_dir: Path, nproc: int, layouts: str, family: str) -> None:
    """Every layout counts the same parameters once: all but the family's vocab_params (embeddings and
    output heads, tied copies under pp > 1 included), first micro-batch (dp = 1, and FSDP) too; and the
    base LR's hypergradient over every parameter (each counted once, tied copies too)."""
    if family != "gpt":
        _family_run_dir(tiny_run_dir, family)
    if nproc == 2:  # the tiny config has 4 ranks; this job runs on 2
        cfg = json.loads((tiny_run_dir / "config.resolved.json").read_text())
        cfg["cluster"]["procs_per_node"] = 2
        cfg["strategy"] = "dp1-tp1-pp2-mbs2-gbs16"
        (tiny_run_dir / "config.resolved.json").write_text(json.dumps(cfg))
    out = tiny_run_dir / "gns.json"
    torchrun(REPO / "tests" / "dist" / "gns_shards.py", nproc, str(tiny_run_dir), str(out), layouts)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(layouts.split(","))
    for name, r in results.items():
        assert math.isclose(r["grad_sq"], r["ref_grad_sq"], rel_tol=1e-4, abs_tol=1e-7), (name, r)
        assert math.isclose(r["trace"], r["ref_trace"], rel_tol=1e-4), (name, r)
        assert math.isclose(r["cosine"], r["ref_cosine"], rel_tol=1e-4), (name, r)
