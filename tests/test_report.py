"""`cona report` on synthetic run directories written exactly as docs/run-dir.md describes."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from cona_cli.commands.report_command import report_command
from cona_cli.report.build import build_report, timeline
from cona_cli.report.runlog import read_run
from cona_core.strategy import Strategy

A, B, C = "dp4-tp1-pp1-mbs2-gbs16", "dp2-tp1-pp2-mbs2-gbs32", "dp4-tp1-pp1-mbs4-gbs64"
SEQ_LEN = 64


class RunBuilder:
    """Writes a run directory the way the controller and rank 0 would, with a simulated clock."""

    def __init__(
        self,
        root: Path,
        name: str,
        policy: str = "cona",
        seq_len: int | None = SEQ_LEN,
        target_ppl: float | None = None,
    ) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True)
        config: dict[str, Any] = {
            "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "ffn": 256},
            "train": {"lr": 1e-3, "target_ppl": target_ppl},
            "policy": policy,
        }
        if seq_len is not None:
            config["model"]["seq_len"] = seq_len
        (self.dir / "config.resolved.json").write_text(json.dumps(config))
        self.metrics: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.t, self.step, self.samples, self.launches = 0.0, 0, 0, 0
        self.strategy: Strategy | None = None
        self.event("start", config="tiny.yaml", policy=policy, world=4)

    def tick(self, seconds: float) -> None:
        self.t = round(self.t + seconds, 9)  # keeps the simulated clock free of float drift

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, "time": self.t, **fields})

    def launch(self, strategy: str, startup: float = 2.0) -> None:
        self.launches += 1
        self.strategy = Strategy.parse(strategy)
        ckpt = f"checkpoints/step_{self.step:06d}" if self.step else None
        self.event(
            "launch", launch=self.launches, strategy=self.strategy.to_dict(), from_checkpoint=ckpt, step=self.step
        )
        self.tick(startup)

    def train(self, n: int, iter_s: float = 1.0, gns: float | None = None) -> None:
        s = self.strategy
        for _ in range(n):
            self.step += 1
            self.tick(iter_s)
            self.samples += s.gbs
            row = {
                "kind": "step",
                "step": self.step,
                "time": self.t,
                "loss": 3.0,
                "lr": 1e-3,
                **s.to_dict(),
                "iter_s": iter_s,
                "tokens_per_s": s.gbs * SEQ_LEN / iter_s,
                "consumed_samples": self.samples,
                "grad_norm": 1.0,
                "launch": self.launches,
            }
            if gns is not None:
                row["gns"] = gns + self.step
            self.metrics.append(row)

    def eval(self, ppl: float) -> None:
        self.metrics.append(
            {
                "kind": "eval",
                "step": self.step,
                "time": self.t,
                "val_loss": math.log(ppl),
                "val_ppl": ppl,
                "consumed_samples": self.samples,
            }
        )

    def switch(self, to: str, seconds: float, reason: str = "chain", **decision: Any) -> None:
        """Checkpoint, exit, relaunch: the first step under `to` ends `seconds + iter_s` later."""
        target = Strategy.parse(to)
        if reason == "decision":
            self.event("decision", candidate=target.to_dict(), switch=True, why="phi ratio", **decision)
        self.event(
            "checkpoint",
            step=self.step,
            path=f"checkpoints/step_{self.step:06d}",
            seconds=0.5,
            bytes=4096,
            reason="switch",
        )
        self.event(
            "switch",
            step=self.step,
            seconds=seconds,
            reason=reason,
            **{"from": self.strategy.to_dict(), "to": target.to_dict()},
        )
        t0 = self.t
        self.tick(seconds / 2)
        self.launch(to, startup=seconds / 2)
        self.t = t0
        self.tick(seconds)

    def exit(self, reason: str, code: int = 0) -> None:
        self.event("exit", code=code, reason=reason, step=self.step)

    def write(self, torn_last: bool = False, torn_middle: bool = False) -> Path:
        lines = [json.dumps(m) for m in self.metrics]
        if torn_middle:
            lines.insert(len(lines) // 2, '{"kind": "step", "st')
        text = "\n".join(lines) + "\n"
        if torn_last:
            text += '{"kind": "step", "step": 99, "ti'
        (self.dir / "metrics.jsonl").write_text(text)
        (self.dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.events))
        return self.dir


def static_run(root: Path) -> Path:
    """Baseline: ppl 20 first reached at t=42 s, step 40."""
    r = RunBuilder(root, "static", policy="static")
    r.launch(A)
    for ppl in (60, 40, 25, 18):
        r.train(10)
        r.eval(ppl)
    r.exit("max_steps")
    return r.write()


def chained_run(root: Path) -> Path:
    """Reaches ppl 20 after two switches (chain, then decision), at t=34 s."""
    r = RunBuilder(root, "chained")
    r.launch(A)
    r.train(10, iter_s=0.5, gns=100)
    r.eval(50)
    r.switch(B, seconds=3.0)
    r.train(10, iter_s=0.8, gns=200)
    r.eval(30)
    r.switch(C, seconds=4.0, reason="decision", ratio=1.25, predicted_t=1.1)
    r.train(10, iter_s=1.2, gns=300)
    r.eval(19)
    r.event("target_reached", step=r.step, val_ppl=19, target_ppl=20)
    r.exit("target_reached")
    return r.write()


def early_run(root: Path) -> Path:
    """Reaches ppl 20 at t=12 s, before its first switch."""
    r = RunBuilder(root, "early")
    r.launch(A)
    r.train(10)
    r.eval(15)
    r.switch(B, seconds=5.0)
    r.train(5)
    r.eval(14)
    r.exit("max_steps")
    return r.write()


def never_run(root: Path) -> Path:
    """Never reaches ppl 20; best 60 at t=22 s."""
    r = RunBuilder(root, "never", policy="chain")
    r.launch(A)
    for ppl in (80, 60):
        r.train(10)
        r.eval(ppl)
    r.exit("max_steps")
    return r.write()


def crashed_run(root: Path, torn_middle: bool = False) -> Path:
    """A worker failed, was relaunched under the same strategy; then everything died mid-line."""
    r = RunBuilder(root, "crashed")
    r.launch(A)
    r.train(10, gns=10)
    r.eval(45)
    r.event("failure", launch=1, exit_code=1, rank=0, last_lines=["boom"])
    r.launch(A)
    r.train(5, gns=10)
    return r.write(torn_last=True, torn_middle=torn_middle)


def running_run(root: Path) -> Path:
    """Still training after one switch: no exit event."""
    r = RunBuilder(root, "running")
    r.launch(A)
    r.train(5)
    r.eval(70)
    r.switch(B, seconds=2.0)
    r.train(3)
    return r.write()


def cli(*args: str) -> Any:
    app = typer.Typer()
    app.callback()(lambda: None)  # keep `report` a subcommand
    app.command("report")(report_command)
    return CliRunner().invoke(app, ["report", *args])


def test_time_to_target_against_metrics(tmp_path: Path) -> None:
    dirs = [f(tmp_path) for f in (static_run, chained_run, early_run, never_run)]
    report = build_report([read_run(d) for d in dirs], [20.0])
    assert report.baseline == "static"  # the only static run
    static, chained, early, never = report.runs
    s = static.targets[0]
    assert (s.time_s, s.step, s.tokens) == (42, 40, 640 * SEQ_LEN)
    t = chained.targets[0]  # samples: 10 steps each of gbs 16, 32, 64
    assert (t.reached, t.time_s, t.step, t.samples, t.tokens) == (True, 34, 30, 1120, 1120 * SEQ_LEN)
    assert t.speedup == pytest.approx(42 / 34)
    assert (chained.switches, chained.switch_overhead_s) == (2, 7.0)
    assert chained.switch_overhead_pct == pytest.approx(100 * 7 / 34)
    assert (chained.final_ppl, chained.exit_reason, chained.policy) == (19, "target_reached", "cona")
    assert (early.targets[0].time_s, early.targets[0].speedup) == (12, pytest.approx(3.5))
    assert early.switches == 1 and early.switch_overhead_s == 5.0
    n = never.targets[0]
    assert (n.reached, n.time_s, n.speedup, n.best_ppl, n.best_time_s) == (False, None, None, 60, 22)
    assert static.targets[0].speedup == 1.0


def test_default_targets(tmp_path: Path) -> None:
    logs = [read_run(static_run(tmp_path)), read_run(never_run(tmp_path))]
    report = build_report(logs)
    assert report.targets == (60,) and report.target_source == "best reached by every run"
    assert [r.targets[0].time_s for r in report.runs] == [12, 22]
    r = RunBuilder(tmp_path, "configured", target_ppl=30)
    r.launch(A)
    r.train(3)
    r.eval(29)
    report = build_report([read_run(r.write())])
    assert report.targets == (30,) and report.target_source == "config"


def test_timeline_of_a_chain(tmp_path: Path) -> None:
    stages = timeline(read_run(chained_run(tmp_path)))
    assert [str(s.strategy) for s in stages] == [A, B, C]
    assert [(s.first_step, s.last_step, s.steps) for s in stages] == [(1, 10, 10), (11, 20, 10), (21, 30, 10)]
    assert [s.start_s for s in stages] == [0, 8.5, 20]  # launch events
    assert [s.end_s for s in stages] == [7, 18, 34]
    assert [s.median_iter_s for s in stages] == [0.5, 0.8, 1.2]
    assert [s.predicted_iter_s for s in stages] == [None, None, 1.1]
    assert [(s.gns_entry, s.gns_exit) for s in stages] == [(101, 110), (211, 220), (321, 330)]
    assert [s.end_reason for s in stages] == ["chain", "decision (ratio 1.25)", "target_reached"]
    assert [s.switch_s for s in stages] == [3.0, 4.0, None]


def test_strategy_change_in_step_rows_starts_a_stage(tmp_path: Path) -> None:
    r = RunBuilder(tmp_path, "inplace")
    r.launch(A)
    r.train(4)
    r.strategy = Strategy.parse(B)  # changed without relaunch
    r.train(4)
    stages = timeline(read_run(r.write()))
    assert [(str(s.strategy), s.steps, s.end_reason) for s in stages] == [
        (A, 4, "strategy change"),
        (B, 4, "no exit event"),
    ]
    assert stages[1].start_s == 6.0


def test_crashed_and_running_runs(tmp_path: Path) -> None:
    crashed = read_run(crashed_run(tmp_path))
    assert crashed.warnings == ()  # a torn last line is expected, not warned about
    assert [s.step for s in crashed.steps] == list(range(1, 16))
    (stage,) = timeline(crashed)  # the relaunch under the same strategy continues the stage
    assert (stage.steps, stage.gns_entry, stage.gns_exit, stage.end_reason) == (15, 11, 25, "no exit event")
    running = build_report([read_run(running_run(tmp_path))]).runs[0]
    assert running.exit_reason is None and running.wall_s == 12.0 and running.steps == 8
    assert [s.end_reason for s in running.timeline] == ["chain", "no exit event"]
    assert running.targets[0].time_s == 7.0  # default target: its own best


def test_torn_middle_line_warns(tmp_path: Path) -> None:
    result = cli(str(crashed_run(tmp_path, torn_middle=True)), "--format", "json")
    assert result.exit_code == 0, result.output
    assert "metrics.jsonl" in result.stderr and "warning" in result.stderr
    assert json.loads(result.stdout)["runs"][0]["steps"] == 15


def test_formats_parse(tmp_path: Path) -> None:
    dirs = [str(f(tmp_path)) for f in (static_run, chained_run, never_run)]
    targets = ["--target-ppl", "20", "--target-ppl", "40"]
    result = cli(*dirs, *targets, "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["run"], float(r["target_ppl"])) for r in rows] == [
        (n, t) for n in ("static", "chained", "never") for t in (20, 40)
    ]
    chained20 = rows[2]
    assert float(chained20["time_to_target_s"]) == 34 and int(chained20["tokens_to_target"]) == 1120 * SEQ_LEN
    assert float(chained20["speedup"]) == pytest.approx(42 / 34)
    assert rows[4]["time_to_target_s"] == "" and rows[4]["reached"] == "0"

    result = cli(*dirs, *targets, "--format", "json")
    data = json.loads(result.stdout)
    assert json.loads(json.dumps(data)) == data
    assert data["baseline"] == "static" and data["targets"] == [20, 40]
    chained = data["runs"][1]
    assert chained["targets"][1]["time_s"] == 18 and chained["switch_overhead_s"] == 7
    assert [s["strategy"]["gbs"] for s in chained["timeline"]] == [16, 32, 64]

    result = cli(*dirs, *targets, "--format", "markdown")
    lines = result.stdout.splitlines()
    assert "## Time to perplexity" in lines and "### Chain timeline: chained" in lines
    table = [line for line in lines if line.startswith("| chained")]
    assert "34.0 s · step 30 · 71.7k tok" in table[0] and "1.24×" in table[0]

    result = cli(*dirs, *targets)
    assert result.exit_code == 0 and "Time to perplexity" in result.stdout
    assert "decision (ratio 1.25)" in result.stdout and "not reached" in result.stdout


def test_baseline_flag_and_samples_without_seq_len(tmp_path: Path) -> None:
    r = RunBuilder(tmp_path, "noseq", seq_len=None)
    r.launch(A)
    r.train(20)
    r.eval(19)
    noseq, chained = r.write(), chained_run(tmp_path)
    result = cli(str(noseq), "--baseline", str(chained), "--target-ppl", "20", "--format", "json")
    data = json.loads(result.stdout)
    assert [run["name"] for run in data["runs"]] == ["noseq", "chained"]  # baseline appended
    first = data["runs"][0]["targets"][0]
    assert (first["tokens"], first["samples"], first["speedup"]) == (None, 320, pytest.approx(34 / 22))
    assert "320 samples" in cli(str(noseq), "--format", "markdown").stdout


def test_plot_is_written(tmp_path: Path) -> None:
    from matplotlib.image import imread

    out = tmp_path / "plots" / "ttp.png"
    dirs = [str(f(tmp_path)) for f in (static_run, chained_run, crashed_run)]
    result = cli(*dirs, "--target-ppl", "20", "--format", "csv", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 10_000
    pixels = imread(out)
    assert (pixels != pixels[0, 0]).any()


@pytest.mark.parametrize("args", [["--format", "yaml"], ["--target-ppl", "0.5"], ["--bogus"]])
def test_bad_flags_exit_2(tmp_path: Path, args: list[str]) -> None:
    result = cli(str(static_run(tmp_path)), *args)
    assert result.exit_code == 2


def test_not_a_run_exits_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = cli(str(tmp_path / "empty"))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "not a run directory" in result.stderr


def test_registered_in_app() -> None:
    from cona_cli.app import app

    assert "report" in [c.name for c in app.registered_commands]
