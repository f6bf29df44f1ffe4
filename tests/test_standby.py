"""Pre-warmed standby jobs: a switch hands the next launch to a waiting torchrun job, a dead standby
falls back to a cold relaunch, and training continues exactly the same either way; a killed
controller's standby does not outlive it and `--resume` still works."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, TINY, write_config

pytestmark = pytest.mark.e2e

FIRST, STEPS = 60, 64
DOC = {
    **TINY,
    "cluster": {"procs_per_node": 2, "standby": True},
    "train": {**TINY["train"], "max_steps": STEPS},
    "chain": [
        {"dp": 2, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16, "steps": FIRST},
        {"dp": 1, "tp": 2, "pp": 1, "mbs": 2, "gbs": 16},
    ],
}
DOC.pop("strategy")


def _cona(*args: str) -> list[str]:
    return [sys.executable, "-c", "from cona_cli.app import main; main()", *args]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _events(run: Path, kind: str) -> list[dict]:
    path = run / "events.jsonl"
    return [e for e in _rows(path) if e["kind"] == kind] if path.is_file() else []


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"}


def _start(tmp: Path, name: str, doc: dict) -> tuple[subprocess.Popen, Path]:
    cfg = write_config(tmp / f"{name}.yaml", doc)
    run = tmp / name
    proc = subprocess.Popen(
        _cona("train", str(cfg), "--run-dir", str(run)),
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return proc, run


def _wait_for(predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_standby_when_started(run: Path) -> None:
    _wait_for(lambda: _events(run, "standby") != [])
    _wait_for(lambda: json.loads((run / "controller_state.json").read_text()).get("standby_pids"))
    for pgid in json.loads((run / "controller_state.json").read_text())["standby_pids"]:
        os.killpg(pgid, signal.SIGKILL)


def test_switch_hands_over_to_the_standby_or_falls_back_cold_and_continues_exactly(tmp_path: Path) -> None:
    warm, warm_run = _start(tmp_path, "warm", DOC)  # both at once: each waits mostly on its processes' start
    cold, cold_run = _start(tmp_path, "cold", DOC)  # its standby dies before the switch
    _kill_standby_when_started(cold_run)
    assert warm.wait(timeout=240) == 0, warm.stderr.read()[-3000:]
    assert cold.wait(timeout=240) == 0, cold.stderr.read()[-3000:]

    (switch,) = _events(warm_run, "switch")
    assert switch["standby"] is True and switch["step"] == FIRST
    assert {"stop", "save", "hand_over", "start", "load", "first_step"} <= set(switch["phases"])
    assert switch["decision_to_first_step_s"] > 0
    # the chain's next strategy was built while the standby waited, and the loads below match the cold run
    assert switch["prepared"] is True
    assert [e["strategy"] for e in _events(warm_run, "standby_prepare")] == [DOC["chain"][1]]
    assert [e["standby"] for e in _events(warm_run, "launch")] == [False, True]
    assert [e["standby"] for e in _events(cold_run, "launch")] == [False, False]  # the cold relaunch
    assert _events(cold_run, "switch")[0]["standby"] is False
    # the policy was told when the standby died, after a step row it names (a recorded run replays by it)
    assert [(e["launch"], e["step"] < FIRST) for e in _events(cold_run, "standby_lost")] == [(2, True)]
    assert _events(warm_run, "standby_lost") == []
    assert all(e["step"] <= FIRST for e in _events(warm_run, "standby_ready"))
    assert _events(cold_run, "switch")[0]["prepared"] is False
    warm_losses, cold_losses = _losses(warm_run), _losses(cold_run)
    assert sorted(warm_losses) == list(range(1, STEPS + 1))
    assert max(abs(warm_losses[s] - cold_losses[s]) for s in warm_losses) < 1e-6


def test_a_killed_controllers_standby_goes_and_resume_finishes(tmp_path: Path) -> None:
    doc = {**DOC, "train": {**DOC["train"], "checkpoint_interval": 10}}
    proc, run = _start(tmp_path, "run", doc)
    _wait_for(lambda: _events(run, "standby") != [])
    _wait_for(lambda: json.loads((run / "controller_state.json").read_text()).get("standby_pids"))
    state = json.loads((run / "controller_state.json").read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _wait_for(lambda: not any(_group_alive(p) for p in state["standby_pids"]), timeout=90)
    resumed = subprocess.run(
        _cona("train", "--resume", str(run)), cwd=REPO, text=True, capture_output=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max(_losses(run)) == STEPS and _events(run, "exit")[-1]["reason"] == "max_steps"
