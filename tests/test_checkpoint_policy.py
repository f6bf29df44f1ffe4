"""Periodic checkpoints on by default (time-based, capped share of wall time), restarts after an
in-place resize at the checkpoint's own batch, and saves that cannot write (disk full, not writable)
that keep the last good checkpoint, stop the run with one line and exit STORAGE_EXIT, and resume."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cona_cli.control import failures
from cona_cli.control.policies import Stage
from cona_cli.control.recovery import Recovery
from cona_core import rundir
from cona_core.config import ConfigError, TrainConfig, config_from_dict
from cona_core.exits import STORAGE_EXIT
from cona_core.strategy import Strategy
from tests.support import REPO, TINY, write_config

STRATEGY = "dp2-tp1-pp1-mbs2-gbs16"


def test_periodic_checkpoints_are_on_by_default_and_the_share_is_checked() -> None:
    t = TrainConfig()
    assert (t.checkpoint_interval_s, t.checkpoint_max_share, t.checkpoint_interval) == (600.0, 0.02, None)
    with pytest.raises(ConfigError, match="checkpoint_max_share.*must be in \\(0, 1\\]"):
        config_from_dict({**TINY, "train": {**TINY["train"], "checkpoint_max_share": 0}})
    off = config_from_dict({**TINY, "train": {**TINY["train"], "checkpoint_interval_s": None}})
    assert off.train.checkpoint_interval_s is None


def test_a_storage_failure_is_read() -> None:
    line = "cona-worker: checkpoint not saved: cannot write checkpoint /r/.tmp-step_000008: no space left on device"
    log = f"[default0]:{line}\nRoot Cause (first observed failure):\n  rank : 0 (local_rank: 0)\n  exitcode : 5\n"
    failure = failures.parse_failure(log, 1)
    assert failure.storage == line.removeprefix("cona-worker: ")
    assert failure.refusal is None and not failure.out_of_memory and not failure.bad_checkpoint


@pytest.fixture
def one_process(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_save_that_cannot_write_keeps_the_last_good_checkpoint(
    tmp_path: Path, one_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import torch.distributed.checkpoint.filesystem as fs

    from launch import checkpoint

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        path, seconds, nbytes = checkpoint.save(
            root, step, model, opt, {"trainer": {"step": step, "consumed_samples": 8 * step}}, keep=1
        )
        assert (path / rundir.MARKER).is_file() and seconds > 0 and nbytes > 0
    assert [p.name for p in rundir.committed(root)] == ["step_000002"]  # step 1 pruned after 2 committed

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root / ".tmp-step_000003" / "__0_0.distcp"))

    monkeypatch.setattr(fs, "_write_item", full)  # inside DCP's own write: it reaches us as CheckpointException
    with pytest.raises(checkpoint.SaveError) as raised:
        checkpoint.save(root, 3, model, opt, {"trainer": {"step": 3, "consumed_samples": 24}}, keep=1)
    said = str(raised.value)
    assert "\n" not in said and ".tmp-step_000003/__0_0.distcp: no space left on device; needs about" in said
    assert f"the last good checkpoint {root / 'step_000002'} is kept" in said
    monkeypatch.undo()
    monkeypatch.setenv("CONA_TEST_SAVE_ERRNO", "3:EACCES")  # rank 0's commit step
    with pytest.raises(checkpoint.SaveError, match=r"trainer.json: permission denied; .* must be writable"):
        checkpoint.save(root, 3, model, opt, {"trainer": {"step": 3, "consumed_samples": 24}}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # kept, no temporary folder left
    assert (root / "step_000002" / rundir.MARKER).is_file()


class _Policy:
    in_place = True

    def __init__(self) -> None:
        self.moved: list[Stage] = []

    def after_launch(self, outcome: dict, requested: Stage | None) -> Stage | None:
        self.moved.append(requested)
        return requested


def _checkpoint(root: Path, step: int, strategy: str) -> Path:
    path = rundir.step_dir(root, step)
    path.mkdir(parents=True)
    state = {"trainer": {"step": step, "consumed_samples": 8 * step}, "strategy": Strategy.parse(strategy).to_dict()}
    (path / rundir.TRAINER_STATE).write_text(json.dumps(state))
    (path / rundir.MARKER).write_text(f"{step}\n")
    return path


def test_a_restart_runs_the_batch_in_force_when_its_checkpoint_was_taken(tmp_path: Path) -> None:
    policy = _Policy()
    ctl = SimpleNamespace(policy=policy)
    resized = Stage(Strategy.parse("dp2-tp1-pp1-mbs4-gbs16"), None, "ramp")
    before = _checkpoint(tmp_path, 4, "dp2-tp1-pp1-mbs2-gbs8")  # taken before the resize
    stage = Recovery.batch_at(ctl, before, resized)
    assert str(stage.strategy) == "dp2-tp1-pp1-mbs2-gbs8" and policy.moved == [stage]
    after = _checkpoint(tmp_path, 9, "dp2-tp1-pp1-mbs4-gbs16")  # taken after it: unchanged
    assert Recovery.batch_at(ctl, after, resized) is resized
    other_layout = _checkpoint(tmp_path, 12, "dp1-tp2-pp1-mbs2-gbs8")  # a relaunch's layout: the policy's stage
    assert Recovery.batch_at(ctl, other_layout, resized) is resized
    policy.in_place = False
    assert Recovery.batch_at(ctl, before, resized) is resized and len(policy.moved) == 1


# -- end to end (torchrun, two ranks) --------------------------------------------------------------


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cona(tmp: Path, doc: dict | None, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", "train"]
    if doc is not None:
        cmd += [str(write_config(tmp / "tiny.yaml", doc)), "--run-dir", str(tmp / "run")]
    cmd += list(args)
    return subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=240, env={**os.environ, **(env or {})})


def _check_continuous(run: Path, steps: int) -> list[dict]:
    """Every step 1..steps ran, and each launch's first step continues the data exactly."""
    rows = [r for r in _rows(run / "metrics.jsonl") if r.get("kind") == "step"]
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    by_step: dict[int, dict] = {}
    for r in rows:
        prev = by_step.get(r["step"] - 1)
        if prev is not None:  # the row that ran right before this one's data, in whichever launch
            assert r["consumed_samples"] == prev["consumed_samples"] + r["gbs"], (prev, r)
        by_step.setdefault(r["step"], r)
    return rows


