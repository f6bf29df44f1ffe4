"""`cona train` end to end: a 3-stage chain with real torchrun relaunches, Ctrl-C, and the online policy
(relaunches and in-place resizes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cona_cli.simulate.replay import replay
from tests.support import REPO, TINY, write_config

pytestmark = pytest.mark.e2e

CHAIN = [
    {"dp": 2, "tp": 1, "pp": 2, "mbs": 2, "gbs": 8, "steps": 8},
    {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16, "steps": 8},
    {"dp": 2, "tp": 2, "pp": 1, "mbs": 4, "gbs": 32},
]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cona(*args: str) -> list[str]:
    return [sys.executable, "-c", "from cona_cli.app import main; main()", *args]


def test_three_stage_chain(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "tiny.yaml", {**TINY, "strategy": None, "train": {**TINY["train"], "max_steps": 22}})
    (tmp_path / "chain.yaml").write_text(yaml.safe_dump({"chain": CHAIN}))
    run = tmp_path / "run"
    proc = subprocess.run(
        _cona("train", str(cfg), "--chain", str(tmp_path / "chain.yaml"), "--run-dir", str(run)),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = _rows(run / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("launch") == 3 and kinds.count("switch") == 2, kinds
    assert events[-1]["kind"] == "exit" and events[-1]["reason"] == "max_steps"
    switches = [e for e in events if e["kind"] == "switch"]
    assert [s["step"] for s in switches] == [8, 16]
    assert [s["to"]["gbs"] for s in switches] == [16, 32] and all(s["seconds"] > 0 for s in switches)

    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 23))  # no gap, no repeat
    consumed = 0
    for r in steps:  # every sample exactly once, in order, across the switches
        consumed += r["gbs"]
        assert r["consumed_samples"] == consumed
    assert [r["gbs"] for r in steps] == [8] * 8 + [16] * 8 + [32] * 6
    for boundary in (8, 16):  # the loss right after a switch continues the curve
        before = [r["loss"] for r in steps[boundary - 3 : boundary]]
        after = steps[boundary]["loss"]
        assert after < max(before) + 0.25, (boundary, before, after)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    evals = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["val_ppl"] < evals[0]["val_ppl"]

    # `cona report` on this real run: its numbers are the metrics' and events' numbers.
    target = evals[len(evals) // 2]["val_ppl"] * 1.001
    first_hit = next(e for e in evals if e["val_ppl"] <= target)
    rep = subprocess.run(
        _cona("report", str(run), "--target-ppl", str(target), "--format", "json"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)["runs"][0]
    assert report["targets"][0]["reached"] and report["targets"][0]["time_s"] == pytest.approx(first_hit["time"])
    assert report["switch_overhead_s"] == pytest.approx(sum(s["seconds"] for s in switches))
    assert [t["strategy"]["gbs"] for t in report["timeline"]] == [8, 16, 32]
    assert [t["end_reason"] for t in report["timeline"]][:2] == ["chain", "chain"]


def test_ctrl_c_checkpoints_and_exits_130(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "tiny.yaml", {**TINY, "train": {**TINY["train"], "max_steps": 100000}})
    run = tmp_path / "run"
    proc = subprocess.Popen(
        _cona("train", str(cfg), "--run-dir", str(run)),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and '"step": 3,' in metrics.read_text()):
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    events = _rows(run / "events.jsonl")
    assert [e["kind"] for e in events][-2:] == ["interrupted", "exit"]
    ckpt = [e for e in events if e["kind"] == "checkpoint"][-1]
    last_step = [r for r in _rows(metrics) if r["kind"] == "step"][-1]["step"]
    assert ckpt["reason"] == "interrupt" and ckpt["step"] == last_step
    assert (Path(ckpt["path"]) / "COMMITTED").is_file()


def test_online_policy_switches_and_stops_at_target(tmp_path: Path) -> None:
    """policy cona: the controller climbs the batch ladder on its own and stops at the target."""
    # Below what gbs 8 alone reaches in the ~180 steps a standby can take to import on a loaded host, while
    # no decision is made (its import would skew the step times): the run must still be going when it is ready.
    target = 5.5
    # Easy switching for a short test: a cheap assumed switch, a low confidence level, a short dwell.
    search = {
        "gbs_min": 8,
        "gbs_max": 32,
        "mbs": [1, 2, 4, 8],
        "confidence": 0.5,
        "switch_cost_s": 1.0,
        "decision_every": 4,
        "min_steps": 4,
        "kappa": 1000.0,  # the gradient noise dominates: the most samples per second wins
        "in_place": False,  # every switch relaunches (with a standby): the other test resizes in place
    }
    run = _train_cona(tmp_path, {"max_steps": 600, "target_ppl": target}, search)
    events = _rows(run / "events.jsonl")
    assert events[0]["policy"] == "cona"
    switches = [e for e in events if e["kind"] == "switch"]
    assert switches and switches[0]["reason"] == "decision"
    assert all(s["reason"] == "decision" for s in switches)
    assert switches[0]["to"]["gbs"] > switches[0]["from"]["gbs"]
    chosen = [e for e in events if e["kind"] == "decision" and e["switch"]]
    assert chosen[0]["candidate"] == switches[0]["to"] and chosen[0]["score"] > 1.0
    assert "Φ ratio" in chosen[0]["why"] and chosen[0]["gns"] > 0
    reached = next(e for e in events if e["kind"] == "target_reached")
    assert reached["val_ppl"] <= target and reached["wall_time"] > 0
    assert events[-1]["reason"] == "target_reached"
    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    boundary = switches[0]["step"]
    before = [r["loss"] for r in steps[boundary - 3 : boundary]]
    assert steps[boundary]["loss"] < max(before) + 0.25
    assert all(r.get("gns") is None or r["gns"] > 0 for r in steps)
    # The estimator is held while Adam's second moment is young (1 / (1 - beta2) = 20 steps), then measures.
    assert all("gns" not in r for r in steps[:20]) and any(r.get("gns") for r in steps[20:])
    # The policy class, fed this run's rows and switches as the simulator feeds it, decides the same.
    replayed = replay(run)
    assert any(d["switch"] for d in replayed.recorded) and replayed.first_difference is None, replayed


def test_online_policy_resizes_in_place_without_a_relaunch_or_standby(tmp_path: Path) -> None:
    """A relaunch could never pay (its assumed cost exceeds the horizon), so only a resize into the next
    rung's batch under the running layout can happen: one launch, no standby on CPU ranks, and the steps
    go on without a gap, the new batch from the step after the resize."""
    search = {
        "gbs_min": 8,
        "gbs_max": 16,
        "mbs": [2, 4],
        "kappa": 1000.0,  # the gradient noise dominates: the most samples per second wins
        "confidence": 0.5,
        "switch_cost_s": 1000.0,
        "warm_switch_cost_s": 1000.0,
        "decision_every": 4,
        "min_steps": 4,
    }
    run = _train_cona(tmp_path, {"max_steps": 60}, search)
    events = _rows(run / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("launch") == 1 and "standby" not in kinds
    switches = [e for e in events if e["kind"] == "switch"]
    assert switches and all(e["in_place"] for e in switches), switches
    first = switches[0]
    assert first["to"]["gbs"] == 16 and first["from"]["gbs"] == 8
    assert first["seconds"] > 0 and first["decision_to_first_step_s"] > 0, first
    # Without a checkpoint to go back to, the climb writes one first: a kill after it keeps the climb.
    saved = [e for e in events if e["kind"] == "checkpoint" and e["reason"] == "resize"]
    assert [e["step"] for e in saved] == [first["step"]], saved
    assert json.loads((Path(saved[0]["path"]) / "trainer.json").read_text())["strategy"] == first["to"]
    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 61))
    assert [r["gbs"] for r in steps[first["step"] - 1 : first["step"] + 1]] == [8, 16]
    assert steps[-1]["consumed_samples"] == sum(r["gbs"] for r in steps)
    final = json.loads((run / "launches" / "001.json").read_text())
    assert final["reason"] == "max_steps" and final["consumed_samples"] == steps[-1]["consumed_samples"]
    replayed = replay(run)
    assert any(d["switch"] for d in replayed.recorded) and replayed.first_difference is None, replayed


def _train_cona(tmp_path: Path, train: dict, search: dict) -> Path:
    """`cona train` under policy cona on the tiny model; asserts exit 0 and returns the run folder."""
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["train"] = {**TINY["train"], **train}
    doc["search"] = search
    cfg = write_config(tmp_path / "cona.yaml", doc)
    run = tmp_path / "run"
    proc = subprocess.run(
        _cona("train", str(cfg), "--run-dir", str(run)), capture_output=True, text=True, timeout=400, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run
