"""What torchrun runs: one rank of a training job under one strategy.

`python -m launch.worker --run-dir RUN --strategy dp2-tp1-pp2-mbs2-gbs16 --launch 2 [--resume CKPT]
[--stop-step N]`. Trains from the checkpoint (or from scratch) until a stop rule, the stage end or a
controller command, saves a checkpoint and writes `RUN/launches/NNN.json` saying why it stopped.
The controller may also change the micro- and global batch in place (`resize`: same dp, tp and pp,
pp = 1): every rank takes the new batch from the step after the one in which rank 0 read the command.
Also checkpoints every `train.checkpoint_interval` steps / `checkpoint_interval_s` seconds, and
checkpoints and exits if the controller goes away (its telemetry connection closes) or a SIGTERM reaches
any rank: every rank learns of either in the step's all-reduce and stops after the same step. The
outcome says why (`signal`, `controller_lost`, or `command` with the id of the controller's command), so
the controller can tell a stop it asked for from one it did not. A checkpoint that cannot be loaded ends
the rank with exit code `BAD_CHECKPOINT_EXIT`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from cona_cli.clock import CALIBRATION_STEPS, TIMING, ClockSpec, VirtualClock, WallClock
from cona_cli.config import Config, config_from_json
from cona_cli.gns import NoiseWindow, two_batch_estimate
from cona_cli.rundir import BAD_CHECKPOINT_EXIT, OUT_OF_MEMORY_EXIT, RunDir
from cona_cli.strategy import Strategy, resizable
from launch import checkpoint, testhooks
from launch.data.corpus import CorpusInfo
from launch.data.prefetch import BatchKey, Prefetcher, to_device
from launch.data.sampling import TokenStream, eval_batches
from launch.device import (
    DeviceError,
    gpus_wanted,
    group_device,
    headroom_bytes,
    init_distributed,
    is_out_of_memory,
    peak_memory,
    reset_peak_memory,
    shorten_timeouts,
    threads_per_rank,
)
from launch.gradstats import NoiseNorms, local_grad_sq, scale_grads
from launch.layout import Layout, build_layout
from launch.lr import learning_rate, progress_tokens
from launch.models import get_spec
from launch.models.spec import IGNORE_INDEX, Batch
from launch.precision import resolve_precision
from launch.snapshot import Snapshot
from launch.telemetry_client import TelemetryClient

# Rank 0's stop decision in the step's all-reduce (every rank adds whether a SIGTERM reached it).
_STOP_COMMAND, _STOP_TIME, _STOP_SWITCH, _STOP_LOST = 1.0, 2.0, 3.0, 4.0
_SAVE_PERIODIC, _SAVE_RESIZE = 1.0, 2.0  # rank 0's checkpoint decision after the step
_CONTROL_SLOTS = 12  # the step's all-reduced scalars besides each rank's two memory slots (`train_step`)


@dataclass
class TrainerState:
    """Everything besides model and optimizer that a checkpoint must carry to continue exactly."""

    step: int = 0
    consumed_samples: int = 0
    time: float = 0.0  # run time of the last step
    last_eval_time: float = 0.0
    last_eval_step: int | None = None
    best_val_ppl: float | None = None
    progress_tokens: float = 0.0  # the LR schedule's clock (`launch.lr`)
    gns_from_step: int = 0  # the GNS estimator is held until this step (Adam's v̂ settles)
    extra: dict[str, Any] = field(default_factory=dict)


class StepOut(NamedTuple):
    loss: float
    grad_norm: float
    stop: str | None  # why the job stops after this step: "command", "signal", "controller_lost", "max_time"
    eval: bool  # rank 0 wants an evaluation after this step
    checkpoint: str | None  # rank 0 wants a checkpoint after this step: "periodic" (time-based) or "resize"
    written: bool  # every rank's shards of the checkpoint being written in the background are written
    noise: dict[str, float]
    memory: dict[str, Any]  # peak memory (max over ranks) and the planner's estimate
    strategy: Strategy  # what the step ran under (the next one may run resized)


def out_of_memory_line(rank: int, strategy: Strategy, peak: int, e: BaseException) -> str:
    """What an out-of-memory rank says last (`cona_cli.control.failures` reads the strategy and the peak)."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"cona-worker rank {rank}: out of memory under {strategy}: peak {peak} bytes ({type(e).__name__}: {first})"


