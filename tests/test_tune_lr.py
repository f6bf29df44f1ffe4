"""`cona tune-lr`: a real sweep of the base batch's learning rate, and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.commands.tune_lr_command import Trial, best_trial, parse_lrs
from cona_core.config import ConfigError
from tests.support import TINY, write_config

runner = CliRunner()
DOC = {
    **{k: v for k, v in TINY.items() if k != "strategy"},
    "cluster": {"procs_per_node": 2},
    "search": {"gbs_min": 8, "gbs_max": 16, "mbs": [1, 2, 4]},
}


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return write_config(tmp_path / "tiny.yaml", DOC)


def test_the_grid_is_two_or_more_distinct_positive_rates() -> None:
    assert parse_lrs("2e-3, 1e-3,1e-3") == [1e-3, 2e-3]
    for bad in ("1e-3", "1e-3,x", "0,1e-3", "-1e-3,1e-3", "nan,1e-3"):
        with pytest.raises(ConfigError, match="--lrs"):
            parse_lrs(bad)


def test_the_best_trial_is_the_lowest_loss_that_finished() -> None:
    trials = [Trial(1e-3, 5.0, 1, 1.0), Trial(2e-3, None, None, None)]
    trials.append(Trial(4e-3, 4.5, 1, 1.0))
    assert best_trial(trials).lr == 4e-3
    assert best_trial([Trial(1e-3, None, None, None)]) is None


@pytest.mark.parametrize(
    ("args", "part"),
    [
        (["--lrs", "1e-3"], "--lrs"),
        (["--set", "train.lr=1e-3"], "--set train.lr"),
        (["--set", "train.max_tokens=100"], "--set train.max_tokens"),
        (["--set", "train.nope=1"], "train.nope"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_anything_trains(tiny: Path, args: list[str], part: str) -> None:
    result = runner.invoke(app, ["tune-lr", str(tiny), "--tokens", "1000", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cona tune-lr: ") and part in lines[0], result.stderr
    assert not Path("runs").exists()


@pytest.mark.e2e
def test_a_sweep_trains_the_base_batch_at_each_rate_and_names_the_best(tiny: Path) -> None:
    out = Path("sweep")
    result = runner.invoke(app, ["tune-lr", str(tiny), "--lrs", "3e-4,3e-3", "--tokens", "10240", "--out", str(out)])
    assert result.exit_code == 0, result.output
    losses = {}
    for lr in ("0.0003", "0.003"):
        run = out / f"lr-{lr}"
        resolved = json.loads((run / "config.resolved.json").read_text())
        assert resolved["policy"] == "static" and resolved["train"]["lr"] == float(lr)
        assert resolved["strategy"].endswith("gbs8") and resolved["train"]["lr_base_gbs"] == 8
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if r["kind"] == "eval"]
        steps = [r for r in rows if r["kind"] == "step"]
        assert steps[-1]["consumed_samples"] * 32 == 10240  # stopped by the token budget
        assert all(r["lr"] <= float(lr) + 1e-12 for r in steps)  # the base batch runs at the swept LR
        losses[float(lr)] = evals[-1]["val_loss"]
    best = min(losses, key=losses.get)
    assert f"train.lr: {best:g}  # best of 2 at gbs 8" in result.stdout
    assert f"| {best:g} (best) | {losses[best]:.4f} | {math.exp(losses[best]):.4g} |" in result.stdout
    assert "at the edge of the grid" in result.stdout  # two rates: the best is always an edge
    again = runner.invoke(app, ["tune-lr", str(tiny), "--lrs", "3e-4,3e-3", "--tokens", "10240", "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.stderr
