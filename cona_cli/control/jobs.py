"""Starting torchrun jobs: what every rank runs, its environment, and the output pumped to the launch logs."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from cona_cli.cluster.launchers import Agent, Launcher
from cona_cli.cluster.nodes import ClusterError, Node, rendezvous, torchrun_args
from cona_cli.control.policies import Stage
from cona_cli.control.runstate import write_atomic
from cona_cli.control.telemetry_server import TelemetryServer
from cona_cli.planner.costmodel import as_array
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.memory import memory_bytes, training_budget
from cona_cli.planner.workload import Workload
from cona_core.config import Config
from cona_core.rundir import RunDir
from cona_core.strategy import Strategy

# glibc hands every block above 32 MB back to the OS when it is freed (mmap), so each step faults in
# fresh pages for its logits and their gradients again. Keeping freed memory in the heap made
# large-batch steps on this box 20-30 % faster (gbs 32 at seq 128: 0.53 -> 0.43 s/it; README, Engine
# notes). The same two variables set by the user, in the environment or the config, win.
GLIBC_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
# Test hook: set, no job starts (the test suite's unit tests, tests/conftest.py, start none).
NO_JOBS_ENV = "CONA_TEST_NO_JOBS"


class EventLog:
    """Append-only events.jsonl, each event stamped with the run's time (`run_time`: the host's since the
    start, or the virtual clock's) and the host's clock; `on_write` also gets every event (TensorBoard)."""

    def __init__(
        self, path: Path, run_time: Callable[[], float], on_write: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.path, self.run_time, self.on_write = path, run_time, on_write

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "time": round(self.run_time(), 4), "wall_clock": round(time.time(), 3), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        if self.on_write is not None:
            self.on_write(event)
        return event


def worker_args(run_dir: Path, stage: Stage, launch: int, resume: Path | None) -> list[str]:
    """What torchrun runs on every rank."""
    args = [
        "-m",
        "launch.worker",
        "--run-dir",
        str(run_dir.absolute()),
        "--strategy",
        str(stage.strategy),
        "--launch",
        str(launch),
    ]
    if resume is not None:
        args += ["--resume", str(resume.absolute())]
    if stage.stop_step is not None:
        args += ["--stop-step", str(stage.stop_step)]
    return args


def threads_per_proc(cfg: Config) -> int:
    """Intra-op threads per rank: `cluster.threads_per_proc`; else OMP_NUM_THREADS where the user set it (as
    torchrun keeps it); else the CPUs this process may run on shared by the node's ranks (`local` nodes
    share one machine)."""
    c = cfg.cluster
    if c.threads_per_proc:
        return c.threads_per_proc
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    procs_here = c.procs_per_node * (c.nodes if c.launcher == "local" else 1)
    return max(1, len(os.sched_getaffinity(0)) // procs_here)


def allocator_env(cfg: Config) -> dict[str, str]:
    """The malloc settings the workers get unless the user chose their own."""
    c = cfg.cluster
    given = {*os.environ, *c.env, *(k for h in c.hosts for k in h.env)}
    return {k: v for k, v in GLIBC_MALLOC_ENV.items() if k not in given}


def record_memory_estimate(cfg: Config, files: RunDir, strategy: Strategy) -> None:
    """The planner's peak-memory estimate of `strategy` for the workers' step rows (and OOM reports)."""
    estimates = files.memory_estimates()
    if str(strategy) in estimates:
        return
    vocab = files.vocab_size() if files.corpus.is_file() else None
    workload = Workload.from_config(cfg, vocab=vocab)
    hw = load_hardware(cfg.search.hardware)  # resolves search.precision: auto
    budget = training_budget(hw, cfg.cluster.procs_per_node, cfg.search.memory_margin)
    estimates[str(strategy)] = float(memory_bytes(as_array([strategy]), workload, hw, budget)[0])
    write_atomic(files.memory_estimate_file, json.dumps(estimates))


@dataclass
class JobStarter:
    """Starts one torchrun per node (its own rendezvous) and pumps each agent's output to its log."""

    cfg: Config
    files: RunDir
    nodes: list[Node]
    launcher: Launcher
    telemetry: TelemetryServer
    run_start: float
    console: Console
    verbose: bool
    multi_node: bool

    def start(
        self, launch: int, tail: list[str], extra_env: dict[str, str] | None = None
    ) -> tuple[list[Agent], list[threading.Thread]]:
        """Start launch `launch` running `tail` on every rank (`extra_env` added to their environment);
        its agents and their output pumps."""
        if os.environ.get(NO_JOBS_ENV):
            raise ClusterError(f"{NO_JOBS_ENV} is set: no torchrun job may start in this process")
        c = self.cfg.cluster
        rdzv = rendezvous(c, self.nodes, f"{self.files.path.resolve()}-{launch}") if self.multi_node else None
        env = {
            **allocator_env(self.cfg),
            **self.telemetry.env(),
            "CONA_RUN_START": repr(self.run_start),
            "OMP_NUM_THREADS": str(threads_per_proc(self.cfg)),
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        if c.launcher == "local":
            env["CONA_CONTROLLER_PID"] = str(os.getpid())  # a standby leaves when the controller is gone
        agents = self.launcher.start(self.nodes, lambda node: torchrun_args(c, node, rdzv) + tail, env)
        per_node = len(agents) > 1  # one log per node, lines shown prefixed by the node
        pumps = [
            threading.Thread(
                target=self._pump,
                args=(a, self.files.launch_log(launch, a.label if per_node else None), per_node),
                daemon=True,
            )
            for a in agents
        ]
        for pump in pumps:
            pump.start()
        return agents, pumps

    def _pump(self, agent: Agent, log_path: Path, prefixed: bool) -> None:
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "w") as log:
            for line in agent.proc.stdout:
                log.write(line)
                log.flush()
                if self.verbose:
                    text = f"[{agent.label}] {line.rstrip()}" if prefixed else line.rstrip()
                    self.console.print(text, markup=False, highlight=False)