@pytest.mark.e2e
def test_disk_full_stops_the_run_keeps_the_last_checkpoint_and_resumes(tmp_path: Path) -> None:
    doc = {
        **TINY,
        "cluster": {"procs_per_node": 2},
        "strategy": STRATEGY,
        "train": {**TINY["train"], "max_steps": 10, "checkpoint_interval": 4, "eval_interval": None},
    }
    proc = _cona(tmp_path, doc, env={"CONA_TEST_SAVE_ERRNO": "8:ENOSPC"})
    run = tmp_path / "run"
    assert proc.returncode == STORAGE_EXIT, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())  # rich may wrap the line
    assert "checkpoint not saved: cannot write checkpoint" in err and "no space left on device; needs about" in err
    assert "the last good checkpoint" in err and "step_000004 is kept" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004"]
    events = _rows(run / "events.jsonl")
    assert events[-1]["kind"] == "exit" and events[-1]["reason"] == "failed"
    assert len([e for e in events if e["kind"] == "launch"]) == 1  # no relaunch into the same full disk
    resumed = _cona(tmp_path, None, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = _rows(run / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "launch"] == [0, 4]
    assert events[-1]["kind"] == "exit" and events[-1]["code"] == 0 and events[-1]["step"] == 10
    _check_continuous(run, 10)


@pytest.mark.e2e
def test_restart_after_a_resize_continues_from_a_periodic_checkpoint_at_its_batch(tmp_path: Path) -> None:
    # ramp 8 -> 16 after 48 samples: an in-place resize before step 7. Time-based checkpoints at the
    # default rule, made short (0.05 s, saves allowed the whole share), then a rank dies at step 14.
    train = {**TINY["train"], "max_steps": 16, "eval_interval": None, "rampup_batch_size": [8, 8, 48]}
    train |= {"checkpoint_interval_s": 0.05, "checkpoint_max_share": 1.0, "checkpoint_keep": 50}
    doc = {**TINY, "policy": "ramp", "cluster": {"procs_per_node": 2}, "strategy": STRATEGY, "train": train}
    # Steps linger 0.4 s so that saves (each stretching the wait to its own duration) fall between
    # step 7 and step 14 on a host of any speed.
    proc = _cona(tmp_path, doc, env={"CONA_TEST_DIE_AT_STEP": "14:1", "CONA_TEST_STEP_DELAY_S": "0.4"})
    run = tmp_path / "run"
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = _rows(run / "events.jsonl")
    switch = next(e for e in events if e["kind"] == "switch")
    assert switch["in_place"] and switch["to"]["gbs"] == 16 and switch["step"] >= 6
    failure = next(e for e in events if e["kind"] == "failure")
    periodic = [e for e in events if e["kind"] == "checkpoint" and e["time"] < failure["time"]]
    assert periodic and all(e["reason"] == "periodic" for e in periodic)
    relaunch = [e for e in events if e["kind"] == "launch"][1]
    assert relaunch["reason"] == "restart" and relaunch["step"] == periodic[-1]["step"]
    saved = json.loads((Path(periodic[-1]["path"]) / rundir.TRAINER_STATE).read_text())
    assert relaunch["strategy"] == saved["strategy"]  # the batch in force when it was taken
    assert relaunch["step"] > switch["step"] and relaunch["strategy"]["gbs"] == 16, (relaunch, switch)
    rows = _check_continuous(run, 16)
    again = [r for r in rows if r["launch"] == relaunch["launch"]]
    assert again[0]["consumed_samples"] == saved["trainer"]["consumed_samples"] + 16
    assert {r["gbs"] for r in again} == {16}
    first = {r["step"]: r for r in rows if r["launch"] == 1}
    assert first[relaunch["step"]]["gbs"] == 16  # the killed launch ran the checkpointed step at that batch
    overhead = sum(e["seconds"] for e in periodic) / max(e["time"] for e in periodic)
    print(f"periodic saves: {len(periodic)}, {overhead:.1%} of run time at share 1.0")
