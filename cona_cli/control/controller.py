"""The controller: launches torchrun under a strategy, follows the run, switches by checkpoint + relaunch.

Data flows one way: config -> controller -> torchrun -> workers -> telemetry -> controller, and the
run directory is the record (events.jsonl written here, metrics.jsonl by worker rank 0).

A launch ends as such only by a stop rule, the end of its stage, or a stop the controller asked for:
each `checkpoint_and_exit` command carries an id the workers echo in their outcome. A job that stopped
on its own (a stray SIGTERM to a rank, a lost telemetry connection) failed, and is recovered from like
any failure. One job owns the run folder at a time: after a failure the next launch starts only once
the failed one's processes are gone (they may be checkpointing), and rows of any launch but the running
one are ignored (and logged).

What happens after a launch fails, and where a restart or `--resume` continues, is `recovery.py`'s;
starting a torchrun job is `jobs.py`'s; the pre-warmed next launch is `standby.py`'s. The controller's
own state goes to controller_state.json whenever it changes, so `cona train --resume RUN_DIR`
continues after the controller was stopped or killed.
"""

from __future__ import annotations

import errno
import json
import queue
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from cona_cli.cluster.launchers import Agent, make_launcher
from cona_cli.cluster.nodes import ClusterError, head_address, is_multi_node, may_use_gpus, resolve_nodes
from cona_cli.cluster.shared_storage import check_shared
from cona_cli.cluster.slurm import requeue
from cona_cli.control import usable_checkpoints as checkpoints
from cona_cli.control.clock_table import clock_spec, describe
from cona_cli.control.failures import Failure, parse_failure
from cona_cli.control.jobs import EventLog, JobStarter, record_memory_estimate, worker_args
from cona_cli.control.metric_sinks import open_sinks
from cona_cli.control.policies import Policy, Stage
from cona_cli.control.recovery import LaunchResult, NoUsableCheckpoint, Recovery, Stop
from cona_cli.control.run_console import RunConsole
from cona_cli.control.runstate import RunState, stage_from_dict, stage_to_dict, wait_for_group
from cona_cli.control.standby import StandbyPool
from cona_cli.control.telemetry_server import TelemetryServer
from cona_core.clock import ClockSpec, busy_warning
from cona_core.config import Config
from cona_core.rundir import RunDir, committed
from cona_core.strategy import Strategy, resizable

INTERRUPT_GRACE_S = 120.0  # for workers to checkpoint after a stop command, before SIGKILL
NODE_FAILURE_GRACE_S = 20.0  # for the other nodes to stop after one node failed, before SIGKILL
KILL_WAIT_S = 10.0  # after SIGKILL, before the local end (an ssh client) is abandoned
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGUSR1: 138}
# The run folder cannot take the controller's state or events: it stops in one line (checkpoints stay).
RUN_FOLDER_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
Prev = tuple[Strategy, dict[str, Any]]  # strategy and outcome of the last launch that ended normally


