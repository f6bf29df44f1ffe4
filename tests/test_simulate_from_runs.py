"""`cona simulate --from-run`: a world made of static runs' loss curves, GNS rows and step times."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.simulate.from_runs import RunDataError, RunDynamics, read_static_run
from cona_core.config import config_from_dict
from tests.support import TINY, write_config

runner = CliRunner()
DOC = {
    **{k: v for k, v in TINY.items() if k != "strategy"},
    "train": {**TINY["train"], "max_steps": None, "max_time": 600, "eval_interval": None, "eval_interval_s": 20},
    "search": {"gbs_min": 8, "gbs_max": 32, "mbs": [2, 4, 8]},
}
CFG = config_from_dict(DOC, "tiny")


def _write_run(
    path: Path,
    gbs: int,
    evals: list[tuple[int, float]],
    iter_s: float,
    gns: float = 40.0,
    doc: dict = DOC,
    first_extra: float = 0.0,
) -> Path:
    """A static run folder: evaluations (samples, val loss), a step row every `gbs` samples with two-batch
    estimates of noise scale `gns`, steps of `iter_s` seconds (the first `first_extra` longer), 3 s before
    the first and 1 s per evaluation."""
    path.mkdir(parents=True)
    (path / "config.resolved.json").write_text(json.dumps(config_from_dict(doc, "tiny").to_raw()))
    rows, t = [], 3.0
    samples = {n: loss for n, loss in evals}
    for step in range(evals[-1][0] // gbs + 1):
        n = step * gbs
        if n in samples:
            rows.append({"kind": "eval", "step": step, "time": t, "val_loss": samples[n], "consumed_samples": n})
            t += 1.0 if step else 0.0
        if n == evals[-1][0]:
            break
        took = iter_s + (first_extra if step == 0 else 0.0)
        t += took
        row = {"kind": "step", "step": step + 1, "time": t, "iter_s": took, "launch": 1}
        row |= {"dp": 4, "tp": 1, "pp": 1, "mbs": gbs // 4, "gbs": gbs, "consumed_samples": n + gbs}
        rows.append(row | {"grad_sq_raw": 1.0, "trace_raw": gns})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_run_curve_interpolates_in_log_samples_and_extends_along_its_last_slope(tmp_path: Path) -> None:
    run = read_static_run(_write_run(tmp_path / "r", 8, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.1), CFG)
    assert run.strategy.gbs == 8 and run.samples == (0, 800, 3200) and run.losses == (9.0, 7.0, 6.0)
    assert run.samples_to(9.5) == 0 and run.samples_to(8.0) == pytest.approx(400)  # linear to the first
    assert run.samples_to(6.5) == pytest.approx(1600)  # halfway in log samples between 800 and 3200
    assert run.samples_to(5.0) == pytest.approx(12800)  # one more loss unit per factor 4, as the last segment
    for n in (100, 1600, 12800):
        assert run.samples_to(run.loss_at(n)) == pytest.approx(n)
    assert run.start_s == pytest.approx(3.0) and run.eval_s == pytest.approx((1.0,))  # the last evaluation ends the run
    assert len(run.iter_s) == 400 - 2 and len(run.noise) == 400  # a launch's first two steps are not timed
    assert run.warmup_s == 0.0
    slow = read_static_run(
        _write_run(tmp_path / "s", 8, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.1, first_extra=0.6), CFG
    )
    assert slow.warmup_s == pytest.approx(0.6)  # what its first steps took beyond two steady ones


def test_the_world_follows_the_runs_and_interpolates_a_rung_between_them(tmp_path: Path) -> None:
    small = read_static_run(_write_run(tmp_path / "8", 8, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.1, 10.0), CFG)
    big = read_static_run(_write_run(tmp_path / "32", 32, [(0, 9.0), (3200, 7.0), (12800, 6.0)], 0.2, 60.0), CFG)
    world = RunDynamics([small, big], [8, 16, 32])
    assert world.samples(8, 9.0, 6.5) == pytest.approx(1600, rel=1e-3)
    assert world.samples(32, 9.0, 6.5) == pytest.approx(6400, rel=1e-3)
    assert world.samples(16, 9.0, 6.5) == pytest.approx(3200, rel=1e-3)  # the geometric middle
    assert world.after(8, 6.5) == pytest.approx(small.loss_at(1608), abs=1e-3)  # 8 samples further on its curve
    assert world.samples(64, 9.0, 6.5) == pytest.approx(6400, rel=1e-3)  # beyond the runs: as the nearest
    rng = random.Random(0)
    assert world.report(8, 7.0, rng) == (1.0, 10.0) and world.report(32, 7.0, rng) == (1.0, 60.0)
    assert world.report(16, 7.0, rng) == (1.0, 10.0)  # the nearest measured rung's rows (ties: the smaller)
    assert world.overheads() == (pytest.approx(3.0), pytest.approx(1.0))
    assert world.floor() == pytest.approx(6.0 - 0.5)


def test_read_static_run_refuses_what_cannot_give_a_curve(tmp_path: Path) -> None:
    with pytest.raises(RunDataError, match="not a run directory"):
        read_static_run(tmp_path, CFG)
    few = _write_run(tmp_path / "few", 8, [(0, 9.0), (800, 7.0)], 0.1)
    with pytest.raises(RunDataError, match="needs an evaluation at step 0 and two lower ones"):
        read_static_run(few, CFG)
    other = {**DOC, "model": {**DOC["model"], "d_model": 2 * DOC["model"]["d_model"]}}
    with pytest.raises(RunDataError, match=r"trained another model \(model.d_model differs"):
        read_static_run(_write_run(tmp_path / "other", 8, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.1, doc=other), CFG)
    mixed = _write_run(tmp_path / "mixed", 8, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.1)
    rows = (mixed / "metrics.jsonl").read_text().splitlines()
    rows[-2] = json.dumps({**json.loads(rows[-2]), "gbs": 16, "mbs": 4})  # its last step
    (mixed / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(RunDataError, match="not a static run"):
        read_static_run(mixed, CFG)


def test_cona_simulate_from_runs(tmp_path: Path) -> None:
    """A world where gbs 32 needs as many samples as gbs 8 at twice its throughput: every row of the
    table comes from the runs, static-32 beats static-8 and the optima go to 32."""
    runs = [
        _write_run(tmp_path / "s8", 8, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.1, 20.0),
        _write_run(tmp_path / "s32", 32, [(0, 9.0), (800, 7.0), (3200, 6.0)], 0.2, 20.0),
    ]
    cfg = write_config(tmp_path / "tiny.yaml", DOC)
    args = ["simulate", str(cfg), "--targets", f"{math.exp(7.5):.1f},{math.exp(6.2):.1f}", "--seeds", "1", "--json"]
    result = runner.invoke(app, [*args, *(a for r in runs for a in ("--from-run", str(r)))])
    assert result.exit_code == 0, result.output
    assert "measured overheads: 3 s before the first step, 1 s per evaluation" in result.stderr
    times = json.loads(result.stdout)["times_s"]
    t8 = next(v for k, v in times.items() if k.startswith("static-8"))[0]
    t32 = next(v for k, v in times.items() if k.startswith("static-32"))[0]
    assert t8[-1] == pytest.approx(3 + 2425 / 8 * 0.1 + 1, rel=0.05)  # its own steps, start-up and evaluations
    assert t32[-1] < t8[-1]
    assert any(k.startswith("static-32 (dp4-tp1-pp1-mbs8-gbs32)") for k in times)  # the rung's run, as it ran
    evaluated = json.loads(result.stdout)["evaluated_times_s"]
    assert not any(k.startswith("optimum") for k in evaluated)
    e8 = next(v for k, v in evaluated.items() if k.startswith("static-8 (dp4-tp1-pp1-mbs2-gbs8)"))[0]
    # as bench_ttp.py times a run: between the evaluations (every 20 s) that bracket the target, so later
    # than the step-exact time on a curve that flattens, by less than one interval
    assert t8[-1] < e8[-1] < t8[-1] + 21
    assert times["optimum sequence (free switches)"][0][-1] <= t32[-1] * 1.001
    refused = runner.invoke(app, [*args, "--from-run", str(runs[0]), "--true-kappa", "4"])
    assert refused.exit_code == 2 and "--from-run: the runs set the world" in refused.output
    below = runner.invoke(app, ["simulate", str(cfg), "--targets", "100", *("--from-run", str(runs[0]))])
    assert below.exit_code == 2 and "below how far the runs' curves extend" in below.output
