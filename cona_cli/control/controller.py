"""The controller: launches torchrun under a strategy, follows the run, switches by checkpoint + relaunch.

Data flows one way: config -> controller -> torchrun -> workers -> telemetry -> controller, and the
run directory is the record (events.jsonl written here, metrics.jsonl by worker rank 0).

A launch that fails (a rank killed, out of memory, an exception) is relaunched under the same
strategy from the newest usable checkpoint, up to `train.max_restarts` times within
`train.restart_window_s`. The controller's own state goes to controller_state.json whenever it
changes, so `cona train --resume RUN_DIR` continues after the controller was stopped or killed.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cona_cli.cluster.launchers import Agent, make_launcher
from cona_cli.cluster.nodes import (
    ClusterError,
    head_address,
    is_multi_node,
    may_use_gpus,
    rendezvous,
    resolve_nodes,
    torchrun_args,
)
from cona_cli.cluster.shared_storage import check_shared
from cona_cli.cluster.slurm import requeue
from cona_cli.config import Config
from cona_cli.control import usable_checkpoints as checkpoints
from cona_cli.control.failures import REFUSED_EXIT, STORAGE_EXIT, Failure, failed_host, parse_failure
from cona_cli.control.policies import Policy, Stage
from cona_cli.control.runstate import RunState, stage_from_dict, stage_to_dict, write_atomic
from cona_cli.control.standby import Standby, standby_args
from cona_cli.control.telemetry_server import TelemetryServer
from cona_cli.control.tensorboard_log import TensorBoardLog
from cona_cli.planner.costmodel import as_array
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.memory import memory_bytes
from cona_cli.planner.workload import Workload
from cona_cli.rundir import RunDir, read_trainer_state
from cona_cli.strategy import Strategy, resizable

INTERRUPT_GRACE_S = 120.0  # for workers to checkpoint after a stop command, before SIGKILL
NODE_FAILURE_GRACE_S = 20.0  # for the other nodes to stop after one node failed, before SIGKILL
KILL_WAIT_S = 10.0  # after SIGKILL, before the local end (an ssh client) is abandoned
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGUSR1: 138}
Prev = tuple[Strategy, dict[str, Any]]  # strategy and outcome of the last launch that ended normally


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist but none of them can be used; the message is one line."""


@dataclass
class LaunchResult:
    returncode: int
    outcome: dict[str, Any] | None  # what the workers wrote to launches/NNN.json
    failed: Agent | None  # the node agent whose failure came first (not one that only lost a peer)
    failure: Failure | None  # what its output says
    log_path: Path  # that agent's output (else the first node's)


