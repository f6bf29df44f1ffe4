"""The virtual clock end to end: two runs of one config and seed under policy cona, the second beside a
CPU-bound process, make the same decisions at the same steps and write the same rows. The embedded
default as `make demo` runs it (here on the virtual clock), and its console without a terminal: plain
status lines and a line per decision and switch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.e2e

ROW_KEYS = ("kind", "step", "time", "iter_s", "loss", "val_ppl", "gbs", "mbs", "consumed_samples", "launch")
BURN = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    sum(range(10000))\n"


def _train(run: Path) -> str:
    args = ["--set", "train.clock=virtual", "--set", "train.max_steps=200", "--run-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-c", "from cona_cli.app import main; main()", "train", "configs/tiny.yaml", *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows(run: Path) -> list[dict]:
    return [{k: r.get(k) for k in ROW_KEYS} for r in _lines(run / "metrics.jsonl")]


def _decisions(run: Path) -> list[tuple]:
    kinds = ("decision", "switch", "target_reached", "exit")
    keep = ("time", "step", "switch", "ratio", "to", "seconds", "reason", "val_ppl")  # time: the virtual clock's
    return [(e["kind"], *(e.get(k) for k in keep)) for e in _lines(run / "events.jsonl") if e["kind"] in kinds]


def test_two_runs_agree_step_for_step_whatever_the_hosts_load(tmp_path: Path) -> None:
    console = _train(tmp_path / "idle")
    burner = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        _train(tmp_path / "loaded")
    finally:
        burner.kill()
        burner.wait()
    idle, loaded = _rows(tmp_path / "idle"), _rows(tmp_path / "loaded")
    assert idle == loaded
    assert _decisions(tmp_path / "idle") == _decisions(tmp_path / "loaded")
    switches = [d for d in _decisions(tmp_path / "idle") if d[0] == "switch"]
    assert switches, "policy cona switched at least once"
    assert all(d[6] > 0 for d in switches)  # an in-place resize is charged one step
    step_time = {r["step"]: r["time"] for r in idle if r["kind"] == "step"}
    decided = [d for d in _decisions(tmp_path / "idle") if d[0] == "decision"]
    assert decided and all(d[1] == pytest.approx(step_time[d[2]], abs=1e-3) for d in decided)  # the row's clock
    walls = [r["wall_time"] for r in _lines(tmp_path / "loaded" / "metrics.jsonl") if r["kind"] == "step"]
    assert all(w is not None for w in walls)  # the host's time stays beside the virtual one
    lines = console.splitlines()
    decided = [line for line in lines if line.startswith("cona: decide  step ")]
    switched = [line for line in lines if line.startswith("cona: switch  step ")]
    assert len(switched) == len(switches) and len(decided) >= len(switches)
    assert f"step {switches[0][2]}:" in switched[0] and "(in place," in switched[0]
    status = [line for line in lines if line.startswith("cona: step ")]
    assert status and all(" tok/s  MFU " in line and " s left" in line for line in status)
    clock = json.loads((tmp_path / "idle" / "clock.json").read_text())
    assert clock["source"] == "measured" and len(clock["table"]) == len({r["gbs"] for r in idle if r["gbs"]})
