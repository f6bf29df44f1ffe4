"""`train.wandb`: what TensorBoard gets goes to a W&B run (offline mode, files under WANDB_DIR), a
`--resume` continues that run, and a config asking for it without the package is refused before launch.

wandb has no reader of its offline `.wandb` transaction log in Python, so the logged keys are looked for
in the file's bytes (protobuf keeps them as plain strings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cona_cli.control.metric_sinks import check_installed, open_sinks
from cona_core.config import ConfigError, config_from_dict
from cona_core.rundir import RunDir
from tests.support import REPO, TINY, write_config

pytest.importorskip("wandb")


def _logged(wandb_dir: Path) -> list[bytes]:
    """The bytes of each offline run's .wandb file under `wandb_dir`."""
    return [f.read_bytes() for f in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))]


def test_rows_and_events_are_logged_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    (tmp_path / "wb").mkdir()
    cfg = config_from_dict({**TINY, "train": {**TINY["train"], "wandb": {"project": "p", "mode": "offline"}}})
    files = RunDir(tmp_path / "run")
    files.path.mkdir()
    sinks = open_sinks(cfg, files)
    sinks.metric({"kind": "step", "step": 1, "loss": 2.5, "gns": None, "gbs": 16, "wall_clock": 1e9})
    sinks.metric({"kind": "eval", "step": 1, "val_loss": 2.25, "val_ppl": 9.49})
    sinks.event({"kind": "decision", "time": 3.0, "step": 1, "switch": True, "ratio": 1.25, "why": "Φ ratio"})
    sinks.event({"kind": "checkpoint", "time": 4.0, "step": 1, "seconds": 0.2})
    sinks.close()
    (log,) = _logged(tmp_path / "wb")
    for key in (b"train/loss", b"strategy/gbs", b"eval/val_ppl", b"decision/ratio", b"decision/switch", b"step"):
        assert key in log, key
    assert b"gns/gns" not in log and b"checkpoint/seconds" not in log  # no estimate; not a logged event kind
    assert b"decision/why" not in log  # text is not a scalar
    assert files.wandb_run_id.read_text() in log.decode("latin-1")

    resumed = open_sinks(cfg, files)  # `--resume`: the same W&B run
    assert resumed.sinks[0].run.id == files.wandb_run_id.read_text()
    resumed.close()


def test_train_wandb_without_the_package_is_refused_before_launch(tmp_path: Path) -> None:
    doc = {**TINY, "train": {**TINY["train"], "wandb": {"mode": "offline"}}}
    cfg = write_config(tmp_path / "c.yaml", doc)
    hide = "import sys; sys.modules['wandb'] = None; from cona_cli.app import main; main()"
    cmd = [sys.executable, "-c", hide, "train", str(cfg), "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "cona: train.wandb: needs the wandb package (pip install 'cona[wandb]')"
    assert not (tmp_path / "run").exists()


def test_bad_wandb_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.wandb: must be a mapping of project, name, mode"):
        config_from_dict({**TINY, "train": {**TINY["train"], "wandb": {"mode": "sometimes"}}})
    with pytest.raises(ConfigError, match=r"train.wandb: must be a mapping of project, name, mode"):
        config_from_dict({**TINY, "train": {**TINY["train"], "wandb": {"entity": "me"}}})
    check_installed(config_from_dict(TINY).train)  # nothing asked for, nothing checked


@pytest.mark.e2e
def test_a_run_logs_its_steps_and_evals_to_wandb(tmp_path: Path) -> None:
    train = {**TINY["train"], "max_steps": 2, "eval_interval": 2, "wandb": {"project": "cona-test", "mode": "offline"}}
    doc = {**TINY, "cluster": {"procs_per_node": 2}, "strategy": "dp2-tp1-pp1-mbs2-gbs8", "train": train}
    cfg = write_config(tmp_path / "c.yaml", doc)
    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", "train", str(cfg), "--run-dir"]
    proc = subprocess.run([*cmd, str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (log,) = _logged(tmp_path / "run")  # no WANDB_DIR: in the run folder
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"step", "eval"}
    for key in (b"train/loss", b"train/tokens_per_s", b"strategy/dp", b"eval/val_loss", b"cona-test"):
        assert key in log, key
