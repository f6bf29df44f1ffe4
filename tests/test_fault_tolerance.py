"""Killed workers, a killed or stopped controller and unloadable checkpoints lose nothing.

Each run is compared with one uninterrupted reference run of the same config: every step's final
loss within 1e-4, consumed_samples continuing from the restored checkpoint (no sample skipped), and
steps repeated only right after a restored checkpoint. Workers die through the test hook
`CONA_TEST_DIE_AT_STEP` (launch/testhooks.py); the controller is killed for real.
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

from tests.support import REPO, TINY, write_config

pytestmark = pytest.mark.e2e

STEPS, GBS = 12, 16
STRATEGY = "dp2-tp1-pp1-mbs2-gbs16"  # two ranks: half the start-up cost of TINY's four
DOC = {
    **TINY,
    "cluster": {"procs_per_node": 2},
    "strategy": STRATEGY,
    "train": {**TINY["train"], "max_steps": STEPS, "checkpoint_interval": 4},
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cona(*args: str) -> list[str]:
    return [sys.executable, "-c", "from cona_cli.app import main; main()", *args]


def job_processes(run: Path) -> list[int]:
    """Live processes whose command line names the run folder (agents, fork servers, ranks)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            named = str(run) in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if named and (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(cmdline.parent.name))
        except (OSError, IndexError):
            continue
    return found


