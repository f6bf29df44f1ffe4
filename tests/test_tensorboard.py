"""`train.tensorboard: true`: TensorBoard's own event reader finds the metrics.jsonl and events.jsonl
numbers, across the launches of a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cona_cli.control.tensorboard_log import EVAL_TAGS, STEP_TAGS, TensorBoardLog
from tests.support import REPO, TINY, write_config


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar under `folder` as {tag: {step: value}} (the last value of a step wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
        for tag in acc.Tags()["tensors"]
    }


def test_decisions_become_scalars_at_their_step(tmp_path: Path) -> None:
    log = TensorBoardLog(tmp_path / "tb")
    decision = {"kind": "decision", "time": 3.0, "wall_clock": 1e9, "step": 10, "switch": True, "ratio": 1.25}
    log.event({**decision, "current": {"dp": 4}, "why": "Φ ratio", "gns": 12.5, "measured_t": None})
    log.event({"kind": "checkpoint", "time": 4.0, "wall_clock": 1e9, "step": 10, "seconds": 0.2})
    log.metric({"kind": "step", "step": 10, "loss": 2.5, "gns": None, "dp": 4, "wall_clock": 1e9})
    log.close()
    assert _scalars(tmp_path / "tb") == {
        "decision/switch": {10: 1.0},
        "decision/ratio": {10: 1.25},
        "decision/gns": {10: 12.5},
        "train/loss": {10: 2.5},
        "strategy/dp": {10: 4.0},
    }


@pytest.mark.e2e
def test_a_run_with_a_switch_is_in_tensorboard(tmp_path: Path) -> None:
    chain = [
        {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 8, "steps": 3},
        {"dp": 2, "tp": 1, "pp": 2, "mbs": 2, "gbs": 16},
    ]
    # beta2 0.5: the GNS estimator is held for 1 / (1 - beta2) = 2 steps after a start or a change of batch,
    # so step 3 measures it (before the switch into gbs 16 holds it again).
    train = {**TINY["train"], "max_steps": 5, "tensorboard": True, "beta2": 0.5}
    doc = {**TINY, "strategy": None, "train": train}
    cfg = write_config(tmp_path / "tiny.yaml", doc)
    (tmp_path / "chain.yaml").write_text(yaml.safe_dump({"chain": chain}))
    run = tmp_path / "run"
    cmd = ["train", str(cfg), "--chain", str(tmp_path / "chain.yaml"), "--run-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-c", "from cona_cli.app import main; main()", *cmd],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = _scalars(run / "tensorboard")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for kind, tags in (("step", STEP_TAGS), ("eval", EVAL_TAGS)):
        for field, tag in tags.items():
            expected = {r["step"]: r[field] for r in rows if r["kind"] == kind and r.get(field) is not None}
            assert scalars[tag].keys() == expected.keys(), tag
            assert all(scalars[tag][s] == pytest.approx(v, rel=1e-6) for s, v in expected.items()), tag
    assert sorted(scalars["train/loss"]) == [1, 2, 3, 4, 5] and sorted(scalars["eval/val_ppl"]) == [0, 5]
    assert sorted(scalars["gns/gns"]) == [3]
    assert [scalars["strategy/gbs"][s] for s in range(1, 6)] == [8, 8, 8, 16, 16]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    switch = next(e for e in events if e["kind"] == "switch")
    assert scalars["switch/seconds"] == {3: pytest.approx(switch["seconds"], rel=1e-6)}
