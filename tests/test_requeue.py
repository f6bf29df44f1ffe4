"""Slurm's warning before the time limit (SIGUSR1 to the batch shell, which is the controller): the
controller checkpoints, requeues its job with `scontrol requeue $SLURM_JOB_ID`, exits 0, and the
requeued script's `--resume` continues the steps exactly. Run on the local launcher, with an
`scontrol` on PATH that writes down how it was called."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cona_cli.cluster.slurm import requeue
from tests.support import REPO, TINY, write_config

STEPS = 10
DOC = {
    **TINY,
    "cluster": {"procs_per_node": 2},
    "strategy": "dp2-tp1-pp1-mbs2-gbs16",
    "train": {**TINY["train"], "max_steps": STEPS, "eval_interval": None},
}


def _cona(*args: str) -> list[str]:
    return [sys.executable, "-c", "from cona_cli.app import main; main()", *args]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _fake_scontrol(folder: Path, code: int) -> Path:
    folder.mkdir()
    tool = folder / "scontrol"
    tool.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {folder / "called"}\necho "no such job" >&2\nexit {code}\n')
    tool.chmod(0o755)
    return folder


def _signalled_run(tmp: Path, scontrol: Path) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp / "run"
    env = {**os.environ, "SLURM_JOB_ID": "4242", "PATH": f"{scontrol}:{os.environ['PATH']}"}
    env["CONA_TEST_STEP_DELAY_S"] = "0.3"
    proc = subprocess.Popen(
        _cona("train", str(write_config(tmp / "tiny.yaml", DOC)), "--run-dir", str(run)),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"step": 3,' in metrics.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "run did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run


@pytest.mark.e2e
def test_sigusr1_checkpoints_requeues_and_the_requeued_run_continues(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(tmp_path / "bin", 0)
    done, run = _signalled_run(tmp_path, scontrol)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (scontrol / "called").read_text().split() == ["requeue", "4242"]
    events = _rows(run / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds[-3:] == ["interrupted", "requeued", "exit"] and events[-1]["reason"] == "requeued"
    stopped = events[-1]["step"]
    assert 3 <= stopped < STEPS
    assert (run / "checkpoints" / f"step_{stopped:06d}" / "COMMITTED").is_file()

    resume = _cona("train", "--resume", str(run))
    resumed = subprocess.run(resume, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r for r in _rows(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in steps] == [16 * s for s in range(1, STEPS + 1)]
    launches = [e for e in _rows(run / "events.jsonl") if e["kind"] == "launch"]
    assert [e["step"] for e in launches] == [0, stopped]


def test_a_failed_requeue_says_why_in_one_line(tmp_path: Path) -> None:
    """What the controller prints before exiting 138 (interrupted; `--resume` continues)."""
    scontrol = _fake_scontrol(tmp_path / "bin", 1)
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{scontrol}:{os.environ['PATH']}"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", env["PATH"])
        assert requeue(env) == "scontrol requeue 4242: no such job"
    assert (scontrol / "called").read_text().split() == ["requeue", "4242"]
    assert requeue({}) == "not inside a Slurm job (no SLURM_JOB_ID): nothing to requeue"