class EventLog:
    """Append-only events.jsonl; `on_write` also gets every event (TensorBoard)."""

    def __init__(self, path: Path, run_start: float, on_write: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path, self.run_start, self.on_write = path, run_start, on_write

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        now = time.time()
        event = {"kind": kind, "time": round(now - self.run_start, 4), "wall_clock": round(now, 3), **fields}
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
    """Intra-op threads per rank: the node's cores shared by its ranks (`local` nodes share one machine)."""
    c = cfg.cluster
    procs_here = c.procs_per_node * (c.nodes if c.launcher == "local" else 1)
    return c.threads_per_proc or max(1, (os.cpu_count() or 1) // procs_here)


# glibc hands every block above 32 MB back to the OS when it is freed (mmap), so each step faults in
# fresh pages for its logits and their gradients again. Keeping freed memory in the heap made
# large-batch steps on this box 20-30 % faster (gbs 32 at seq 128: 0.53 -> 0.43 s/it; README, Engine
# notes). The same two variables set by the user, in the environment or the config, win.
GLIBC_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


def allocator_env(cfg: Config) -> dict[str, str]:
    """The malloc settings the workers get unless the user chose their own."""
    c = cfg.cluster
    given = {*os.environ, *c.env, *(k for h in c.hosts for k in h.env)}
    return {k: v for k, v in GLIBC_MALLOC_ENV.items() if k not in given}


class Controller:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        policy: Policy,
        console: Console | None = None,
        verbose: bool = False,
        resume: RunState | None = None,
    ) -> None:
        """`resume`: the saved state of an earlier controller of this run (`cona train --resume`)."""
        self.cfg, self.run_dir, self.policy = cfg, run_dir, policy
        self.files = RunDir(run_dir)
        self.console = console or Console(stderr=True)
        self.verbose = verbose
        self.resumed = resume is not None
        self.state = resume or RunState()
        self.run_start = time.time() - self.state.elapsed_s  # run time continues, the stopped gap excluded
        self.tensorboard = TensorBoardLog(self.files.tensorboard) if cfg.train.tensorboard else None
        self.events = EventLog(self.files.events, self.run_start, self.tensorboard.event if self.tensorboard else None)
        self.nodes = resolve_nodes(cfg.cluster)
        self.multi_node = is_multi_node(cfg.cluster)
        self.launcher = make_launcher(cfg.cluster)
        host = head_address(cfg.cluster, self.nodes)
        try:
            self.telemetry = TelemetryServer(host=host)
        except OSError as e:
            raise ClusterError(
                f"cluster.head_addr: cannot listen on {host} ({e.strerror or e}); give this "
                "machine's address on the cluster network"
            ) from None
        policy.events = self.events
        self.signal_received: int | None = None
        self.launch = self.state.launch
        self.last_metric: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self._shapes: checkpoints.Shapes | None = None
        self._dirty = False  # the last drain changed something worth saving
        self.standby: Standby | None = None  # the pre-warmed next launch, if one runs
        self._exiting: list[tuple[Agent, threading.Thread]] = []  # a switched-from job still shutting down
        self._switch: dict[str, float | bool] = {}  # run times of the running switch's phases, standby flags
        self.stage: Stage | None = None  # what the running launch runs (an in-place resize changes it)
        self._resizing: Stage | None = None  # a resize sent to the running job, not yet seen in its steps

    # -- public ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run to completion; returns the process exit code."""
        for sig in EXIT_CODES:  # SIGUSR1: Slurm's warning before the time limit (`--sbatch` scripts)
            signal.signal(sig, self._on_signal)
        try:
            if self.multi_node:
                check_shared(self.launcher, self.nodes, self.run_dir, self.cfg.cluster.probe_timeout_s)
            with self._progress() as progress:
                return self._run(progress)
        except ClusterError as e:
            self.console.print(f"[red]cona: {e}[/red]")
            return self._exit(1, "failed", self.last_metric.get("step", 0))
        except NoUsableCheckpoint as e:
            self.console.print(f"[red]cona: {e}[/red]")
            return self._exit(1, "failed", self.last_metric.get("step", 0))
        finally:
            self._drop_standby()
            self._reap_exiting()
            self.telemetry.close()
            if self.tensorboard is not None:
                self.tensorboard.close()

    def _run(self, progress: Progress) -> int:
        ckpt: Path | None = None
        stage: Stage | None
        launch_reason: str | None = None
        prev: Prev | None = None
        if self.state.prev is not None:
            prev = (Strategy.parse(self.state.prev["strategy"]), self.state.prev["outcome"])
        if self.resumed:
            ckpt = self.newest_checkpoint()
            step = checkpoints.checkpoint_step(ckpt) if ckpt else 0
            self.events.write("resume", step=step, checkpoint=str(ckpt) if ckpt else None, launch=self.launch)
            running = stage_from_dict(self.state.stage) or self.policy.first()
            stage, launch_reason = self._batch_at(ckpt, self.policy.restart(step, running)), "resume"
        else:
            self.events.write("start", config=self.cfg.source, policy=self.policy.name, world=self.cfg.cluster.world)
            stage = self.policy.first()
        while stage is not None:
            if self.signal_received is not None:
                return self._interrupted(None)
            self._save_state(stage, prev)
            result, requested = self._run_launch(stage, ckpt, prev, progress, launch_reason)
            stage, outcome = self.stage, result.outcome
            if self.signal_received is not None:
                return self._interrupted(outcome)
            if result.returncode != 0 or outcome is None:
                failure = self._record_failure(result, ckpt)
                if failure.refusal is not None:  # deterministic: relaunching would only fail again
                    return self._exit(REFUSED_EXIT, "refused", self.last_metric.get("step", 0))
                if failure.storage is not None:  # relaunching fails at the next save; --resume once there is room
                    return self._exit(STORAGE_EXIT, "failed", self.last_metric.get("step", 0))
                if failure.out_of_memory:
                    stage = self._out_of_memory(Strategy.parse(failure.strategy or str(stage.strategy)), failure)
                    if stage is None:
                        return self._exit(1, "out_of_memory", self.last_metric.get("step", 0))
                elif not self._may_restart():
                    return self._exit(1, "failed", self.last_metric.get("step", 0))
                if self.last_metric.get("launch") == self.launch:
                    prev = None  # the switch into this strategy is already recorded
                ckpt = self.newest_checkpoint()
                stage = self.policy.restart(checkpoints.checkpoint_step(ckpt) if ckpt else 0, stage)
                if not failure.out_of_memory:  # (after out of memory: the strategy the policy chose instead)
                    stage = self._batch_at(ckpt, stage)
                launch_reason = "out_of_memory" if failure.out_of_memory else "restart"
                continue
            ckpt, launch_reason = Path(outcome["checkpoint"]), None
            reason = outcome["reason"]
            if reason not in ("stage_end", "command"):
                if reason == "target_reached":
                    self.events.write(
                        "target_reached",
                        step=outcome["step"],
                        val_ppl=outcome["best_val_ppl"],
                        target_ppl=self.cfg.train.target_ppl,
                        wall_time=outcome["time"],
                    )
                return self._exit(0, reason, outcome["step"])
            prev = (stage.strategy, outcome)
            stage = self.policy.after_launch(outcome, requested)
        self._save_state(None, prev)
        return self._exit(0, "done", prev[1]["step"] if prev else 0)

    # -- recovery ----------------------------------------------------------------------------

    def _batch_at(self, ckpt: Path | None, stage: Stage | None) -> Stage | None:
        """The stage a restart from `ckpt` runs: the batch in force when `ckpt` was taken (its saved strategy),
        where an in-place resize since changed only the batch; the policy resizes again if it still wants
        to. The policy is told, as after a launch that ended on its request."""
        if ckpt is None or stage is None or not self.policy.in_place:
            return stage
        try:
            saved = Strategy.from_mapping(read_trainer_state(ckpt)["strategy"])
        except (ValueError, KeyError, TypeError):  # a checkpoint from before saved strategies: as it was
            return stage
        if saved == stage.strategy or not resizable(stage.strategy, saved):
            return stage
        taken = Stage(saved, stage.stop_step, stage.reason)
        self.policy.after_launch({"step": checkpoints.checkpoint_step(ckpt)}, taken)
        return taken

    def newest_checkpoint(self) -> Path | None:
        """The newest usable checkpoint (unusable ones are quarantined with a warning); None if none
        was ever committed. Raises NoUsableCheckpoint if there are some but none is usable."""
        if self._shapes is None:
            self._shapes = checkpoints.expected_shapes(self.cfg, self.files)
        root = self.files.checkpoints
        path, skipped = checkpoints.newest_usable(root, self._shapes, self._warn)
        if path is None and skipped:
            raise NoUsableCheckpoint(f"no usable checkpoint in {root} ({skipped} unusable, moved to bad-*)")
        return path

    def _warn(self, message: str) -> None:
        self.events.write("warning", message=message)
        self.console.print(f"[yellow]cona: {message}[/yellow]")

    def _record_failure(self, result: LaunchResult, ckpt: Path | None) -> Failure:
        """Record a failed launch (and quarantine a checkpoint it could not load); what its output says."""
        self._switch = {}
        log_path = result.log_path
        text = log_path.read_text(errors="replace") if log_path.is_file() else ""
        failure = result.failure or parse_failure(text, result.returncode)
        host = failed_host(result.failed, text) if result.failed is not None else None
        self.events.write(
            "failure",
            launch=self.launch,
            exit_code=result.returncode,
            rank=failure.rank,
            rank_exit_code=failure.rank_exit_code,
            exit_codes=failure.exit_codes,
            bad_checkpoint=failure.bad_checkpoint,
            out_of_memory=failure.out_of_memory,
            last_lines=failure.last_lines,
            **({"host": host} if self.multi_node else {}),
        )
        where = f"node {host}: " if self.multi_node and host else ""
        if failure.refusal is not None:  # the worker's one line says it all
            self.console.print(f"cona: {where}{failure.refusal}", style="red", markup=False, highlight=False)
            return failure
        if failure.storage is not None:  # so does a checkpoint that could not be written
            self.console.print(f"cona: {where}{failure.storage}", style="red", markup=False, highlight=False)
            return failure
        self.console.print("\n".join(failure.last_lines), markup=False, highlight=False)
        self.console.print(f"[red]cona: launch {self.launch} failed: {where}{failure.describe()}; see {log_path}[/red]")
        if failure.bad_checkpoint and ckpt is not None and ckpt.is_dir():
            moved = checkpoints.quarantine(ckpt)
            self._warn(f"checkpoint {ckpt} could not be loaded; skipped (moved to {moved.name})")
        return failure

    def _may_restart(self) -> bool:
        """Count a failed launch; whether the restart budget allows another launch."""
        now = time.time() - self.run_start
        t = self.cfg.train
        self.state.failures = [f for f in self.state.failures if now - f <= t.restart_window_s] + [now]
        if len(self.state.failures) > t.max_restarts:
            self.console.print(
                f"[red]cona: giving up: {len(self.state.failures)} failed launches within "
                f"{t.restart_window_s:g} s (train.max_restarts = {t.max_restarts})[/red]"
            )
            return False
        return True

    def _out_of_memory(self, strategy: Strategy, failure: Failure) -> Stage | None:
        """A strategy ran out of memory: infeasible for the rest of the run. The policy's next stage, or
        None (the run stops) when it has no other strategy."""
        estimate = self.files.memory_estimates().get(str(strategy))
        peak = failure.peak_bytes
        self.events.write(
            "infeasible",
            strategy=strategy.to_dict(),
            reason="out_of_memory",
            rank=failure.rank,
            peak_bytes=peak,
            estimate_bytes=estimate,
        )
        stage = self.policy.infeasible(strategy)
        measured = f"measured peak {peak / 2**30:.2f} GiB" if peak is not None else "peak not reported"
        planned = f", planner estimate {estimate / 2**30:.2f} GiB" if estimate is not None else ""
        what = f"strategy {strategy} ran out of memory on rank {failure.rank} ({measured}{planned})"
        if stage is None:
            self.console.print(f"[red]cona: {what}: it does not fit here; stopping (policy {self.policy.name})[/red]")
        else:
            self.console.print(f"[yellow]cona: {what}: marked infeasible; continuing with {stage.strategy}[/yellow]")
        return stage

    def _record_memory_estimate(self, strategy: Strategy) -> None:
        """The planner's peak-memory estimate of `strategy` for the workers' step rows (and OOM reports)."""
        estimates = self.files.memory_estimates()
        if str(strategy) in estimates:
            return
        vocab = self.files.vocab_size() if self.files.corpus.is_file() else None
        workload = Workload.from_config(self.cfg, vocab=vocab)
        hw = load_hardware(self.cfg.search.hardware)  # resolves search.precision: auto
        estimates[str(strategy)] = float(memory_bytes(as_array([strategy]), workload, hw)[0])
        write_atomic(self.files.memory_estimate_file, json.dumps(estimates))

    def _save_state(self, stage: Stage | None, prev: Prev | None) -> None:
        st = self.state
        st.stage, st.launch, st.elapsed_s = stage_to_dict(stage), self.launch, time.time() - self.run_start
        st.prev = {"strategy": str(prev[0]), "outcome": prev[1]} if prev else None
        st.policy = self.policy.state_dict()
        st.save(self.run_dir)

    # -- one launch --------------------------------------------------------------------------

    def _run_launch(
        self, stage: Stage, resume: Path | None, prev: Prev | None, progress: Progress, reason: str | None
    ) -> tuple[LaunchResult, Stage | None]:
        self.launch += 1
        self.stage, self._resizing = stage, None
        step = checkpoints.checkpoint_step(resume) if resume else 0
        self._record_memory_estimate(stage.strategy)
        outcome_path = self.files.launch_outcome(self.launch)
        outcome_path.unlink(missing_ok=True)  # a leftover of a launch the controller never saw
        standby = self.standby
        warm = standby is not None and standby.launch == self.launch and standby.alive()
        self.events.write(
            "launch",
            launch=self.launch,
            strategy=stage.strategy.to_dict(),
            from_checkpoint=str(resume) if resume else None,
            step=step,
            reason=reason or stage.reason,
            standby=warm,
        )
        self.policy.standby_ready = False
        if warm:
            standby.hand_over(self.files, stage, resume)
            self.standby = None
            self.state.standby_pids = []
            agents, pumps = standby.agents, standby.pumps
        else:
            self._drop_standby()
            agents, pumps = self._start(self.launch, worker_args(self.run_dir, stage, self.launch, resume))
        self._switch.update(
            handover=time.time() - self.run_start, standby=warm, standby_ready=warm and standby.ready_logged
        )
        self.state.agent_pids = [a.pid for a in agents]
        self._save_state(stage, prev)
        per_node = len(agents) > 1
        requested, failed, exiting = self._follow(agents, prev, progress, outcome_path)
        self._switch["outcome"] = time.time() - self.run_start
        if exiting:  # handed over before the old job finished exiting: it ends in the background
            self._exiting += list(zip(agents, pumps))
        else:
            for pump in pumps:
                pump.join(timeout=5)
        outcome = json.loads(outcome_path.read_text()) if outcome_path.is_file() else None
        self._drain(prev, progress)
        self._save_state(self.stage, prev)
        if not failed:
            return LaunchResult(0, outcome, None, None, self._log_path(agents[0], per_node)), requested
        parsed = [
            (a, path, parse_failure(path.read_text(errors="replace") if path.is_file() else "", a.poll() or 1))
            for a, path in ((a, self._log_path(a, per_node)) for a in failed)
        ]
        agent, path, failure = next((r for r in parsed if not r[2].knock_on), parsed[0])
        return LaunchResult(failure.exit_code, outcome, agent, failure, path), requested

    def _start(self, launch: int, tail: list[str]) -> tuple[list[Agent], list[threading.Thread]]:
        """Start torchrun on every node (its own rendezvous) running `tail`; its output pumped to the
        launch's logs."""
        c = self.cfg.cluster
        rdzv = rendezvous(c, self.nodes, f"cona-{self.telemetry.token[:8]}-{launch}") if self.multi_node else None
        env = {
            **allocator_env(self.cfg),
            **self.telemetry.env(),
            "CONA_RUN_START": repr(self.run_start),
            "OMP_NUM_THREADS": str(threads_per_proc(self.cfg)),
            "PYTHONUNBUFFERED": "1",
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

    def _relaunch_expected(self) -> Strategy | None:
        """The strategy the next switch most likely goes to, unless the running job can resize into it."""
        nxt = self.policy.expected_next()
        if nxt is not None and self._resizes_into(nxt):
            return None
        return nxt

    def _resizes_into(self, strategy: Strategy) -> bool:
        return self.policy.in_place and self.stage is not None and resizable(self.stage.strategy, strategy)

    def _maybe_start_standby(self) -> None:
        """Once a launch is stepping, pre-warm the next one if a switch may come. With CPU ranks and a
        policy that resizes in place, only once the switch it expects next needs a new layout: there a
        standby's start takes cores from the job."""
        if self.standby is not None or not self.cfg.cluster.standby or not self.policy.may_switch():
            return
        if self.policy.in_place and not may_use_gpus(self.cfg.cluster) and self._relaunch_expected() is None:
            return
        launch = self.launch + 1
        self.files.launches.mkdir(exist_ok=True)
        self.files.handover(launch).unlink(missing_ok=True)
        self.files.standby_ready(launch).unlink(missing_ok=True)
        agents, pumps = self._start(launch, standby_args(self.run_dir, launch))
        self.standby = Standby(launch, agents, pumps)
        self.state.standby_pids = [a.pid for a in agents]
        self.policy.standby_importing = True
        self.events.write("standby", launch=launch)

    def _maybe_prepare(self, strategy: Strategy | None) -> None:
        """Tell the standby which strategy to build while it waits (once; CPU ranks only act on it)."""
        sb = self.standby
        if strategy is None or sb is None or sb.prepared is not None or not sb.alive():
            return
        sb.prepare(self.files, strategy)
        self.events.write("standby_prepare", launch=sb.launch, strategy=strategy.to_dict())

    def _switch_phases(self, first_step: dict[str, Any], outcome: dict[str, Any]) -> dict[str, Any]:
        """Where a switch's time went, from the decision (or the stage's last step) to the end of the
        first step under the new layout; `standby` says whether a pre-warmed job took over."""
        p = self._switch
        decided = p.get("decision", outcome["time"])
        phases = {"stop": p.get("outcome", p["handover"]) - decided, "save": p.get("save_s")}
        phases["hand_over"] = p["handover"] - p.get("outcome", p["handover"])
        if "ready" in p:
            phases["start"] = p["ready"] - p["load_s"] - p["handover"]
            phases["load"] = p["load_s"]
        phases["first_step"] = first_step["iter_s"]
        rounded = {k: round(v, 4) for k, v in phases.items() if v is not None}
        self._switch = {}
        return {
            "phases": rounded,
            "decision_to_first_step_s": round(first_step["time"] - decided, 4),
            "standby": p.get("standby", False),
            "standby_ready": p.get("standby_ready", False),
            "prepared": p.get("prepared", False),
        }

    def _switch_committed(self, outcome_path: Path, requested: Stage | None) -> bool:
        """Whether the running job has saved the checkpoint the next launch starts from, and this job's
        devices need not be freed first (CPU ranks; GPU memory must be): the next launch (a standby
        or a cold one) may start while this job exits."""
        if self.signal_received is not None or not outcome_path.is_file() or may_use_gpus(self.cfg.cluster):
            return False
        try:
            reason = json.loads(outcome_path.read_text())["reason"]
        except (OSError, ValueError, KeyError):
            return False
        return reason == "stage_end" or (reason == "command" and requested is not None)

    def _drop_standby(self) -> None:
        if self.standby is not None:
            self.standby.cancel(self.files)
            self.standby = None
            self.state.standby_pids = []

    def _reap_exiting(self) -> None:
        """Wait for switched-from jobs that were still shutting down (killed after a grace period)."""
        deadline = time.monotonic() + KILL_WAIT_S
        for agent, pump in self._exiting:
            while agent.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if agent.poll() is None:
                agent.signal(signal.SIGKILL)
            pump.join(timeout=5)
        self._exiting = []

    def _log_path(self, agent: Agent, per_node: bool) -> Path:
        return self.files.launch_log(self.launch, agent.label if per_node else None)

    def _pump(self, agent: Agent, log_path: Path, prefixed: bool) -> None:
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "w") as log:
            for line in agent.proc.stdout:
                log.write(line)
                log.flush()
                if self.verbose:
                    text = f"[{agent.label}] {line.rstrip()}" if prefixed else line.rstrip()
                    self.console.print(text, markup=False, highlight=False)

    def _follow(
        self, agents: list[Agent], prev: Prev | None, progress: Progress, outcome_path: Path
    ) -> tuple[Stage | None, list[Agent], bool]:
        """Wait for every node's agent to end, handling telemetry, switch requests and signals.
        Returns the stage requested by the policy, the agents that failed, in the order seen, and
        whether it returned early: the job committed its switch checkpoint and the next launch can
        start while it exits."""
        requested: Stage | None = None
        stop_sent_at: float | None = None
        failed: list[Agent] = []
        killed_at: float | None = None
        abandoned = False
        while True:
            failed += [a for a in agents if a.poll() not in (None, 0) and a not in failed]
            if all(a.poll() is not None for a in agents):
                return requested, failed, False
            if not failed and self._switch_committed(outcome_path, requested):
                return requested, failed, True
            if self.standby is not None and self.standby.newly_ready(self.files):
                self.events.write("standby_ready", launch=self.standby.launch)
                self.policy.standby_ready = True
            self.policy.standby_importing = (
                self.standby is not None and not self.standby.ready_logged and self.standby.alive()
            )
            switch_to = self._drain(prev, progress, wait=0.2)
            if self._dirty:
                self._save_state(self.stage, prev)
            if switch_to is not None and requested is None and self._resizing is None:
                self._switch = {"decision": time.time() - self.run_start}
                if not (self._resizes_into(switch_to.strategy) and self._resize(switch_to)):
                    requested = switch_to
            self._maybe_prepare(requested.strategy if requested is not None else self._relaunch_expected())
            wants_stop = requested is not None or self.signal_received is not None or failed
            if wants_stop and stop_sent_at is None:
                # For a switch the workers skip the evaluation that ends a run.
                stop = {"cmd": "checkpoint_and_exit", "switch": self.signal_received is None}
                if failed or not self.telemetry.send(stop):
                    for a in agents:  # no telemetry, or a node is gone: workers checkpoint on SIGTERM if they can
                        a.signal(signal.SIGTERM)
                stop_sent_at = time.monotonic()
            grace = NODE_FAILURE_GRACE_S if failed else INTERRUPT_GRACE_S
            if stop_sent_at is not None and killed_at is None and time.monotonic() - stop_sent_at > grace:
                for a in agents:
                    a.signal(signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at is not None and not abandoned and time.monotonic() - killed_at > KILL_WAIT_S:
                for a in agents:
                    a.abandon()
                abandoned = True

    def _resize(self, stage: Stage) -> bool:
        """Ask the running job to take `stage`'s batch from its next step; False if it cannot be told."""
        self._record_memory_estimate(stage.strategy)
        if not self.telemetry.send({"cmd": "resize", "strategy": str(stage.strategy)}):
            return False
        self._resizing = stage
        return True

    def _resized(self, row: dict[str, Any]) -> None:
        """The first step under the batch the job was asked to resize to: record the switch."""
        stage, old = self._resizing, self.stage
        assert stage is not None and old is not None
        started = row["time"] - row["iter_s"]
        seconds = started - self.last_metric["time"]  # between the last step before and the first after
        decided = float(self._switch.get("decision", started))
        self.events.write(
            "switch",
            step=row["step"] - 1,
            to=stage.strategy.to_dict(),
            reason=stage.reason,
            seconds=round(seconds, 4),
            in_place=True,
            phases={"resize": round(started - decided, 4), "first_step": round(row["iter_s"], 4)},
            decision_to_first_step_s=round(row["time"] - decided, 4),
            standby=False,
            standby_ready=False,
            prepared=False,
            **{"from": old.strategy.to_dict()},
        )
        self.stage, self._resizing, self._switch = stage, None, {}
        self.policy.resized(stage, seconds)

    def _drain(self, prev: Prev | None, progress: Progress, wait: float = 0.0) -> Stage | None:
        """Handle queued telemetry messages; returns a stage the policy wants to switch to."""
        switch_to = None
        self._dirty = False
        try:
            msg = self.telemetry.messages.get(timeout=wait) if wait else self.telemetry.messages.get_nowait()
        except queue.Empty:
            return None
        while True:
            switch_to = self._handle(msg, prev, progress) or switch_to
            try:
                msg = self.telemetry.messages.get_nowait()
            except queue.Empty:
                return switch_to

    def _handle(self, msg: dict[str, Any], prev: Prev | None, progress: Progress) -> Stage | None:
        kind = msg.get("type")
        stage = self.stage
        assert stage is not None
        if kind == "metric" and self.tensorboard is not None:
            self.tensorboard.metric(msg)
        if kind == "ready" and msg.get("launch") == self.launch:
            self._switch.update(
                ready=float(msg["time"]), load_s=float(msg.get("setup_s", 0.0)), prepared=bool(msg.get("prepared"))
            )
        if kind == "checkpoint" and msg.get("reason") == "switch":
            self._switch["save_s"] = float(msg["seconds"])
        if kind == "checkpoint":
            self.events.write("checkpoint", **{k: msg.get(k) for k in ("step", "path", "seconds", "bytes", "reason")})
        elif kind == "metric" and msg.get("kind") == "eval":
            self.last_eval = msg
            self.policy.on_eval(msg)
        elif kind == "metric" and msg.get("kind") == "step":
            resizing = self._resizing
            ran = Strategy.from_mapping(msg) if resizing is not None and msg.get("launch") == self.launch else None
            if resizing is not None and ran == resizing.strategy:
                self._resized(msg)
                stage = resizing
            first_of_launch = self.last_metric.get("launch") != msg.get("launch")
            self.last_metric, self._dirty = msg, True
            if first_of_launch and prev is not None and prev[0] != stage.strategy:
                seconds = msg["time"] - msg["iter_s"] - prev[1]["time"]
                phases = self._switch_phases(msg, prev[1])
                self.events.write(
                    "switch",
                    step=prev[1]["step"],
                    to=stage.strategy.to_dict(),
                    reason=stage.reason,
                    seconds=round(seconds, 4),
                    **phases,
                    **{"from": prev[0].to_dict()},
                )
                self.policy.observe_switch(seconds, warm=phases["standby_ready"])
            if msg.get("launch") == self.launch:
                self._maybe_start_standby()
            self._show(progress, stage)
            return self.policy.on_metric(msg)
        return None

    # -- endings and display -----------------------------------------------------------------

    def _interrupted(self, outcome: dict[str, Any] | None) -> int:
        """A signal stopped the run (the workers checkpointed unless they were gone already)."""
        assert self.signal_received is not None
        step = outcome["step"] if outcome else self.last_metric.get("step", 0)
        self.events.write("interrupted", signal=signal.Signals(self.signal_received).name, step=step)
        if self.signal_received == signal.SIGUSR1:  # the job's time is nearly up: back in the queue
            problem = requeue()
            if problem is None:
                self.events.write("requeued", step=step)
                return self._exit(0, "requeued", step)
            self.console.print(f"[red]cona: not requeued: {problem}[/red]")
        return self._exit(EXIT_CODES[self.signal_received], "interrupted", step)

    def _exit(self, code: int, reason: str, step: int) -> int:
        self.events.write("exit", code=code, reason=reason, step=step)
        ppl = self.last_eval.get("val_ppl")
        ppl_text = f", val ppl {ppl:.2f}" if ppl is not None else ""
        self.console.print(
            f"cona: {reason} at step {step}{ppl_text} after {time.time() - self.run_start:.1f} s "
            f"({self.launch} launches); run dir {self.run_dir}"
        )
        return code

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.signal_received is not None:  # a second Ctrl-C: stop waiting politely
            raise KeyboardInterrupt
        self.signal_received = signum

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )

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
