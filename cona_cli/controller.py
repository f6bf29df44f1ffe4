"""The controller: launches torchrun under a strategy, follows the run, switches by checkpoint + relaunch.

Data flows one way: config -> controller -> torchrun -> workers -> telemetry -> controller, and the
run directory is the record (events.jsonl written here, metrics.jsonl by worker rank 0).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cona_cli.config import Config
from cona_cli.policy import Policy, Stage
from cona_cli.telemetry import TelemetryServer

INTERRUPT_GRACE_S = 120.0  # for workers to checkpoint after a stop command, before SIGTERM
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


@dataclass
class LaunchResult:
    returncode: int
    outcome: dict[str, Any] | None  # what the workers wrote to launches/NNN.json


class EventLog:
    """Append-only events.jsonl."""

    def __init__(self, path: Path, run_start: float) -> None:
        self.path, self.run_start = path, run_start

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "time": round(time.time() - self.run_start, 4), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        return event


def torchrun_command(cfg: Config, run_dir: Path, stage: Stage, launch: int, resume: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cfg.cluster.procs_per_node}", "-m", "launch.worker",
           "--run-dir", str(run_dir), "--strategy", str(stage.strategy), "--launch", str(launch)]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    if stage.stop_step is not None:
        cmd += ["--stop-step", str(stage.stop_step)]
    return cmd


def threads_per_proc(cfg: Config) -> int:
    return cfg.cluster.threads_per_proc or max(1, (os.cpu_count() or 1) // cfg.cluster.procs_per_node)


class Controller:
    def __init__(self, cfg: Config, run_dir: Path, policy: Policy, console: Console | None = None,
                 verbose: bool = False) -> None:
        self.cfg, self.run_dir, self.policy = cfg, run_dir, policy
        self.console = console or Console(stderr=True)
        self.verbose = verbose
        self.run_start = time.time()
        self.events = EventLog(run_dir / "events.jsonl", self.run_start)
        self.telemetry = TelemetryServer()
        policy.events = self.events
        self.signal_received: int | None = None
        self.launch = 0
        self.last_metric: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}

    # -- public ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run to completion; returns the process exit code."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.events.write("start", config=self.cfg.source, policy=self.policy.name, world=self.cfg.cluster.world)
        stage: Stage | None = self.policy.first()
        resume: Path | None = None
        prev: tuple[Stage, dict[str, Any]] | None = None
        try:
            with self._progress() as progress:
                while stage is not None:
                    result, requested = self._run_launch(stage, resume, prev, progress)
                    outcome = result.outcome
                    if outcome is None or (result.returncode != 0 and self.signal_received is None):
                        return self._failed(result)
                    resume = Path(outcome["checkpoint"])
                    reason = outcome["reason"]
                    if self.signal_received is not None:
                        self.events.write("interrupted", signal=signal.Signals(self.signal_received).name,
                                          step=outcome["step"])
                        return self._exit(EXIT_CODES[self.signal_received], "interrupted", outcome["step"])
                    if reason not in ("stage_end", "command"):
                        if reason == "target_reached":
                            self.events.write("target_reached", step=outcome["step"],
                                              val_ppl=outcome["best_val_ppl"], target_ppl=self.cfg.train.target_ppl,
                                              wall_time=outcome["time"])
                        return self._exit(0, reason, outcome["step"])
                    prev = (stage, outcome)
                    stage = self.policy.after_launch(outcome, requested)
                return self._exit(0, "done", prev[1]["step"] if prev else 0)
        finally:
            self.telemetry.close()

    # -- one launch --------------------------------------------------------------------------

    def _run_launch(self, stage: Stage, resume: Path | None, prev: tuple[Stage, dict[str, Any]] | None,
                    progress: Progress) -> tuple[LaunchResult, Stage | None]:
        self.launch += 1
        cmd = torchrun_command(self.cfg, self.run_dir, stage, self.launch, resume)
        self.events.write("launch", launch=self.launch, strategy=stage.strategy.to_dict(),
                          from_checkpoint=str(resume) if resume else None,
                          step=prev[1]["step"] if prev else 0, reason=stage.reason)
        env = {**os.environ, **self.telemetry.env(), "CONA_RUN_START": repr(self.run_start),
               "OMP_NUM_THREADS": str(threads_per_proc(self.cfg)), "PYTHONUNBUFFERED": "1"}
        log_path = self.run_dir / "logs" / f"launch_{self.launch:03d}.log"
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, text=True, bufsize=1)
            pump = threading.Thread(target=self._pump, args=(proc.stdout, log), daemon=True)
            pump.start()
            requested = self._follow(proc, stage, prev, progress)
            pump.join(timeout=5)
        outcome_path = self.run_dir / "launches" / f"{self.launch:03d}.json"
        outcome = json.loads(outcome_path.read_text()) if outcome_path.is_file() else None
        self._drain(stage, prev, progress)
        return LaunchResult(proc.returncode, outcome), requested

    def _pump(self, stream: TextIO, log: TextIO) -> None:
        for line in stream:
            log.write(line)
            log.flush()
            if self.verbose:
                self.console.print(line.rstrip(), markup=False, highlight=False)

    def _follow(self, proc: subprocess.Popen, stage: Stage, prev: tuple[Stage, dict[str, Any]] | None,
                progress: Progress) -> Stage | None:
        """Wait for the launch to end, handling telemetry, switch requests and signals."""
        requested: Stage | None = None
        stop_sent_at: float | None = None
        while proc.poll() is None:
            switch_to = self._drain(stage, prev, progress, wait=0.2)
            if switch_to is not None and requested is None:
                requested = switch_to
            wants_stop = requested is not None or self.signal_received is not None
            if wants_stop and stop_sent_at is None:
                if not self.telemetry.send({"cmd": "checkpoint_and_exit"}):
                    os.killpg(proc.pid, signal.SIGTERM)  # no telemetry: workers checkpoint on SIGTERM too
                stop_sent_at = time.monotonic()
            if stop_sent_at is not None and time.monotonic() - stop_sent_at > INTERRUPT_GRACE_S:
                os.killpg(proc.pid, signal.SIGKILL)
        return requested

    def _drain(self, stage: Stage, prev: tuple[Stage, dict[str, Any]] | None, progress: Progress,
               wait: float = 0.0) -> Stage | None:
        """Handle queued telemetry messages; returns a stage the policy wants to switch to."""
        switch_to = None
        try:
            msg = self.telemetry.messages.get(timeout=wait) if wait else self.telemetry.messages.get_nowait()
        except queue.Empty:
            return None
        while True:
            switch_to = self._handle(msg, stage, prev, progress) or switch_to
            try:
                msg = self.telemetry.messages.get_nowait()
            except queue.Empty:
                return switch_to

    def _handle(self, msg: dict[str, Any], stage: Stage, prev: tuple[Stage, dict[str, Any]] | None,
                progress: Progress) -> Stage | None:
        kind = msg.get("type")
        if kind == "checkpoint":
            self.events.write("checkpoint", **{k: msg.get(k) for k in ("step", "path", "seconds", "bytes", "reason")})
        elif kind == "metric" and msg.get("kind") == "eval":
            self.last_eval = msg
        elif kind == "metric" and msg.get("kind") == "step":
            first_of_launch = self.last_metric.get("launch") != msg.get("launch")
            self.last_metric = msg
            if first_of_launch and prev is not None and prev[0].strategy != stage.strategy:
                seconds = msg["time"] - msg["iter_s"] - prev[1]["time"]
                self.events.write("switch", step=prev[1]["step"], to=stage.strategy.to_dict(),
                                  reason=stage.reason, seconds=round(seconds, 4),
                                  **{"from": prev[0].strategy.to_dict()})
                self.policy.observe_switch(seconds)
            self._show(progress, stage)
            return self.policy.on_metric(msg)
        return None

    # -- endings and display -----------------------------------------------------------------

    def _failed(self, result: LaunchResult) -> int:
        log_path = self.run_dir / "logs" / f"launch_{self.launch:03d}.log"
        tail = log_path.read_text().splitlines()[-15:] if log_path.is_file() else []
        self.events.write("failure", launch=self.launch, exit_code=result.returncode, last_lines=tail)
        self.console.print("\n".join(tail), markup=False, highlight=False)
        self.console.print(f"[red]cona: launch {self.launch} failed with exit code {result.returncode}; "
                           f"see {log_path}[/red]")
        return self._exit(1, "failed", self.last_metric.get("step", 0))

    def _exit(self, code: int, reason: str, step: int) -> int:
        self.events.write("exit", code=code, reason=reason, step=step)
        ppl = self.last_eval.get("val_ppl")
        ppl_text = f", val ppl {ppl:.2f}" if ppl is not None else ""
        self.console.print(f"cona: {reason} at step {step}{ppl_text} after {time.time() - self.run_start:.1f} s "
                           f"({self.launch} launches); run dir {self.run_dir}")
        return code

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.signal_received is not None:  # a second Ctrl-C: stop waiting politely
            raise KeyboardInterrupt
        self.signal_received = signum

    def _progress(self) -> Progress:
        return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=self.console, transient=False)

    def _show(self, progress: Progress, stage: Stage) -> None:
        m = self.last_metric
        total = self.cfg.train.max_steps
        info = f"loss {m['loss']:.3f}"
        if self.last_eval:
            info += f"  val ppl {self.last_eval['val_ppl']:.1f}"
        info += f"  {stage.strategy}  {m['iter_s']:.2f} s/it"
        if not progress.task_ids:
            progress.add_task("step", total=total, info="")
        progress.update(progress.task_ids[0], completed=m["step"], description=f"step {m['step']}", info=info)