@contextmanager
def exit_on_out_of_memory(strategy: Callable[[], Strategy], device: torch.device) -> Iterator[None]:
    """An out-of-memory error ends the rank with `OUT_OF_MEMORY_EXIT` and one line naming the strategy
    running then and the rank's measured peak (the controller marks the strategy infeasible)."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        line = out_of_memory_line(dist.get_rank(), strategy(), int(peak_memory(device)[0]), e)
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(OUT_OF_MEMORY_EXIT)  # not sys.exit: the other ranks wait in collectives that will never complete


class Worker:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        strategy: Strategy,
        launch: int,
        device: torch.device | None = None,
        layout: Layout | None = None,
        fresh: bool = True,
    ) -> None:
        """`device`: this rank's (default: the process group's, see `launch.device`); `layout`: mesh,
        model and optimizer already built for `strategy` (a standby's), else built here; `fresh`: no
        checkpoint is loaded after (only then is `model.init_from` read)."""
        self.cfg, self.run_dir, self.strategy, self.launch = cfg, run_dir, strategy, launch
        self.device = device or group_device()
        self.files = RunDir(run_dir)
        self.rank = dist.get_rank()
        self.run_start = float(os.environ.get("CONA_RUN_START", time.time()))
        self.clock = make_clock(cfg, self.files, self.run_start)
        corpus = CorpusInfo.from_json(self.files.corpus.read_text())
        m = cfg.model
        self.spec = get_spec(m.family)
        self.seq_len = m.seq_len
        self.precision = resolve_precision(cfg.search.precision, self.device)  # what runs (auto resolved)
        self.batch = self.spec.batch(corpus.vocab_size)  # the family's (windows, sample ids) -> (inputs, targets)
        self.train_stream = TokenStream(corpus.train_path, m.seq_len, cfg.train.seed, self.batch)
        self.batches = Prefetcher(self.train_stream, self.device)  # on CUDA: the next step's built during this one
        self.valid_path = corpus.valid_path
        if layout is None or layout.strategy != strategy:
            layout = build_layout(cfg, strategy, self.device, corpus.vocab_size, fresh)
        self.prepared = layout.prepared
        self.mesh, self.pm, self.opt = layout.mesh, layout.pm, layout.opt
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        t = cfg.train
        self.memory_estimate = self.files.memory_estimates().get(str(strategy))  # the planner's, from the controller
        self.timeouts_shortened = False
        self.launch_steps = 0  # steps this process ran
        self.unsharded_vote_step = 1  # FSDP's unsharded accumulation is voted on at this one (`train_step`)
        self.state = TrainerState()
        self.small = NoiseNorms(self.pm, self.opt, self.spec.vocab_params) if t.gns else None
        self.noise = NoiseWindow(window=t.gns_window)
        self.gns_hold = math.ceil(1 / (1 - t.beta2))  # steps for Adam's second moment to describe a new batch
        self.state.gns_from_step = self.gns_hold  # held at the start, and after each change of batch
        self.ckpt_root = self.files.checkpoints
        self.telemetry = TelemetryClient() if self.rank == 0 else None
        self.controlled = self.telemetry is not None and self.telemetry.expected
        self.signalled = False  # a SIGTERM reached this rank
        self.stop_command: dict[str, Any] | None = None  # rank 0: the controller's checkpoint_and_exit
        self.controller_lost = False  # rank 0: the telemetry connection broke, or was never made
        self.awaiting_sync: int | None = None  # virtual clock: the step whose commands rank 0 must have
        self.switch_requested = False  # the controller's stop command is for a switch, not the run's end
        self.resize_requested: Strategy | None = None  # rank 0: the batch the controller asked for
        self.save_before_resize = False  # rank 0: that resize's command asks for a checkpoint first
        self.saved: tuple[int, Path] | None = None  # (step, path) of the checkpoint this state is in
        # Periodic checkpoints written in the background (DCP's async_save) on a gloo group of their own.
        # (Not under the virtual clock: when a background write is done is the host's business.)
        background = checkpoint.async_saves(t.checkpoint_async, self.device) and not self.clock.virtual
        self.async_group = dist.new_group(backend="gloo") if background else None
        self.pending: checkpoint.PendingSave | None = None  # a periodic checkpoint still being written
        self.last_save_time = self.now()
        self.last_save_s = 0.0  # how long the last save took: stretches the periodic interval
        self.metrics = open(self.files.metrics, "a") if self.rank == 0 else None
        self.setup_s = 0.0  # process group, model, layout and checkpoint load: set by run()
        # The launch's start on the host's clock: process start, imports, process group, model and layout.
        self.start_wall = time.time() - float(os.environ.get("CONA_LAUNCH_START", time.time()))

    # -- bookkeeping -------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now()

    def emit(self, row: dict[str, Any]) -> None:
        """Rank 0: append a metrics row and stream it to the controller."""
        if self.metrics is None:
            return
        row = {**row, "wall_clock": round(time.time(), 3)}
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.telemetry is not None:
            self.telemetry.send({"type": "metric", **row})

    def restore(self, path: Path) -> None:
        saved = checkpoint.load(path, self.pm.model, self.opt)
        self.state = TrainerState(**saved["trainer"])
        if "progress_tokens" not in saved["trainer"]:  # a checkpoint from before the progress clock
            self.state.progress_tokens = float(self.state.consumed_samples * self.seq_len)
        self.saved = (self.state.step, path)
        saved_gbs = Strategy.from_mapping(saved["strategy"]).gbs if "strategy" in saved else self.strategy.gbs
        if saved_gbs != self.strategy.gbs:  # relaunched under another batch: Adam's v̂ describes the old one
            self.state.gns_from_step = self.state.step + self.gns_hold
        # A checkpoint from before the window (exponential averages, no "entries") starts an empty one.
        entries = self.state.extra.get("gns", {}).get("entries", [])
        self.noise = NoiseWindow(window=self.cfg.train.gns_window, entries=entries)

    def save(self, reason: str) -> Path:
        """Checkpoint the current state (collective); a state already saved is not saved again."""
        self.finish_pending()
        step = self.state.step
        if self.saved is not None and self.saved[0] == step:
            return self.saved[1]
        path, seconds, nbytes = checkpoint.save(
            self.ckpt_root,
            step,
            self.pm.model,
            self.opt,
            self._trainer(),
            self.cfg.train.checkpoint_keep,
            self._hook(step),
        )
        self._saved(step, path, seconds, nbytes, reason)
        return path

    def save_periodic(self) -> None:
        """A periodic checkpoint (collective): in the background where async saves are on, else as `save`."""
        if self.async_group is None:
            self.save("periodic")
            return
        self.finish_pending()
        if self.saved is not None and self.saved[0] == self.state.step:
            return
        self.pending = checkpoint.save_async(
            self.ckpt_root, self.state.step, self.pm.model, self.opt, self._trainer(), self.async_group
        )
        self.last_save_time = self.now()

    def finish_pending(self) -> None:
        """Commit the periodic checkpoint being written in the background, waiting for it if need be."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        t = self.cfg.train
        path, seconds, nbytes = checkpoint.finish_save(
            pending, self.ckpt_root, self.pm.model, self.opt, t.checkpoint_keep, self._hook(pending.step)
        )
        self._saved(pending.step, path, seconds, nbytes, "periodic")

    def _trainer(self) -> dict[str, Any]:
        self.state.extra["gns"] = self.noise.state_dict()
        return {"trainer": self.state.__dict__, "strategy": self.strategy.to_dict(), "launch": self.launch}

    def _hook(self, step: int) -> Callable[[], None]:
        """What runs inside step `step`'s save, after this rank's shards are written and before the commit
        (test hooks)."""

        def hook() -> None:
            testhooks.save_delay()
            testhooks.maybe_die(self.run_dir, "save", step, self.rank)

        return hook

    def _saved(self, step: int, path: Path, seconds: float, nbytes: int, reason: str) -> None:
        """A checkpoint of step `step` is committed: `seconds` is how long training waited for it."""
        seconds = self.clock.saved(seconds)
        self.saved, self.last_save_s = (step, path), seconds
        if reason != "periodic" or self.async_group is None:  # (async: the interval counts from its start)
            self.last_save_time = self.now()
        if self.telemetry is not None:
            self.telemetry.send(
                {
                    "type": "checkpoint",
                    "launch": self.launch,
                    "step": step,
                    "path": str(path),
                    "seconds": round(seconds, 4),
                    "bytes": nbytes,
                    "reason": reason,
                }
            )

    # -- one step ----------------------------------------------------------------------------

    def _sum_over_ranks(self, values: list[torch.Tensor | float]) -> torch.Tensor:
        """Sum a few scalars (host numbers or 0-d device tensors) over all ranks with one all-reduce on the
        rank's device; the sums stay there until read."""
        t = torch.tensor([0.0 if isinstance(v, torch.Tensor) else v for v in values], dtype=torch.float64)
        t = t.to(self.device)  # one host-to-device copy for the host numbers
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                t[i] = v
        dist.all_reduce(t)
        return t

    def _reduce(self, values: list[torch.Tensor | float]) -> list[float]:
        """`_sum_over_ranks`, read on the host."""
        return self._sum_over_ranks(values).tolist()

    def _memory_slots(self) -> list[float]:
        """This rank's peak memory at its own place among all ranks' (summed over ranks: everyone's)."""
        slots = [0.0] * (2 * dist.get_world_size())
        slots[2 * self.rank : 2 * self.rank + 2] = peak_memory(self.device)
        return slots

    def memory_fields(self, slots: list[float]) -> dict[str, Any]:
        """Step-row memory fields: the maximum over ranks of the peaks, and the planner's estimate."""
        fields: dict[str, Any] = {}
        if self.device.type == "cuda":
            fields["peak_allocated_bytes"] = int(max(slots[0::2]))
            fields["peak_reserved_bytes"] = int(max(slots[1::2]))
        else:
            fields["peak_rss_bytes"] = int(max(slots[0::2]))
        if self.memory_estimate is not None:
            fields["memory_estimate_bytes"] = int(self.memory_estimate)
        return fields

    def _counts_loss(self) -> bool:
        return self.pm.is_last and self.tp_rank == 0

    def time_is_up(self) -> bool:
        return self.cfg.train.max_time is not None and self.now() >= self.cfg.train.max_time

    def _stop_code(self) -> float:
        """Rank 0's stop decision for every rank: the controller's command, a lost controller, max_time.
        Polled as late as possible: a command that came during this step stops the job after it."""
        self.poll_commands(self.state.step + 1)
        if self.stop_command is not None:
            return _STOP_SWITCH if self.stop_command.get("switch") else _STOP_COMMAND
        if self.controller_lost:
            return _STOP_LOST
        return _STOP_TIME if self.time_is_up() else 0.0

    def _checkpoint_code(self, resize: Strategy | None) -> float:
        """Rank 0's checkpoint decision for after this step: `resize` when the job resizes after it, the
        controller asked for a checkpoint first and this launch has none to go back to but the run's start
        (a kill after the climb then keeps it); else `periodic` when its time has come."""
        if self.rank != 0:
            return 0.0
        if resize is not None and self.save_before_resize and self.saved is None:
            return _SAVE_RESIZE
        return _SAVE_PERIODIC if self.checkpoint_due_by_time() else 0.0

    def checkpoint_due_by_time(self) -> bool:
        t = self.cfg.train
        if t.checkpoint_interval_s is None:
            return False
        interval = max(t.checkpoint_interval_s, self.last_save_s / t.checkpoint_max_share)  # saves ≤ that share
        return self.now() - self.last_save_time >= interval

    def train_step(self, want_eval: bool) -> StepOut:
        s, st, t = self.strategy, self.state, self.cfg.train
        gns = self.noise.gns
        lr = learning_rate(t, st.progress_tokens, s.gbs, gns)
        for group in self.opt.param_groups:
            group["lr"] = lr
        torch.manual_seed(t.seed * 1_000_003 + st.step * 1009 + self.dp_rank * 31 + self.pp_rank)
        micro = self.batches.take(BatchKey(st.consumed_samples, s.gbs, s.dp, self.dp_rank, s.mbs))
        self.opt.zero_grad(set_to_none=True)
        if self.small is not None:
            self.small.begin_step(measure=st.step >= st.gns_from_step)
        loss_sum = self.pm.forward_backward(micro)
        testhooks.maybe_die(self.run_dir, "step", st.step + 1, self.rank)
        testhooks.step_delay()
        self.pm.average_grads()
        # Rank 0 decides command- and time-driven stops, evaluations and checkpoints for everyone; every
        # rank says whether a SIGTERM reached it.
        stop = self._stop_code() if self.rank == 0 else 0.0
        resize, self.resize_requested = self.resize_requested, None
        writing = self.pending is not None and not self.pending.written()
        # At the first steady step (after the first, or after a resize) every rank says whether its
        # measured peak leaves room for the unsharded gradients; FSDP skips the middle micro-batches'
        # reduce-scatters from the next step on if all do (every rank must skip the same ones).
        voting = self.pm.can_accumulate_unsharded and self.launch_steps == self.unsharded_vote_step
        veto = voting and headroom_bytes(self.device, self.cfg.search.memory_margin) < self.pm.unsharded_grad_bytes()
        sums = self._sum_over_ranks(
            [
                loss_sum if self._counts_loss() else 0.0,
                local_grad_sq(self.pm),
                self.small.small_share() if self.small is not None else 0.0,
                self.small.big_share() if self.small is not None else 0.0,
                stop,
                float(self.signalled),
                float(self.rank == 0 and want_eval),
                self._checkpoint_code(resize),
                float(writing),
                float(resize.mbs) if resize else 0.0,
                float(resize.gbs) if resize else 0.0,
                float(veto),
                *self._memory_slots(),
            ]
        )
        if t.grad_clip:  # on the device: clip_grad_norm_'s clamped coefficient, nothing read on the host
            scale_grads(self.pm, (t.grad_clip / (sums[1].sqrt() + 1e-6)).clamp(max=1.0))
        self.opt.step()
        # The step's one host read, after the optimizer step: it waits for the step's work on the
        # device, so it is also what the step's timing needs.
        (
            loss_total,
            grad_sq,
            small_sq,
            big_sq,
            stop_code,
            signals,
            eval_votes,
            ckpt_code,
            writers,
            new_mbs,
            new_gbs,
            vetoes,
            *slots,
        ) = sums.tolist()
        if voting:
            self.pm.accumulate_unsharded = vetoes == 0
        self.launch_steps += 1
        noise = self._update_noise(small_sq, big_sq)
        grad_norm = math.sqrt(grad_sq)
        st.step += 1
        st.consumed_samples += s.gbs
        st.progress_tokens += progress_tokens(t.lr_scaling, s.gbs, t.lr_base_gbs or s.gbs, gns, self.seq_len)
        self.switch_requested = stop_code == _STOP_SWITCH  # every rank learns it: ends_run() must agree
        out = StepOut(
            loss_total / (s.dp * s.n_microbatches),
            grad_norm,
            stop_cause(stop_code, signals),
            eval_votes > 0,
            {_SAVE_PERIODIC: "periodic", _SAVE_RESIZE: "resize"}.get(ckpt_code),
            self.pending is not None and writers == 0,
            noise,
            self.memory_fields(slots),
            s,
        )
        if new_gbs:
            self.resize(replace(s, mbs=round(new_mbs), gbs=round(new_gbs)))
        return out

    def resize(self, strategy: Strategy) -> None:
        """Run the next steps under `strategy`, the same layout with another micro- and global batch: the
        data stream continues at `consumed_samples`, the LR follows the new batch, and the GNS estimator
        and the evaluation batches are rebuilt for it. Every rank calls this after the same step."""
        self.strategy = self.pm.strategy = strategy
        self.pm.accumulate_unsharded, self.unsharded_vote_step = False, self.launch_steps  # the new batch votes
        if self.small is not None:
            self.small.resize()
        self.state.gns_from_step = self.state.step + self.gns_hold
        self.__dict__.pop("eval_set", None)
        self.memory_estimate = self.files.memory_estimates().get(str(strategy))
        reset_peak_memory(self.device)  # the new batch's own peak (CUDA; the CPU's peak RSS cannot go down)
        self.ensure_timed()
        testhooks.maybe_die(self.run_dir, "resize", self.state.step, self.rank)

    def ensure_timed(self, starting: bool = False) -> None:
        """Whenever a strategy starts (`starting`: a launch; else a resize) under the virtual clock with a
        measured table, a calibration pass of every rank; at a launch, the clock charges its start."""
        clock = self.clock
        if isinstance(clock, VirtualClock) and clock.spec.source == "measured":
            self._calibrate(clock.spec)
        if starting:
            self.clock.started(self.strategy)

    def _calibrate(self, spec: ClockSpec) -> None:
        """Time the running strategy's steps (and, if rank 0's table has no time for it, one evaluation
        and this launch's start, recorded in the table and the host's cache); every rank takes rank 0's.
        The pass runs even when the table has the times, so that every run of a config does the same
        work (DDP, for one, rebuilds its buckets after the first steps it sees, and a run that skipped
        the pass would round its gradients differently)."""
        s = self.strategy
        need = self._reduce([float(self.rank == 0 and spec.seconds(s) is None)])[0] > 0
        logs = [math.log(t) for t in self._time_steps()]
        eval_s = self._time_eval() if need else 0.0
        mine = [0.0] * 4
        if self.rank == 0:
            if need:
                timing = [*step_seconds(logs), self.start_wall, eval_s]
                spec.record(s, dict(zip(TIMING, timing)))
                write_clock_spec(self.files, spec)
                measured = ", ".join(f"{k} {v:.4g}" for k, v in zip(TIMING, timing))
                print(f"cona-worker: clock: {s} measured {measured}", flush=True)
            mine = [spec.table[str(s)], spec.spreads[str(s)], spec.start_s(s), spec.evals[str(s)]]
        spec.take(s, dict(zip(TIMING, self._reduce(mine))))

    def _time_eval(self) -> float:
        """Seconds of one evaluation under the running strategy (its batches built first)."""
        if not self.eval_set:  # (builds the batches first: the timing is of the evaluation alone)
            return 0.0
        t0 = time.perf_counter()
        self.evaluate()
        return time.perf_counter() - t0

    def _time_steps(self) -> list[float]:
        """Seconds of `CALIBRATION_STEPS` training steps of the running strategy on the batches that follow
        (each step's data, work, noise-scale norms and collectives, as `train_step` does them), from and
        back to the state they started at."""
        s, st, t = self.strategy, self.state, self.cfg.train
        snap = Snapshot.take(self.pm.model, self.opt)
        warm, timed = CALIBRATION_STEPS
        times = []
        for i in range(warm + timed):
            t0 = time.perf_counter()
            consumed = st.consumed_samples + i * s.gbs
            micro = self.batches.take(BatchKey(consumed, s.gbs, s.dp, self.dp_rank, s.mbs))
            self.opt.zero_grad(set_to_none=True)
            if self.small is not None:
                self.small.begin_step(measure=True)
            self.pm.forward_backward(micro)
            self.pm.average_grads()
            norms = [self.small.small_share(), self.small.big_share()] if self.small is not None else [0.0, 0.0]
            rest = [0.0] * (_CONTROL_SLOTS - 3 + 2 * s.world)
            sums = self._sum_over_ranks([local_grad_sq(self.pm), *norms, *rest])
            if t.grad_clip:
                scale_grads(self.pm, (t.grad_clip / (sums[0].sqrt() + 1e-6)).clamp(max=1.0))
            self.opt.step()
            sums.tolist()
            if i >= warm:
                times.append(time.perf_counter() - t0)
        snap.restore(self.pm.model, self.opt)
        self.opt.zero_grad(set_to_none=True)
        return times

    def _update_noise(self, small_total: float, big_sq: float) -> dict[str, float]:
        """Feed one step's norms to the GNS estimator; returns the metric fields."""
        if self.small is None or not self.small.active:
            return {}
        raw_g, raw_tr = two_batch_estimate(
            self.small.b_small, small_total / self.small.n_small, self.strategy.gbs, big_sq
        )
        self.noise.add(self.strategy.gbs, raw_g, raw_tr)
        fields = {"grad_sq_raw": raw_g, "trace_raw": raw_tr}
        if self.noise.means is not None:
            fields["grad_sq"], fields["trace"] = self.noise.means
        fields["gns"] = self.noise.gns
        return fields

    def evaluate(self) -> tuple[float, float]:
        """Mean loss per target over a fixed validation slice, identical under every layout (padded to whole
        batches): the exact loss sum over the exact number of targets (masked LM: the masked tokens)."""
        s = self.strategy
        self.pm.model.eval()
        loss_sum: torch.Tensor | float = 0.0
        n_targets: torch.Tensor | float = 0.0
        scale = s.mbs * self.seq_len * self.spec.target_fraction  # what loss_fn divides the sum by
        for micro in self.eval_set:
            loss_sum = loss_sum + self.pm.evaluate(micro) * scale
            n_targets = n_targets + sum((y != IGNORE_INDEX).sum() for _, y in micro)
        self.pm.model.train()
        counts = self._counts_loss()
        total, n = self._reduce([loss_sum if counts else 0.0, n_targets if counts else 0.0])
        val_loss = total / max(n, 1.0)
        return val_loss, math.exp(min(val_loss, 50.0))

    @functools.cached_property
    def eval_set(self) -> list[list[Batch]]:
        """This replica's share of the fixed validation slice, built once per launch."""
        s = self.strategy
        steps = eval_batches(
            self.valid_path, self.seq_len, self.cfg.train.eval_tokens, s.gbs, s.dp, self.dp_rank, s.mbs, self.batch
        )
        return [to_device(micro, self.device) for micro in steps]

    def run_eval(self) -> float:
        val_loss, val_ppl = self.evaluate()
        self.clock.evaluated(self.strategy, self.cfg.train.eval_tokens, self.seq_len)
        st = self.state
        st.last_eval_time, st.last_eval_step = self.now(), st.step
        st.best_val_ppl = val_ppl if st.best_val_ppl is None else min(st.best_val_ppl, val_ppl)
        self.emit(
            {
                "kind": "eval",
                "step": st.step,
                "time": round(st.last_eval_time, 4),
                "val_loss": val_loss,
                "val_ppl": val_ppl,
                "consumed_samples": st.consumed_samples,
                "launch": self.launch,
                "wall_time": round(time.time() - self.run_start, 4),
            }
        )
        return val_ppl

    # -- the loop ----------------------------------------------------------------------------

    def stop_reason(self, val_ppl: float | None) -> str | None:
        t, st = self.cfg.train, self.state
        if t.target_ppl is not None and val_ppl is not None and val_ppl <= t.target_ppl:
            return "target_reached"
        if t.max_steps is not None and st.step >= t.max_steps:
            return "max_steps"
        if t.max_tokens is not None and st.consumed_samples * self.seq_len >= t.max_tokens:
            return "max_tokens"
        return None

    def eval_due(self) -> bool:
        t, st = self.cfg.train, self.state
        by_steps = t.eval_interval is not None and (st.step + 1) % t.eval_interval == 0
        by_time = t.eval_interval_s is not None and self.now() - st.last_eval_time >= t.eval_interval_s
        return by_steps or by_time

    def poll_commands(self, step: int) -> None:
        """Rank 0, in step `step`: a stop command, or a controller that went away (killed) or was never
        reached, stops the job after this step."""
        if not self.controlled:
            return
        if testhooks.disconnect_due(self.run_dir, step):
            self.telemetry.close()
        for msg in self._commands():
            if msg.get("cmd") == "checkpoint_and_exit":
                self.stop_command = msg
            elif msg.get("cmd") == "resize":
                target = Strategy.parse(msg["strategy"])
                if resizable(self.strategy, target):
                    self.resize_requested, self.save_before_resize = target, bool(msg.get("checkpoint"))
                else:
                    print(f"cona-worker: ignoring resize {self.strategy} -> {target}: not the same layout", flush=True)
        if not self.telemetry.connected:
            self.controller_lost = True

    def _commands(self) -> list[dict[str, Any]]:
        """The controller's commands since the last poll. Under the virtual clock, all of them up to its
        answer to the last step's rows (waited for), so a command lands at the same step in every run."""
        assert self.telemetry is not None
        msgs = self.telemetry.poll()
        step, self.awaiting_sync = self.awaiting_sync, None
        if step is None:
            return msgs
        deadline = time.monotonic() + self.cfg.cluster.collective_timeout_s
        while not any(m.get("cmd") == "sync" and m.get("step") == step for m in msgs):
            if not self.telemetry.connected or time.monotonic() > deadline:
                print(f"cona-worker: no answer from the controller to step {step}; going on", flush=True)
                break
            msgs += self.telemetry.poll(timeout=1.0)
        return msgs

    def checkpoint_due(self, out: StepOut) -> str | None:
        """Which checkpoint is due after this step: `resize`, `periodic` (by time or steps), or None."""
        interval = self.cfg.train.checkpoint_interval
        if out.checkpoint is None and interval is not None and self.state.step % interval == 0:
            return "periodic"
        return out.checkpoint

    def ends_run(self, reason: str, stop_step: int | None) -> bool:
        """Whether the launch's stop ends the run: a stop rule, max_time, an interrupt or the last stage of
        a chain; not a switch (a chain's stage end, or a stop command the controller sent for a switch)."""
        if reason == "stage_end":
            chain = self.cfg.chain if self.cfg.policy == "chain" else None
            return bool(chain and chain[-1].steps) and stop_step == sum(c.steps or 0 for c in chain)
        return not (reason == "command" and self.switch_requested)

    def _last_save_reason(self, reason: str) -> str:
        """The launch's last checkpoint is a switch's, an interrupt's (any stop by command or signal, or a
        lost controller) or the run's final one (a stop rule)."""
        if reason == "stage_end" or (reason == "command" and self.switch_requested):
            return "switch"
        return "interrupt" if reason in ("command", "signal", "controller_lost") else "final"

    def train(self, stop_step: int | None, fresh: bool) -> dict[str, Any]:
        t, st = self.cfg.train, self.state
        if self.telemetry is not None:
            self.telemetry.send(
                {
                    "type": "ready",
                    "launch": self.launch,
                    "step": st.step,
                    "time": self.now(),
                    "setup_s": self.setup_s,
                    "prepared": self.prepared,
                }
            )
        self.ensure_timed(starting=True)
        if fresh and (t.eval_interval or t.eval_interval_s):
            self.run_eval()
        reason = self.stop_reason(st.best_val_ppl)  # a resumed run may already be done
        while reason is None:
            if stop_step is not None and st.step >= stop_step:
                reason = "stage_end"
                break
            t0 = time.perf_counter()
            out = self.train_step(self.eval_due())  # returns after the device finished the step
            wall_iter_s = time.perf_counter() - t0
            s = out.strategy
            iter_s = self.clock.step(s, st.step, wall_iter_s)
            st.time = self.now()
            if self.strategy != s:  # resized after this step: the gap before the next one
                self.clock.resized(self.strategy)
            if not self.timeouts_shortened:  # communicators built, shapes inferred: steady-state timeout
                groups = [self.mesh[d].get_group() for d in ("pp", "dp", "tp")]
                shorten_timeouts(self.cfg.cluster.collective_timeout_s, groups)
                self.timeouts_shortened = True
                reset_peak_memory(self.device)  # later rows: the steady state, not start-up and loading
            self.emit(
                {
                    "kind": "step",
                    "step": st.step,
                    "time": round(st.time, 4),
                    "loss": out.loss,
                    "lr": self.opt.param_groups[0]["lr"],
                    **s.to_dict(),
                    "iter_s": iter_s,
                    "tokens_per_s": s.gbs * self.seq_len / iter_s,
                    "consumed_samples": st.consumed_samples,
                    "progress_tokens": round(st.progress_tokens, 1),
                    "grad_norm": out.grad_norm,
                    "launch": self.launch,
                    "wall_time": round(time.time() - self.run_start, 4),
                    "wall_iter_s": wall_iter_s,
                    "precision": self.precision,
                    "recompute": self.cfg.search.recompute,
                    **out.memory,
                    **out.noise,
                }
            )
            val_ppl = self.run_eval() if out.eval else None
            reason = self.stop_reason(val_ppl) or out.stop
            if out.written:
                self.finish_pending()
            due = self.checkpoint_due(out) if reason is None else None
            if due == "resize":
                self.save("resize")
            elif due is not None:
                self.save_periodic()
            if self.clock.virtual and self.controlled:  # the next step waits for the answer to this one
                assert self.telemetry is not None
                self.telemetry.send({"type": "sync", "step": st.step, "launch": self.launch})
                self.awaiting_sync = st.step
        if self.ends_run(reason, stop_step) and st.last_eval_step != st.step:
            self.run_eval()  # the last checkpoint's validation perplexity is always in metrics.jsonl
        path = self.save(self._last_save_reason(reason))
        command = self.stop_command if reason == "command" else None
        return {
            "reason": reason,
            "stop_id": command.get("id") if command is not None else None,  # the controller's, echoed
            "step": st.step,
            "consumed_samples": st.consumed_samples,
            "time": st.time,
            "clock_s": self.now(),  # run time once the last checkpoint is saved
            "checkpoint": str(path),
            "best_val_ppl": st.best_val_ppl,
        }


def stop_cause(code: float, signals: float) -> str | None:
    """Why the job stops after a step, from its all-reduced stop slots: the controller's command first (it
    asked for the stop), then a SIGTERM on any rank, a lost controller, max_time; None: it goes on."""
    if code in (_STOP_COMMAND, _STOP_SWITCH):
        return "command"
    if signals:
        return "signal"
    return {_STOP_LOST: "controller_lost", _STOP_TIME: "max_time"}.get(code)


def step_seconds(logs: list[float]) -> tuple[float, float]:
    """A strategy's table time and noise from the logs of its calibration steps: the log std σ, and the
    time whose draws (times exp(σ·z), `cona_cli.clock.step_factor`) average to the steps' mean, since a
    run's time is their sum."""
    sigma = statistics.stdev(logs)
    return statistics.fmean(math.exp(v) for v in logs) * math.exp(-sigma * sigma / 2), sigma


def make_clock(cfg: Config, files: RunDir, run_start: float) -> WallClock:
    """The run's clock: the host's, or the virtual clock of the run folder's table, starting where the
    controller says this launch begins (`CONA_CLOCK_START`)."""
    if cfg.train.clock == "wall":
        return WallClock(run_start)
    spec = ClockSpec.from_json(files.clock.read_text())
    return VirtualClock(spec, float(os.environ.get("CONA_CLOCK_START", 0.0)))


def write_clock_spec(files: RunDir, spec: ClockSpec) -> None:
    tmp = files.clock.with_suffix(".tmp")
    tmp.write_text(spec.to_json())
    os.replace(tmp, files.clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--strategy", required=True, type=Strategy.parse)
    parser.add_argument("--launch", type=int, default=1)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--stop-step", type=int)
    args = parser.parse_args()
    run(args.run_dir, args.strategy, args.launch, args.resume, args.stop_step)


signalled = False  # a SIGTERM reached this rank: it leaves with SIGNALLED_EXIT once done (launch.forkrun)


def _stop_on_signal(worker: Worker) -> None:
    global signalled
    signalled = worker.signalled = True


def run(
    run_dir: Path,
    strategy: Strategy,
    launch: int,
    resume: Path | None,
    stop_step: int | None,
    layout: Layout | None = None,
) -> None:
    """One launch on this rank, from process-group start to the outcome file (a standby job calls it
    once the controller hands it a strategy, with the layout it prepared if any: used only to load a
    checkpoint into, since a fresh start must not find optimizer state)."""
    t_start = time.time()
    resolved = RunDir(run_dir).resolved_config
    cfg = config_from_json(resolved.read_text(), str(resolved))
    try:
        device = init_distributed(cfg.cluster, gpus_wanted(cfg))
    except DeviceError as e:
        print(f"cona-worker: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    torch.set_num_threads(threads_per_rank())
    with exit_on_out_of_memory(lambda: strategy, device):
        worker = Worker(cfg, run_dir, strategy, launch, device, layout if resume is not None else None, resume is None)
    # SIGTERM from torchrun or the controller: finish the step, checkpoint, exit.
    signal.signal(signal.SIGTERM, lambda *_: _stop_on_signal(worker))
    if resume is not None:
        try:
            with exit_on_out_of_memory(lambda: strategy, device):  # memory, not the checkpoint: it stays
                worker.restore(resume)
        except checkpoint.CheckpointError as e:
            print(f"cona-worker rank {worker.rank}: bad checkpoint: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Not sys.exit: after a failed DCP load, interpreter shutdown can abort (SIGABRT,
            # "terminate called without an active exception") and the controller would never see the code.
            os._exit(BAD_CHECKPOINT_EXIT)
    worker.setup_s = time.time() - t_start
    try:
        with exit_on_out_of_memory(lambda: worker.strategy, device):
            result = worker.train(stop_step, fresh=resume is None)
    except checkpoint.SaveError as e:  # every rank alike; the committed checkpoints are kept
        print(f"cona-worker: checkpoint not saved: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(checkpoint.STORAGE_EXIT)
    if worker.rank == 0:
        out = RunDir(run_dir).launch_outcome(launch)
        out.parent.mkdir(exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)
    worker.batches.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