def no_process_left(run: Path) -> bool:
    """Whether every process of the run's jobs is gone (waiting a little for the last ones to be reaped)."""
    deadline = time.monotonic() + 10
    while job_processes(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not job_processes(run)


def _train(tmp: Path, *args: str, env: dict[str, str] | None = None, doc: dict = DOC) -> subprocess.CompletedProcess:
    """`cona train` to its end; one that hangs is ended with every process of its jobs, and fails the test."""
    cfg = write_config(tmp / "tiny.yaml", doc)
    try:
        return subprocess.run(
            _cona("train", str(cfg), "--run-dir", str(tmp / "run"), *args),
            cwd=REPO,
            text=True,
            capture_output=True,
            timeout=240,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        for pid in job_processes(tmp / "run"):
            os.kill(pid, signal.SIGKILL)
        raise


def _resume(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_cona("train", "--resume", str(run)), cwd=REPO, text=True, capture_output=True, timeout=240)


def _start_and_wait(tmp: Path, step: int, save_delay_s: float = 1.0, doc: dict = DOC) -> subprocess.Popen:
    """Start a run in the background and return once metrics show `step`.

    Saves linger `save_delay_s`, so that on a fast host the run cannot reach its last step (past the next
    periodic checkpoint) before the test's signal has been acted on."""
    cfg = write_config(tmp / "tiny.yaml", doc)
    proc = subprocess.Popen(
        _cona("train", str(cfg), "--run-dir", str(tmp / "run")),
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "CONA_TEST_SAVE_DELAY_S": str(save_delay_s)},
    )
    metrics, deadline = tmp / "run" / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Loss per step of the same config, uninterrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = _train(tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in _rows(tmp / "run" / "metrics.jsonl") if r["kind"] == "step"}


def check_recovered(run: Path, reference: dict[int, float]) -> list[dict]:
    """The run reached the end as if nothing happened; returns its events."""
    events = _rows(run / "events.jsonl")
    restored = {e["launch"]: e["step"] for e in events if e["kind"] == "launch"}
    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    last, launch = 0, None
    for r in steps:
        assert r["consumed_samples"] == r["step"] * GBS, r  # every sample once, continuing after a restore
        if r["step"] != last + 1:  # repeated steps only right after the checkpoint a new launch restored
            assert r["launch"] != launch and r["step"] == restored[r["launch"]] + 1 <= last, (r, restored)
        last, launch = r["step"], r["launch"]
    final = {r["step"]: r["loss"] for r in steps}
    assert sorted(final) == list(range(1, STEPS + 1))
    for step, loss in final.items():
        assert abs(loss - reference[step]) < 1e-4, (step, loss, reference[step])
    times = [r["time"] for r in steps]
    assert times == sorted(times) and all("wall_clock" in r for r in steps)
    assert events[-1]["kind"] == "exit" and events[-1]["code"] == 0 and events[-1]["step"] == STEPS
    return events


def test_worker_killed_mid_step_is_relaunched_from_the_last_checkpoint(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    # A short interval: on a quiet host the first steps take ~20 ms each, and a time-based
    # checkpoint must land before the kill at step 8 however fast the machine is.
    doc = {**DOC, "train": {**DOC["train"], "checkpoint_interval": None, "checkpoint_interval_s": 0.05}}
    proc = _train(tmp_path, env={"CONA_TEST_DIE_AT_STEP": "8:1"}, doc=doc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = check_recovered(tmp_path / "run", reference)
    failure = next(e for e in events if e["kind"] == "failure")
    assert (failure["rank"], failure["rank_exit_code"]) == (1, -9) and not failure["bad_checkpoint"]
    periodic = [e for e in events if e["kind"] == "checkpoint" and e["time"] < failure["time"]]
    assert periodic and all(e["reason"] == "periodic" for e in periodic)  # time-based ones
    relaunch = [e for e in events if e["kind"] == "launch"][1]
    assert relaunch["reason"] == "restart" and relaunch["step"] == periodic[-1]["step"] < 8
    assert "rank 1 failed first (signal SIGKILL)" in proc.stderr


def test_worker_killed_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, reference: dict[int, float]) -> None:
    proc = _train(tmp_path, env={"CONA_TEST_DIE_AT_STEP": "8:1:save"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = check_recovered(tmp_path / "run", reference)
    assert [e["step"] for e in events if e["kind"] == "launch"] == [0, 4]  # the torn step-8 save is not used
    assert not any(e["kind"] == "warning" for e in events)  # it never looked committed
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000008", "step_000012"]


def test_background_checkpoints_let_training_go_on_and_a_torn_one_is_never_used(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """`train.checkpoint_async: true` on gloo: step 4's checkpoint is written while step 5 trains and is
    committed after it; a rank dies inside the commit of step 8's, and the restart takes step 4's."""
    doc = {**DOC, "train": {**DOC["train"], "checkpoint_async": True}}
    proc = _train(tmp_path, env={"CONA_TEST_DIE_AT_STEP": "8:1:save"}, doc=doc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = check_recovered(tmp_path / "run", reference)
    assert [e["step"] for e in events if e["kind"] == "launch"] == [0, 4]
    first = next(e for e in events if e["kind"] == "checkpoint")
    step_5 = next(r for r in _rows(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step" and r["step"] == 5)
    assert (first["step"], first["reason"]) == (4, "periodic") and first["time"] > step_5["time"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000008", "step_000012"]


def test_controller_sigkill_then_resume(tmp_path: Path, reference: dict[int, float]) -> None:
    proc = _start_and_wait(tmp_path, 3)
    proc.kill()
    proc.communicate(timeout=30)
    run = tmp_path / "run"
    state = json.loads((run / "controller_state.json").read_text())
    assert state["stage"]["strategy"] == STRATEGY and state["launch"] == 1
    resumed = _resume(run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = check_recovered(run, reference)
    resume = next(e for e in events if e["kind"] == "resume")
    launch = [e for e in events if e["kind"] == "launch"][-1]
    assert launch["reason"] == "resume" and launch["launch"] == 2 and launch["step"] == resume["step"] >= 3
    # run time continues where it stopped; the stopped gap (the controller dead, the resumed one starting)
    # only shows in the wall clock
    last = max(
        (r for r in _rows(run / "metrics.jsonl") if r["wall_clock"] < resume["wall_clock"]), key=lambda r: r["time"]
    )
    assert 0 <= resume["time"] - last["time"] < resume["wall_clock"] - last["wall_clock"]


def test_controller_sigterm_exits_143_and_resumes_past_an_unloadable_checkpoint(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    proc = _start_and_wait(tmp_path, 6)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    run = tmp_path / "run"
    events = _rows(run / "events.jsonl")
    assert [e["kind"] for e in events][-2:] == ["interrupted", "exit"] and events[-2]["signal"] == "SIGTERM"
    *_, older, newest = (e for e in events if e["kind"] == "checkpoint")
    newest = Path(newest["path"])
    for shard in newest.glob("*.distcp"):  # same size, garbage inside: only loading can tell
        shard.write_bytes(b"\0" * shard.stat().st_size)
    resumed = _resume(run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = check_recovered(run, reference)
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["bad_checkpoint"] and failure["rank_exit_code"] == 3, (failure, resumed.stderr[-3000:])
    assert any(e["kind"] == "warning" and newest.name in e["message"] for e in events)
    assert [e["step"] for e in events if e["kind"] == "launch"][-1] == older["step"]
    assert (newest.parent / f"bad-{newest.name}").is_dir()


def test_a_second_sigterm_kills_the_workers_keeps_the_committed_checkpoints_and_the_run_resumes(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """The first signal asks for a checkpoint (each save lingers 1 s here); the second, before it can be
    committed, kills the workers at once: the run exits 143 without a traceback, the half-written
    checkpoint is never used, and the resumed run ends as if nothing happened."""
    proc = _start_and_wait(tmp_path, 6)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)  # well inside the 120 s a checkpointing worker is given
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    run = tmp_path / "run"
    assert no_process_left(run)
    events = _rows(run / "events.jsonl")
    assert [e["kind"] for e in events][-2:] == ["interrupted", "exit"]
    saved = [e for e in events if e["kind"] == "checkpoint"]
    assert saved and all(e["reason"] != "interrupt" and (Path(e["path"]) / "COMMITTED").is_file() for e in saved)
    resumed = _resume(run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = check_recovered(run, reference)
    assert [e["step"] for e in events if e["kind"] == "launch"][-1] == saved[-1]["step"]


def test_gives_up_after_max_restarts(tmp_path: Path) -> None:
    doc = {**DOC, "train": {**DOC["train"], "max_restarts": 0}}
    proc = _train(tmp_path, env={"CONA_TEST_DIE_AT_STEP": "2:0"}, doc=doc)
    assert proc.returncode == 1
    assert "giving up: 1 failed launches within 3600 s (train.max_restarts = 0)" in proc.stderr
    events = _rows(tmp_path / "run" / "events.jsonl")
    assert [e["kind"] for e in events][-2:] == ["failure", "exit"] and events[-1]["reason"] == "failed"


def test_a_stray_sigterm_to_one_rank_is_a_failure_recovered_and_the_run_ends_by_its_rule(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """SIGTERM to rank 1 alone (not from its agent, not asked for by the controller): every rank stops after
    that step with a checkpoint, the launch fails, the restart continues from that checkpoint, and the run
    ends at max_steps with nothing of its jobs left (the signalled rank once left while the others and
    their agent waited for it for ever)."""
    proc = _train(tmp_path, env={"CONA_TEST_DIE_AT_STEP": "6:1:step:TERM"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = check_recovered(tmp_path / "run", reference)
    assert events[-1]["reason"] == "max_steps"
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["launch"] == 1 and failure["rank"] == 1, failure
    relaunch = [e for e in events if e["kind"] == "launch"][1]
    assert relaunch["reason"] == "restart" and relaunch["step"] == 6  # the checkpoint every rank saved on it
    assert no_process_left(tmp_path / "run")


def test_a_dropped_telemetry_connection_is_restarted_not_done(tmp_path: Path, reference: dict[int, float]) -> None:
    """Rank 0's telemetry connection closes under a running job: the job checkpoints and stops on its own,
    which the controller did not ask for, so it restarts the run (a `done` run could not be resumed)."""
    proc = _train(tmp_path, env={"CONA_TEST_DISCONNECT_AT_STEP": "6"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = check_recovered(tmp_path / "run", reference)
    assert events[-1]["reason"] == "max_steps"
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["launch"] == 1 and failure["exit_code"] == 0, failure
    relaunch = [e for e in events if e["kind"] == "launch"][1]
    assert relaunch["reason"] == "restart" and relaunch["step"] == 6
    assert no_process_left(tmp_path / "run")


def test_a_relaunch_after_an_agent_kill_starts_once_the_old_ranks_are_gone(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """SIGKILL the torchrun agent: its ranks get SIGTERM and checkpoint on their way out (saves linger 10 s
    here, twice as long as the controller waits for a dead agent's output; no periodic ones). The restart waits
    for them: it starts from the checkpoint they wrote, and no row of the old launch follows the new
    launch's first."""
    run = tmp_path / "run"
    doc = {**DOC, "train": {**DOC["train"], "checkpoint_interval": None}}
    proc = _start_and_wait(tmp_path, 5, save_delay_s=10.0, doc=doc)
    try:
        os.kill(json.loads((run / "controller_state.json").read_text())["agent_pids"][0], signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        for pid in job_processes(run) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    events = check_recovered(run, reference)
    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    first_new = next(i for i, r in enumerate(steps) if r["launch"] == 2)
    assert all(r["launch"] == 2 for r in steps[first_new:])  # no row of the old launch after the new one's first
    relaunch = [e for e in events if e["kind"] == "launch"][1]
    assert relaunch["reason"] == "restart" and relaunch["step"] == steps[first_new - 1]["step"] > 5
    assert no_process_left(run)
