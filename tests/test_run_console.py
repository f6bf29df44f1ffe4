"""What a run prints: plain lines a log file can hold where the output is not a terminal, and one line per
decision, switch, checkpoint and restart (a failure that ends the run has its own line)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.control.run_console import RunConsole, event_line
from cona_core.config import config_from_dict
from cona_core.strategy import Strategy
from tests.support import TINY, write_config

S8 = Strategy.parse("dp4-tp1-pp1-mbs2-gbs8")
S16 = Strategy.parse("dp4-tp1-pp1-mbs4-gbs16")


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=200), out


def _row(step: int, **kw: object) -> dict:
    base = {"step": step, "time": 10.0 + step, "loss": 3.25, "iter_s": 0.5, "tokens_per_s": 4096.0}
    return {**base, "consumed_samples": 8 * step, "gbs": 8, **kw}


def test_events_get_one_line_each() -> None:
    decision = {"kind": "decision", "step": 25, "switch": True, "current": S8.to_dict(), "candidate": S16.to_dict()}
    assert event_line({**decision, "ratio": 1.0579, "switch_cost_s": 0.11}) == (
        f"decide  step 25: {S8} -> {S16} (Φ ratio 1.058, switch cost 0.1 s)"
    )
    assert event_line({**decision, "switch": False}) is None  # a decision to stay is in events.jsonl only
    switch = {"kind": "switch", "step": 26, "from": S8.to_dict(), "to": S16.to_dict(), "seconds": 0.109}
    assert event_line({**switch, "in_place": True}) == f"switch  step 26: {S8} -> {S16} (in place, 0.11 s)"
    assert event_line(switch) == f"switch  step 26: {S8} -> {S16} (relaunch, 0.11 s)"
    ckpt = {"kind": "checkpoint", "step": 40, "reason": "periodic", "seconds": 1.25}
    assert event_line(ckpt) == "ckpt    step 40: periodic checkpoint saved in 1.25 s"
    assert event_line({"kind": "launch", "launch": 3, "reason": "restart", "step": 40}) == (
        "launch  3: restart from step 40"
    )
    assert event_line({"kind": "launch", "launch": 2, "reason": "decision", "step": 40}) is None
    assert event_line({"kind": "failure", "launch": 2, "exit_code": 1, "rank": 3}) is None  # its own line


def test_without_a_terminal_a_plain_status_line_every_interval() -> None:
    cfg = config_from_dict({**TINY, "train": {**TINY["train"], "max_steps": 100}})
    console, out = _console(terminal=False)
    with RunConsole(console, cfg, every_s=3600.0) as rc:
        rc.eval({"val_ppl": 42.5})
        rc.step(_row(10), S8)
        rc.step(_row(11), S8)  # within the interval: not printed
        rc.event({"kind": "checkpoint", "step": 11, "reason": "final", "seconds": 0.5})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("cona: ckpt    step 11")
    fields = lines[0].split("  ")
    assert fields[:4] == ["cona: step 10", "loss 3.250", "val ppl 42.5", "4,096 tok/s"]
    assert fields[4].startswith("MFU ") and fields[5] == str(S8)
    assert fields[6] == "45 s left"  # 90 steps at 0.5 s


def test_the_mfu_is_the_models_flops_over_the_profiles_peak() -> None:
    cfg = config_from_dict(TINY)
    rc = RunConsole(_console(terminal=False)[0], cfg)
    mfu = float(rc.status(_row(1), S8).split("MFU ")[1].split("%")[0])
    assert mfu == pytest.approx(100 * 8 / 0.5 * rc.flops_per_sample / rc.peak, abs=0.05)
    assert rc.peak > 0 and rc.flops_per_sample > 0


def test_a_terminal_gets_the_bar_and_the_event_lines() -> None:
    cfg = config_from_dict(TINY)
    console, out = _console(terminal=True)
    with RunConsole(console, cfg) as rc:
        rc.step(_row(3), S8)
        rc.event({"kind": "switch", "step": 3, "from": S8.to_dict(), "to": S16.to_dict(), "seconds": 0.2})
    text = out.getvalue()
    assert "step 3" in text and "tok/s" in text and "switch  step 3" in text
    assert not rc.plain


def test_cona_train_refuses_an_unknown_log_format(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "tiny.yaml", TINY)
    result = CliRunner().invoke(app, ["train", str(cfg), "--log-format", "json", "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--log-format: must be one of auto, rich, plain" in result.stderr
    assert not (tmp_path / "r").exists()