class Controller:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        policy: Policy,
        console: Console | None = None,
        verbose: bool = False,
        resume: RunState | None = None,
        log_format: str = "auto",
    ) -> None:
        """`resume`: the saved state of an earlier controller of this run (`cona train --resume`);
        `log_format`: the console's (`run_console.LOG_FORMATS`)."""
        self.cfg, self.run_dir, self.policy = cfg, run_dir, policy
        self.files = RunDir(run_dir)
        self.console = console or Console(stderr=True)
        self.verbose = verbose
        self.resumed = resume is not None
        self.state = resume or RunState()
        self.run_start = time.time() - self.state.elapsed_s  # run time continues, the stopped gap excluded
        self.clock = self._clock_spec()
        self.sinks = open_sinks(cfg, self.files)  # TensorBoard, W&B
        self.out = RunConsole(self.console, cfg, log_format)
        self.events = EventLog(self.files.events, self._run_time, self._on_event)
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
        self.jobs = JobStarter(
            cfg,
            self.files,
            self.nodes,
            self.launcher,
            self.telemetry,
            self.run_start,
            self.console,
            verbose,
            self.multi_node,
        )
        self.recovery = Recovery(
            cfg, self.files, policy, self.events, self.console, self.state, self.run_start, self.multi_node
        )
        self.standbys = StandbyPool(
            cfg, self.files, policy, self.events, self.state, self.jobs.start, self.telemetry.token
        )
        self.signal_received: int | None = None
        self.stop_now = False  # a second signal: the workers are killed instead of waited for
        self.launch = self.state.launch
        self.last_metric: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self._dirty = False  # the last drain changed something worth saving
        self._exiting: list[tuple[Agent, threading.Thread]] = []  # a switched-from job still shutting down
        self._switch: dict[str, float | bool] = {}  # run times of the running switch's phases, standby flags
        self.stage: Stage | None = None  # what the running launch runs (an in-place resize changes it)
        self._resizing: Stage | None = None  # a resize sent to the running job, not yet seen in its steps
        self._sync_step: int | None = None  # virtual clock: the step rank 0 waits for an answer to
        self._stop_id: str | None = None  # the id of the stop command sent to the running job
        self._ignored: set[Any] = set()  # launches whose rows arrived while another one ran (logged once)

    def _clock_spec(self) -> ClockSpec | None:
        """Under the virtual clock, its table (resolved once per run, kept in the run folder), printed."""
        if self.cfg.train.clock == "wall":
            return None
        if self.resumed and self.files.clock.is_file():
            spec = ClockSpec.from_json(self.files.clock.read_text())
        else:
            spec = clock_spec(self.cfg, self.files, self.policy.strategies())
            self.files.clock.write_text(spec.to_json())
        lines = describe(spec)
        where = f" (cache {spec.cache})" if spec.cache else ""
        self.console.print(f"cona: virtual clock, table {spec.source}{where}; the fastest of each global batch:")
        for line in lines:
            self.console.print(f"  {line}", markup=False, highlight=False)
        warning = busy_warning(spec.busy, spec.cache)
        if warning:
            self.console.print(f"[yellow]cona: {warning}[/yellow]")
        return spec

    # -- public ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run to completion; returns the process exit code."""
        for sig in EXIT_CODES:  # SIGUSR1: Slurm's warning before the time limit (`--sbatch` scripts)
            signal.signal(sig, self._on_signal)
        try:
            if self.multi_node:
                check_shared(self.launcher, self.nodes, self.run_dir, self.cfg.cluster.probe_timeout_s)
            with self.out:
                return self._run()
        except ClusterError as e:
            self.console.print(f"[red]cona: {e}[/red]")
            return self._exit(1, "failed", self.last_metric.get("step", 0))
        except NoUsableCheckpoint as e:
            self.console.print(f"[red]cona: {e}[/red]")
            return self._exit(1, "failed", self.last_metric.get("step", 0))
        except OSError as e:
            if e.errno not in RUN_FOLDER_UNWRITABLE:
                raise
            self.console.print(f"cona: {self._unwritable(e)}", markup=False, highlight=False, soft_wrap=True)
            return 1  # (no exit event: the run folder takes no more writes)
        finally:
            self.standbys.drop()
            self._reap_exiting()
            self.telemetry.close()
            self.sinks.close()

    def _unwritable(self, e: OSError) -> str:
        """One line: the controller's own file that could not be written, and where the run stands."""
        kept = committed(self.files.checkpoints)
        where = f"its last checkpoint {kept[0]} is kept" if kept else "it has no checkpoint yet"
        return (
            f"cannot write {e.filename or self.run_dir}: {e.strerror}; the run stops ({where}; the workers "
            f"checkpoint if they can); free space, then cona train --resume {self.run_dir}"
        )

    def _on_event(self, event: dict[str, Any]) -> None:
        self.sinks.event(event)
        self.out.event(event)

    def _run(self) -> int:
        ckpt: Path | None = None
        stage: Stage | None
        launch_reason: str | None = None
        prev: Prev | None = None
        if self.state.prev is not None:
            prev = (Strategy.parse(self.state.prev["strategy"]), self.state.prev["outcome"])
        if self.resumed:
            point = self.recovery.resume(stage_from_dict(self.state.stage), self.launch)
            ckpt, stage, launch_reason = point.checkpoint, point.stage, point.reason
        else:
            clock = {"clock": "virtual", "clock_table": self.clock.source} if self.clock else {"clock": "wall"}
            self.events.write(
                "start", config=self.cfg.source, policy=self.policy.name, world=self.cfg.cluster.world, **clock
            )
            stage = self.policy.first()
        while stage is not None:
            if self.signal_received is not None:
                return self._interrupted(None)
            self._save_state(stage, prev)
            result, requested = self._run_launch(stage, ckpt, prev, launch_reason)
            stage, outcome = self.stage, result.outcome
            if self.signal_received is not None:
                return self._interrupted(outcome)
            if result.needs_recovery:
                self._switch = {}
                assert stage is not None
                then = self.recovery.after_failure(result, ckpt, stage, self.launch)
                if isinstance(then, Stop):
                    return self._exit(then.code, then.reason, self.last_metric.get("step", 0))
                if self.last_metric.get("launch") == self.launch:
                    prev = None  # the switch into this strategy is already recorded
                ckpt, stage, launch_reason = then.checkpoint, then.stage, then.reason
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

    def _save_state(self, stage: Stage | None, prev: Prev | None) -> None:
        st = self.state
        st.stage, st.launch, st.elapsed_s = stage_to_dict(stage), self.launch, time.time() - self.run_start
        st.prev = {"strategy": str(prev[0]), "outcome": prev[1]} if prev else None
        st.policy = self.policy.state_dict()
        st.save(self.run_dir)

    # -- one launch --------------------------------------------------------------------------

    def _run_launch(
        self, stage: Stage, resume: Path | None, prev: Prev | None, reason: str | None
    ) -> tuple[LaunchResult, Stage | None]:
        self.launch += 1
        self.stage, self._resizing, self._stop_id = stage, None, None
        step = checkpoints.checkpoint_step(resume) if resume else 0
        record_memory_estimate(self.cfg, self.files, stage.strategy)
        outcome_path = self.files.launch_outcome(self.launch)
        outcome_path.unlink(missing_ok=True)  # a leftover of a launch the controller never saw
        standby = self.standbys.warm_for(self.launch)
        warm = standby is not None
        self.events.write(
            "launch",
            launch=self.launch,
            strategy=stage.strategy.to_dict(),
            from_checkpoint=str(resume) if resume else None,
            step=step,
            reason=reason or stage.reason,
            standby=warm,
        )
        self.policy.standby_ready = self.policy.standby_importing = False  # the standby is this launch now, or gone
        if standby is not None:
            agents, pumps = self.standbys.hand_over(stage, resume).agents, standby.pumps
        else:
            self.standbys.drop()
            agents, pumps = self.jobs.start(
                self.launch, worker_args(self.run_dir, stage, self.launch, resume), self._clock_start(resume)
            )
        self._switch.update(handover=self._run_time(), standby=warm, standby_ready=warm and standby.ready_logged)
        self.state.agent_pids = [a.pid for a in agents]
        self._save_state(stage, prev)
        per_node = len(agents) > 1
        requested, failed, exiting = self._follow(agents, prev, outcome_path)
        if failed:
            self._wait_until_gone(agents)
        self._switch["outcome"] = self._run_time()
        if exiting:  # handed over before the old job finished exiting: it ends in the background
            self._exiting += list(zip(agents, pumps))
        else:
            for pump in pumps:
                pump.join(timeout=5)
        outcome = json.loads(outcome_path.read_text()) if outcome_path.is_file() else None
        if outcome is not None:
            self.state.clock_s = max(self.state.clock_s, float(outcome.get("clock_s", outcome["time"])))
        self._drain(prev)
        self._save_state(self.stage, prev)
        if not failed:
            stopped = self._stopped_on_its_own(outcome)
            failure = Failure.stopped_on_its_own(stopped) if stopped else None
            return LaunchResult(0, outcome, None, failure, self._log_path(agents[0], per_node)), requested
        parsed = [
            (a, path, parse_failure(path.read_text(errors="replace") if path.is_file() else "", a.poll() or 1))
            for a, path in ((a, self._log_path(a, per_node)) for a in failed)
        ]
        agent, path, failure = next((r for r in parsed if not r[2].knock_on), parsed[0])
        return LaunchResult(failure.exit_code, outcome, agent, failure, path), requested

    def _stopped_on_its_own(self, outcome: dict[str, Any] | None) -> str | None:
        """The outcome's reason when the job stopped without being asked: a rank's SIGTERM, a lost telemetry
        connection, or a stop command whose id is not the one sent to it; None for a stop rule, the stage's
        end or the stop asked for."""
        reason = outcome["reason"] if outcome is not None else None
        if reason in ("signal", "controller_lost"):
            return reason
        if reason == "command" and (self._stop_id is None or outcome.get("stop_id") != self._stop_id):
            return reason
        return None

    def _wait_until_gone(self, agents: list[Agent]) -> None:
        """The failed launch's processes may outlive its agents (an agent killed: its ranks got SIGTERM and
        checkpoint on their way out). Wait for each agent's process group to empty, killing what is left
        after `INTERRUPT_GRACE_S`, so that the next launch runs alone in the run folder and starts from
        the checkpoint they wrote."""
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        for agent in agents:
            wait_for_group(agent.pid, max(0.0, deadline - time.monotonic()))

    def _run_time(self) -> float:
        """Seconds since the run started: the host's, or under the virtual clock the latest time reported."""
        return self.state.clock_s if self.clock is not None else time.time() - self.run_start

    def _clock_start(self, resume: Path | None) -> dict[str, str]:
        """Under the virtual clock, where this launch begins: after the run time reported so far and, from
        a checkpoint, its load (the workers add their start); and when it was started, on the host's clock."""
        if self.clock is None:
            return {}
        start = self.state.clock_s + (self.clock.checkpoint_s if resume else 0.0)
        return {"CONA_CLOCK_START": repr(start), "CONA_LAUNCH_START": repr(time.time())}

    def _log_path(self, agent: Agent, per_node: bool) -> Path:
        return self.files.launch_log(self.launch, agent.label if per_node else None)

    def _relaunch_expected(self) -> Strategy | None:
        """The strategy the next switch most likely goes to, unless the running job can resize into it."""
        nxt = self.policy.expected_next()
        if nxt is not None and self._resizes_into(nxt):
            return None
        return nxt

    def _resizes_into(self, strategy: Strategy) -> bool:
        return self.policy.in_place and self.stage is not None and resizable(self.stage.strategy, strategy)

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
            outcome = json.loads(outcome_path.read_text())
            reason = outcome["reason"]
        except (OSError, ValueError, KeyError):
            return False
        asked = reason == "command" and requested is not None and outcome.get("stop_id") == self._stop_id
        return reason == "stage_end" or asked

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

    def _follow(
        self, agents: list[Agent], prev: Prev | None, outcome_path: Path
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
            self.standbys.poll(int(self.last_metric.get("step", 0)))
            switch_to = self._drain(prev, wait=0.2)
            if self._dirty:
                self._save_state(self.stage, prev)
            if switch_to is not None and requested is None and self._resizing is None:
                self._switch = {"decision": self._run_time()}
                if not (self._resizes_into(switch_to.strategy) and self._resize(switch_to)):
                    requested = switch_to
            self.standbys.maybe_prepare(requested.strategy if requested is not None else self._relaunch_expected())
            wants_stop = requested is not None or self.signal_received is not None or failed
            if wants_stop and stop_sent_at is None:
                # For a switch the workers skip the evaluation that ends a run; they echo the id.
                self._stop_id = secrets.token_hex(8)
                stop = {"cmd": "checkpoint_and_exit", "switch": self.signal_received is None, "id": self._stop_id}
                if failed or not self.telemetry.send(stop):
                    for a in agents:  # no telemetry, or a node is gone: workers checkpoint on SIGTERM if they can
                        a.signal(signal.SIGTERM)
                stop_sent_at = time.monotonic()
            if self._sync_step is not None:  # after any command for that step, so it lands at the next
                self.telemetry.send({"cmd": "sync", "step": self._sync_step})
                self._sync_step = None
            grace = 0.0 if self.stop_now else NODE_FAILURE_GRACE_S if failed else INTERRUPT_GRACE_S
            if stop_sent_at is not None and killed_at is None and time.monotonic() - stop_sent_at >= grace:
                if self.stop_now:
                    self.console.print("cona: a second signal: killing the workers (committed checkpoints stay)")
                for a in agents:
                    a.signal(signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at is not None and not abandoned and time.monotonic() - killed_at > KILL_WAIT_S:
                for a in agents:
                    a.abandon()
                abandoned = True

    def _resize(self, stage: Stage) -> bool:
        """Ask the running job to take `stage`'s batch from its next step; False if it cannot be told."""
        record_memory_estimate(self.cfg, self.files, stage.strategy)
        resize = {"cmd": "resize", "strategy": str(stage.strategy), "checkpoint": self.policy.checkpoint_resizes}
        if not self.telemetry.send(resize):
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

    def _drain(self, prev: Prev | None, wait: float = 0.0) -> Stage | None:
        """Handle queued telemetry messages; returns the first stage the policy wants to switch to. The
        first, as when the rows arrive one at a time: what a loaded host queues must not change the
        decision acted on (a recorded run replays exactly, `cona_cli.simulate.replay`)."""
        switch_to = None
        self._dirty = False
        try:
            msg = self.telemetry.messages.get(timeout=wait) if wait else self.telemetry.messages.get_nowait()
        except queue.Empty:
            return None
        while True:
            if self._foreign(msg):
                pass
            elif msg.get("type") == "sync":  # rank 0 waits: answer before reading on (`_follow`)
                self._sync_step = int(msg["step"])
                return switch_to
            else:
                stage = self._handle(msg, prev)
                switch_to = switch_to or stage
            try:
                msg = self.telemetry.messages.get_nowait()
            except queue.Empty:
                return switch_to

    def _foreign(self, msg: dict[str, Any]) -> bool:
        """Whether `msg` is a row (metric, sync) of another launch than the running one: a job that should be
        gone. Ignored; the first of each such launch is logged."""
        launch = msg.get("launch")
        if msg.get("type") not in ("metric", "sync") or launch == self.launch:
            return False
        if launch not in self._ignored:
            self._ignored.add(launch)
            self.recovery.warn(f"ignoring rows of launch {launch}: launch {self.launch} is running")
        return True

    def _handle(self, msg: dict[str, Any], prev: Prev | None) -> Stage | None:
        kind = msg.get("type")
        stage = self.stage
        assert stage is not None
        if kind == "metric":
            self.sinks.metric(msg)
        if kind == "ready" and msg.get("launch") == self.launch:
            self._switch.update(
                ready=float(msg["time"]), load_s=float(msg.get("setup_s", 0.0)), prepared=bool(msg.get("prepared"))
            )
        if kind == "checkpoint" and msg.get("reason") == "switch":
            self._switch["save_s"] = float(msg["seconds"])
        if kind == "metric" and "time" in msg:
            self.state.clock_s = max(self.state.clock_s, float(msg["time"]))
        if kind == "checkpoint":
            self.events.write("checkpoint", **{k: msg.get(k) for k in ("step", "path", "seconds", "bytes", "reason")})
        elif kind == "metric" and msg.get("kind") == "eval":
            self.last_eval = msg
            self.out.eval(msg)
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
            self.out.step(msg, stage.strategy)
            switch_to = self.policy.on_metric(msg)
            if msg.get("launch") == self.launch:
                self.standbys.maybe_start(self.launch + 1, self._relaunch_expected(), int(msg["step"]))
            return switch_to
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
            f"cona: {reason} at step {step}{ppl_text} after {self._run_time():.1f} s "
            f"({self.launch} launches); run dir {self.run_dir}"
        )
        return code

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """The first signal asks the workers to checkpoint and stop; a second one kills them now (the
        checkpoint being written is never committed, so the last committed one is the run's)."""
        if self.signal_received is not None:
            self.stop_now = True
            return
        self.signal_received = signum
