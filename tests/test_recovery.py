"""Recovery pieces without torchrun: unusable checkpoints are skipped, torchrun failures are read,
`--resume` refuses bad input with one line and exit code 2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.control import usable_checkpoints as checkpoints
from cona_cli.control.failures import parse_failure
from cona_cli.control.policies import ChainPolicy
from cona_cli.control.run_setup import make_policy
from cona_core import rundir
from cona_core.config import ModelConfig, config_from_dict, parse_chain
from tests.support import TINY, write_config

MODEL = ModelConfig(n_layers=2, d_model=16, n_heads=2, ffn=32, seq_len=8)
VOCAB = 64


def _save(root: Path, step: int, d_model: int = 16) -> Path:
    """A checkpoint as the workers write it (one process, no process group needed)."""
    import torch.distributed.checkpoint as dcp

    from launch.models import get_spec

    model = get_spec("gpt").build(dataclasses.replace(MODEL, d_model=d_model), VOCAB)
    path = rundir.step_dir(root, step)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path))
    (path / rundir.TRAINER_STATE).write_text(json.dumps({"trainer": {"step": step, "consumed_samples": step}}))
    (path / rundir.MARKER).write_text(f"{step}\n")
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_unusable_checkpoints_are_skipped_with_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    oldest, truncated, _wrong_shape, unmarked = (
        _save(root, 4),
        _save(root, 8),
        _save(root, 12, d_model=32),
        _save(root, 16),
    )
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    (unmarked / rundir.MARKER).unlink()
    shapes = checkpoints.model_shapes(MODEL, VOCAB)
    assert checkpoints.problem(oldest, shapes) is None
    warnings: list[str] = []
    path, skipped = checkpoints.newest_usable(root, shapes, warnings.append)
    assert path == oldest and skipped == 3
    assert "step_000016" in warnings[0] and "no COMMITTED marker" in warnings[0]
    assert "step_000012" in warnings[1] and "shape" in warnings[1]
    assert "step_000008" in warnings[2] and "truncated shard" in warnings[2]
    assert sorted(p.name for p in root.iterdir()) == [
        "bad-step_000008",
        "bad-step_000012",
        "bad-step_000016",
        "step_000004",
    ]
    (oldest / rundir.TRAINER_STATE).write_text("{")
    path, skipped = checkpoints.newest_usable(root, shapes, warnings.append)
    assert path is None and skipped == 1 and "bad trainer.json" in warnings[-1]


LOG = """[default1]:loading
[default1]:[rank1]: RuntimeError: boom
[default0]:[rank0]: RuntimeError: Connection closed by peer
Failures:
[1]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
  error_file: <N/A>
"""


def test_failure_names_the_root_cause_rank_and_its_lines() -> None:
    f = parse_failure(LOG, 1)
    assert (f.rank, f.rank_exit_code, f.exit_codes) == (1, -9, {0: 1, 1: -9})
    assert f.last_lines == ["loading", "[rank1]: RuntimeError: boom"]
    assert f.describe() == "rank 1 failed first (signal SIGKILL)" and not f.bad_checkpoint
    assert parse_failure(LOG.replace("-9 (pid", "3 (pid"), 1).bad_checkpoint
    assert parse_failure("Killed\n", 137).rank is None


def test_chain_policy_restarts_in_the_stage_of_the_checkpoint() -> None:
    chain = parse_chain(
        [{"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 8, "steps": 4}, {"dp": 2, "tp": 1, "pp": 2, "mbs": 2, "gbs": 16}]
    )
    policy = ChainPolicy(chain)
    stage = policy.restart(5, policy.first())
    assert stage is not None and stage.strategy.gbs == 16 and policy.state_dict() == {"position": 1}
    other = ChainPolicy(chain)
    other.load_state_dict(policy.state_dict())
    assert other.first() == stage


def _resume(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["train", *args])
    return r.exit_code, r.output


def test_resume_refuses_bad_input_with_one_line(tiny_run_dir: Path) -> None:
    run = tiny_run_dir
    write_config(run / "config.yaml", TINY)
    cfg, _ = make_policy(config_from_dict(TINY, "tiny"))  # as `cona train` resolves it
    (run / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    (run / "events.jsonl").write_text(json.dumps({"kind": "start", "time": 0}) + "\n")
    code, out = _resume("--resume", str(run / "nope"))
    assert code == 2 and "not a run directory" in out and len(out.strip().splitlines()) == 1
    code, out = _resume("--resume", str(run), "--max-steps", "99")
    assert code == 2 and "train.max_steps differs" in out, out
    code, out = _resume("--resume", str(run), "--run-dir", str(run / "other"))
    assert code == 2 and "name one run folder" in out
    code, out = _resume()
    assert code == 2 and "CONFIG: missing" in out
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "exit", "time": 1, "reason": "max_steps"}) + "\n")
    code, out = _resume("--resume", str(run))
    assert code == 2 and "already finished (max_steps)" in out


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--strategy", "dp3-tp1-pp1-mbs2-gbs16", "world size 4"),
        ("--strategy", "dp2-banana", "--strategy"),
        ("--chain", "/nonexistent/chain.yaml", "chain.yaml"),
        ("--data", "/nonexistent/folder", "/nonexistent/folder"),
    ],
)
def test_bad_flags_exit_2_before_launching(tmp_path: Path, flag: str, value: str, message: str) -> None:
    cfg = write_config(tmp_path / "tiny.yaml", TINY)
    code, out = _resume(str(cfg), flag, value, "--run-dir", str(tmp_path / "run"))
    assert code == 2 and message in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_a_job_that_cannot_reach_the_controller_that_started_it_checkpoints_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that died while its job started leaves nobody to stop that job: its rank 0 finds the
    telemetry address dead, stops after the first step with a checkpoint, instead of training on."""
    import socket

    import torch
    import torch.distributed as dist

    from cona_core.strategy import Strategy
    from launch import worker as worker_module
    from launch.data.corpus import prepare_corpus

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("CONA_TELEMETRY_ADDR", f"127.0.0.1:{port}")
    monkeypatch.setenv("CONA_TELEMETRY_TOKEN", "t")
    doc = {**TINY, "cluster": {"procs_per_node": 1}, "strategy": "dp1-tp1-pp1-mbs2-gbs4"}
    doc["train"] = {**TINY["train"], "eval_interval": None, "max_steps": 50}
    cfg = config_from_dict(doc, "t")
    (tmp_path / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    (tmp_path / "corpus.json").write_text(prepare_corpus(cfg.data, seed=cfg.train.seed).to_json())
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        w = worker_module.Worker(cfg, tmp_path, Strategy(1, 1, 1, 2, 4), 1, torch.device("cpu"))
        result = w.train(stop_step=None, fresh=True)
    finally:
        dist.destroy_process_group()
    assert result["reason"] == "controller_lost" and result["step"] == 1, result
    assert rundir.committed(tmp_path / "checkpoints") == [rundir.step_dir(tmp_path / "checkpoints", 1)]
