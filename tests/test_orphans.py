"""No process of a job outlives its torchrun agent or its controller, and `--resume` never runs beside
a live job of the same run folder (issue #25).

The job's processes are found as `--resume` finds them: every process whose command line names the
run folder (`control.runstate.job_processes`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cona_cli.control import usable_checkpoints
from cona_cli.control.runstate import job_processes, stop_job
from launch.committed import MARKER, TRAINER_STATE, committed, not_committed
from tests.support import REPO, TINY, write_config

STEPS = 8
DOC = {
    **TINY,
    "cluster": {"procs_per_node": 2},
    "strategy": "dp2-tp1-pp1-mbs2-gbs16",
    "train": {**TINY["train"], "max_steps": STEPS, "checkpoint_interval": 2, "eval_interval": None},
}


def _cona(*args: str) -> list[str]:
    return [sys.executable, "-c", "from cona_cli.app import main; main()", *args]


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _start(tmp: Path, step: int) -> tuple[subprocess.Popen, Path]:
    """A tiny two-rank run in the background (steps linger 0.3 s), returned once metrics show `step`."""
    run = tmp / "run"
    proc = subprocess.Popen(
        _cona("train", str(write_config(tmp / "tiny.yaml", DOC)), "--run-dir", str(run)),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "CONA_TEST_STEP_DELAY_S": "0.3"},
    )
    metrics = run / "metrics.jsonl"
    assert _wait(lambda: metrics.exists() and f'"step": {step},' in metrics.read_text(), 120), "run did not start"
    return proc, run


def _alive(pids: set[int]) -> set[int]:
    live = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            live.add(pid)
    return live


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_sigkilled_agent_takes_its_ranks_with_it(tmp_path: Path) -> None:
    controller, run = _start(tmp_path, 2)
    try:
        agent = json.loads((run / "controller_state.json").read_text())["agent_pids"][0]
        job = set(job_processes(run, [agent])) - {controller.pid}
        assert agent in job and len(job) >= 4  # the agent, its fork server and two ranks
        os.kill(agent, signal.SIGKILL)
        assert _wait(lambda: not _alive(job), 5), f"outlived their agent: {sorted(_alive(job))}"
    finally:
        controller.kill()
        controller.wait(timeout=30)
        assert stop_job(run, [], 10.0) == []  # the relaunched job dies with the controller (or is killed here)


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_sigkilled_controller_takes_its_job_with_it_and_resume_continues(tmp_path: Path) -> None:
    controller, run = _start(tmp_path, 3)
    job = set(job_processes(run, [])) - {controller.pid}
    assert len(job) >= 4
    controller.kill()
    controller.wait(timeout=30)
    # Gone in ~30 s today: the agent gets SIGTERM at once, but its ranks, stopped and checkpointed
    # after the next step, linger until torchrun SIGKILLs them at the end of its 30 s close timeout.
    assert _wait(lambda: not _alive(job), 45), f"outlived their controller: {sorted(_alive(job))}"
    resume = _cona("train", "--resume", str(run))
    resumed = subprocess.run(resume, cwd=REPO, text=True, capture_output=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    launches = {e["launch"]: e["step"] for e in _rows(run / "events.jsonl") if e["kind"] == "launch"}
    assert sorted({r["step"] for r in steps}) == list(range(1, STEPS + 1))
    assert len(launches) == 2 and launches[2] >= 2  # resumed from a checkpoint the first job committed
    for r in steps:  # one job at a time: every step of the second launch follows its checkpoint
        assert r["consumed_samples"] == r["step"] * 16, r
        if r["launch"] == 2:
            assert r["step"] > launches[2], r
    times = [r["wall_clock"] for r in steps]
    assert times == sorted(times)  # no two jobs appending side by side


def test_resume_gives_up_on_a_job_it_cannot_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run.mkdir()
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--run-dir", str(run)])
    try:
        assert _wait(lambda: fake.pid in job_processes(run, []), 5)
        monkeypatch.setattr("cona_cli.control.runstate.KILL_WAIT_S", 0.5)
        monkeypatch.setattr("cona_cli.control.runstate._kill", lambda send, target: None)  # e.g. another user's
        assert stop_job(run, [], 0.2) == [fake.pid]
        monkeypatch.undo()
        assert stop_job(run, [], 0.2) == []
        assert fake.wait(timeout=5) == -signal.SIGKILL
    finally:
        fake.kill()


def test_the_controller_and_the_workers_share_one_definition_of_committed(tmp_path: Path) -> None:
    good, torn, bare = (tmp_path / f"step_00000{i}" for i in (3, 2, 1))
    for d in (good, torn, bare):
        d.mkdir()
    (good / TRAINER_STATE).write_text(json.dumps({"trainer": {"step": 3, "consumed_samples": 48}}))
    (good / MARKER).write_text("3\n")
    (torn / TRAINER_STATE).write_text("{")
    (torn / MARKER).write_text("2\n")
    assert not_committed(good) is None and committed(tmp_path) == [good]
    assert not_committed(bare) == f"no {MARKER} marker"
    assert not_committed(torn).startswith(f"bad {TRAINER_STATE}")
    for d in (torn, bare):  # the controller skips exactly what a worker would refuse to load
        assert usable_checkpoints.problem(d, None) == not_committed(d)
