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

The `Worker` is the training step and loop; its parts: `StepControl` (launch.step_control: what the
ranks agree on in each step's one all-reduce), `Commands` (launch.commands: the controller's commands
and the stop rules), `Checkpointer` (launch.checkpointer), `Evaluator` (launch.evaluator) and the fault
hooks the tests inject (launch.testhooks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from cona_core.clock import (
    CALIBRATION_STEPS,
    TIMING,
    ClockSpec,
    VirtualClock,
    WallClock,
    busy_warning,
    others_load,
    step_seconds,
)
from cona_core.config import Config, config_from_json
from cona_core.exits import BAD_CHECKPOINT_EXIT, OUT_OF_MEMORY_EXIT, REFUSED_EXIT, STORAGE_EXIT
from cona_core.gns import NoiseWindow, two_batch_estimate
from cona_core.rundir import RunDir
from cona_core.strategy import Strategy
from launch import checkpoint, testhooks
from launch.checkpointer import Checkpointer
from launch.commands import Commands
from launch.data.corpus import CorpusInfo
from launch.data.prefetch import BatchKey, Prefetcher
from launch.data.sampling import TokenStream
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
from launch.evaluator import Evaluator
from launch.gradstats import NoiseNorms, local_grad_sq, scale_grads
from launch.layout import Layout, build_layout
from launch.lr import learning_rate, progress_tokens
from launch.lr_calibration import LrCalibration, hypergradient_terms
from launch.models import get_spec
from launch.models.spec import Batch
from launch.precision import resolve_precision
from launch.snapshot import Snapshot
from launch.step_control import StepControl, sum_over_ranks
from launch.telemetry_client import TelemetryClient
from launch.testhooks import FaultHooks

_N_SUMS = 6  # the step's sums before its control in the all-reduce: loss, |g|², the GNS norms, g·u and |u|² (`_sums`)


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
    control: StepControl  # what every rank agreed on in the step: stop, evaluation, checkpoint, resize
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
        hooks: FaultHooks | None = None,
    ) -> None:
        """`device`: this rank's (default: the process group's, see `launch.device`); `layout`: mesh,
        model and optimizer already built for `strategy` (a standby's), else built here; `fresh`: no
        checkpoint is loaded after (only then is `model.init_from` read); `hooks`: faults to inject
        (default: none)."""
        self.cfg, self.run_dir, self.strategy, self.launch = cfg, run_dir, strategy, launch
        self.device = device or group_device()
        self.files = RunDir(run_dir)
        self.rank = dist.get_rank()
        self.hooks = hooks or FaultHooks()
        self.run_start = float(os.environ.get("CONA_RUN_START", time.time()))
        self.clock = make_clock(cfg, self.files, self.run_start)
        corpus = CorpusInfo.from_json(self.files.corpus.read_text())
        self.spec = get_spec(cfg.model.family)
        self.seq_len = cfg.model.seq_len
        self.precision = resolve_precision(cfg.search.precision, self.device)  # what runs (auto resolved)
        self.batch = self.spec.batch(corpus.vocab_size)  # the family's (windows, sample ids) -> (inputs, targets)
        self.train_stream = TokenStream(corpus.train_path, self.seq_len, cfg.train.seed, self.batch)
        self.batches = Prefetcher(self.train_stream, self.device)  # on CUDA: the next step's built during this one
        if layout is None or layout.strategy != strategy:
            layout = build_layout(cfg, strategy, self.device, corpus.vocab_size, fresh)
        self._take_layout(layout)
        self._build_parts(corpus.valid_path)
        self.metrics = open(self.files.metrics, "a") if self.rank == 0 else None
        self.setup_s = 0.0  # process group, model, layout and checkpoint load: set by run()
        # The launch's start on the host's clock: process start, imports, process group, model and layout.
        self.start_wall = time.time() - float(os.environ.get("CONA_LAUNCH_START", time.time()))

    def _build_parts(self, valid_path: str) -> None:
        """The link to the controller and its commands, the evaluator and the checkpointer."""
        self.telemetry = TelemetryClient() if self.rank == 0 else None
        self.commands = Commands(self.cfg, self.telemetry, self.clock, self.hooks)
        self.evaluator = Evaluator(
            self.pm,
            self.strategy,
            self.cfg.train,
            valid_path,
            self.seq_len,
            self.batch,
            self.spec.target_fraction,
            self.dp_rank,
            self._counts_loss(),
            self.device,
        )
        self.checkpointer = Checkpointer(
            self.files.checkpoints,
            self.pm.model,
            self.opt,
            self._contents,
            self.cfg.train,
            self.clock,
            self.telemetry,
            self.launch,
            self.hooks,
            self.device,
        )

    def _take_layout(self, layout: Layout) -> None:
        """Train `layout`'s model and optimizer from a fresh trainer state."""
        t = self.cfg.train
        self.prepared = layout.prepared
        self.mesh, self.pm, self.opt = layout.mesh, layout.pm, layout.opt
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.memory_estimate = self.files.memory_estimates().get(str(self.strategy))  # the planner's
        self.timeouts_shortened = False
        self.launch_steps = 0  # steps this process ran
        self.unsharded_vote_step = 1  # FSDP's unsharded accumulation is voted on at this one (`_voting`)
        self.state = TrainerState()
        self.small = NoiseNorms(self.pm, self.opt, self.spec.vocab_params) if t.gns else None
        self.noise = NoiseWindow(window=t.gns_window, per_batch=False)  # the LR's reading spans a change of batch
        self.z = NormalDist().inv_cdf(self.cfg.search.confidence)  # the base LR's calibration reads at it
        self.gns_hold = math.ceil(1 / (1 - t.beta2))  # steps for Adam's second moment to describe a new batch
        self.state.gns_from_step = self.gns_hold  # held at the start, and after each change of batch
        self.lr_calibration = LrCalibration()

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
        saved = self.checkpointer.load(path)
        self.state = TrainerState(**saved["trainer"])
        if "progress_tokens" not in saved["trainer"]:  # a checkpoint from before the progress clock
            self.state.progress_tokens = float(self.state.consumed_samples * self.seq_len)
        saved_gbs = Strategy.from_mapping(saved["strategy"]).gbs if "strategy" in saved else self.strategy.gbs
        if saved_gbs != self.strategy.gbs:  # relaunched under another batch: Adam's v̂ describes the old one
            self.state.gns_from_step = self.state.step + self.gns_hold
        # A checkpoint from before the window (exponential averages, no "entries") starts an empty one.
        entries = self.state.extra.get("gns", {}).get("entries", [])
        self.noise = NoiseWindow(window=self.cfg.train.gns_window, entries=entries, per_batch=False)
        self.lr_calibration = LrCalibration.from_state(self.state.extra.get("lr_calibration"))

    def _contents(self) -> dict[str, Any]:
        """What a checkpoint holds besides model and optimizer."""
        self.state.extra["gns"] = self.noise.state_dict()
        self.state.extra["lr_calibration"] = self.lr_calibration.state_dict()
        return {"trainer": self.state.__dict__, "strategy": self.strategy.to_dict(), "launch": self.launch}

    def memory_fields(self, peak: tuple[float, ...]) -> dict[str, Any]:
        """Step-row memory fields: the peaks (the maximum over ranks) and the planner's estimate."""
        fields: dict[str, Any] = {}
        if self.device.type == "cuda":
            fields["peak_allocated_bytes"], fields["peak_reserved_bytes"] = int(peak[0]), int(peak[1])
        else:
            fields["peak_rss_bytes"] = int(peak[0])
        if self.memory_estimate is not None:
            fields["memory_estimate_bytes"] = int(self.memory_estimate)
        return fields

    def _counts_loss(self) -> bool:
        return self.pm.is_last and self.tp_rank == 0

    # -- one step ----------------------------------------------------------------------------

    def train_step(self, want_eval: bool) -> StepOut:
        """One training step (`want_eval`: this rank asks for an evaluation after it); resized after it if
        the controller asked."""
        s, st = self.strategy, self.state
        gns = self.noise.gns
        lr = learning_rate(self.cfg.train, st.progress_tokens, st.consumed_samples * self.seq_len, s.gbs, gns)
        self._set_lr(lr * self.lr_calibration.gain)
        micro = self._next_batch()
        self.opt.zero_grad(set_to_none=True)
        if self.small is not None:
            self.small.begin_step(measure=st.step >= st.gns_from_step)
        loss_sum = self.pm.forward_backward(micro)
        self.hooks.in_step(st.step + 1)
        self.pm.average_grads()
        voting = self._voting()
        control = self._votes(want_eval, voting)
        calibrating = self._calibrating()
        sums = self._sums(loss_sum if self._counts_loss() else 0.0, calibrating)
        control.memory = tuple(peak_memory(self.device))  # this rank's, the step's sums included
        reduced = control.all_reduce(sums, self.device)
        self._clip(reduced[1])
        self.opt.step()
        # The step's one host read, after the optimizer step: it waits for the step's work on the
        # device, so it is also what the step's timing needs.
        (loss_total, grad_sq, small_sq, big_sq, gu, uu), agreed = StepControl.read(reduced, _N_SUMS)
        if voting:
            self.pm.accumulate_unsharded = not agreed.veto
        noise = self._update_noise(small_sq, big_sq)
        if calibrating:
            self._calibrate_lr(gu, grad_sq, uu)
        self._count_step(s, gns)
        self.commands.agree(agreed)
        loss = loss_total / (s.dp * s.n_microbatches)
        out = StepOut(loss, math.sqrt(grad_sq), agreed, noise, self.memory_fields(agreed.memory), s)
        if agreed.resize_gbs:
            self.resize(replace(s, mbs=agreed.resize_mbs, gbs=agreed.resize_gbs))
        return out

    def _set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def _next_batch(self) -> list[Batch]:
        """This rank's micro-batches of the next step (its random state seeded for the step)."""
        s, st = self.strategy, self.state
        torch.manual_seed(self.cfg.train.seed * 1_000_003 + st.step * 1009 + self.dp_rank * 31 + self.pp_rank)
        return self.batches.take(BatchKey(st.consumed_samples, s.gbs, s.dp, self.dp_rank, s.mbs))

    def _voting(self) -> bool:
        """Whether this step votes on FSDP's unsharded accumulation: at the first steady step (after the
        first, or after a resize) every rank says whether its measured peak leaves room for the unsharded
        gradients; FSDP skips the middle micro-batches' reduce-scatters from the next step on if all do
        (every rank must skip the same ones)."""
        return self.pm.can_accumulate_unsharded and self.launch_steps == self.unsharded_vote_step

    def _votes(self, want_eval: bool, voting: bool) -> StepControl:
        """This rank's say in the step (`StepControl` keeps rank 0's stop, evaluation, checkpoint and
        resize); the controller's commands are polled as late as possible, here."""
        stop = self.commands.stop_vote(self.state.step + 1, self.strategy)
        resize, save_first = self.commands.take_resize()
        writing = self.checkpointer.writing()
        veto = voting and headroom_bytes(self.device, self.cfg.search.memory_margin) < self.pm.unsharded_grad_bytes()
        return StepControl(
            stop=stop,
            signalled=self.commands.signalled,
            eval=want_eval,
            save=self.checkpointer.vote(save_first),
            writing=writing,
            resize_mbs=resize.mbs if resize else 0,
            resize_gbs=resize.gbs if resize else 0,
            veto=veto,
        )

    def _sums(self, loss: torch.Tensor | float, calibrating: bool = False) -> list[torch.Tensor | float]:
        """The step's sums over ranks: the loss counted here, |g|², the GNS estimator's two norms and, while the
        base LR is calibrated, the hypergradient's g·u and |u|²."""
        grad_sq = local_grad_sq(self.pm)
        norms = [0.0, 0.0] if self.small is None else [self.small.small_share(), self.small.big_share()]
        terms = hypergradient_terms(self.pm.counted_pairs(("dp", "tp")), self.opt) if calibrating else (0.0, 0.0)
        return [loss, grad_sq, *norms, *terms]

    def _calibrating(self) -> bool:
        """Whether this step reads the hypergradient for the base LR (`launch.lr_calibration`): the run
        calibrates it (`train.lr_calibration`; auto: under policy cona) and has not settled it, warmup is
        over and Adam's second moment describes the run."""
        t, st = self.cfg.train, self.state
        wanted = t.lr_calibration is True or (t.lr_calibration == "auto" and self.cfg.policy == "cona")
        return (
            wanted
            and not self.lr_calibration.settled
            and st.consumed_samples * self.seq_len >= t.warmup_tokens
            and st.step >= self.gns_hold
        )

    def _calibrate_lr(self, gu: float, grad_sq: float, uu: float) -> None:
        cal = self.lr_calibration
        if cal.add(gu, grad_sq, uu, self.z) and self.rank == 0:
            verdict = (
                f"raised to {cal.gain:.3g}× train.lr" if not cal.settled else f"settled at {cal.gain:.3g}× train.lr"
            )
            print(
                f"cona-worker: step {self.state.step + 1}: hypergradient t {cal.reads[-1]:+.2f}: base LR {verdict}",
                flush=True,
            )

    def _clip(self, grad_sq: torch.Tensor) -> None:
        """Clip the gradient norm on the device (clip_grad_norm_'s clamped coefficient): no host read."""
        clip = self.cfg.train.grad_clip
        if clip:
            scale_grads(self.pm, (clip / (grad_sq.sqrt() + 1e-6)).clamp(max=1.0))

    def _count_step(self, s: Strategy, gns: float | None) -> None:
        """A step under `s` is done: the counters, and the LR schedule's clock at the step's noise scale."""
        st, t = self.state, self.cfg.train
        self.launch_steps += 1
        st.step += 1
        st.consumed_samples += s.gbs
        st.progress_tokens += progress_tokens(t.lr_scaling, s.gbs, t.lr_base_gbs or s.gbs, gns, self.seq_len)

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

    def resize(self, strategy: Strategy) -> None:
        """Run the next steps under `strategy`, the same layout with another micro- and global batch: the
        data stream continues at `consumed_samples`, the LR follows the new batch, and the GNS estimator
        and the evaluation batches are rebuilt for it. Every rank calls this after the same step."""
        self.strategy = self.pm.strategy = strategy
        self.pm.accumulate_unsharded, self.unsharded_vote_step = False, self.launch_steps  # the new batch votes
        if self.small is not None:
            self.small.resize()
        self.state.gns_from_step = self.state.step + self.gns_hold
        self.evaluator.resize(strategy)
        self.memory_estimate = self.files.memory_estimates().get(str(strategy))
        reset_peak_memory(self.device)  # the new batch's own peak (CUDA; the CPU's peak RSS cannot go down)
        self.ensure_timed()
        self.hooks.after_resize(self.state.step)

    # -- the virtual clock's calibration -----------------------------------------------------

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
        eval_s = self.evaluator.seconds() if need else 0.0
        mine = [0.0] * 4
        if self.rank == 0:
            if need:
                timing = [*step_seconds(logs), self.start_wall, eval_s]
                load = others_load(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                spec.record(s, {**dict(zip(TIMING, timing)), "load": round(load, 3)})
                write_clock_spec(self.files, spec)
                measured = ", ".join(f"{k} {v:.4g}" for k, v in zip(TIMING, timing))
                print(f"cona-worker: clock: {s} measured {measured}", flush=True)
                if str(s) in spec.busy:
                    print(f"cona-worker: {busy_warning({str(s): spec.busy[str(s)]}, spec.cache)}", flush=True)
            mine = [spec.table[str(s)], spec.spreads[str(s)], spec.start_s(s), spec.evals[str(s)]]
        spec.take(s, dict(zip(TIMING, self._reduce(mine))))

    def _reduce(self, values: list[torch.Tensor | float]) -> list[float]:
        """`sum_over_ranks`, read on the host."""
        return sum_over_ranks(values, self.device).tolist()

    def _time_steps(self) -> list[float]:
        """Seconds of `CALIBRATION_STEPS` training steps of the running strategy on the batches that follow
        (each step's data, work, noise-scale norms and collectives, as `train_step` does them), from and
        back to the state they started at."""
        s, st = self.strategy, self.state
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
            reduced = StepControl().all_reduce(self._sums(0.0), self.device)  # the step's all-reduce, as wide
            self._clip(reduced[1])
            self.opt.step()
            StepControl.read(reduced, _N_SUMS)
            if i >= warm:
                times.append(time.perf_counter() - t0)
        snap.restore(self.pm.model, self.opt)
        self.opt.zero_grad(set_to_none=True)
        return times

    # -- evaluation --------------------------------------------------------------------------

    def run_eval(self) -> float:
        val_loss, val_ppl = self.evaluator.evaluate()
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

    def train(self, stop_step: int | None, fresh: bool) -> dict[str, Any]:
        t, st = self.cfg.train, self.state
        self._send_ready()
        self.ensure_timed(starting=True)
        if fresh and (t.eval_interval or t.eval_interval_s):
            self.run_eval()
        reason = self.commands.stop_rule(st.step, st.consumed_samples, st.best_val_ppl)  # a resumed run may be done
        while reason is None:
            if stop_step is not None and st.step >= stop_step:
                reason = "stage_end"
                break
            reason = self._loop_step()
        if self.commands.ends_run(reason, stop_step) and st.last_eval_step != st.step:
            self.run_eval()  # the last checkpoint's validation perplexity is always in metrics.jsonl
        path = self.checkpointer.save(self.commands.last_save_reason(reason))
        return {
            "reason": reason,
            "stop_id": self.commands.stop_id(reason),  # the controller's, echoed
            "step": st.step,
            "consumed_samples": st.consumed_samples,
            "time": st.time,
            "clock_s": self.now(),  # run time once the last checkpoint is saved
            "checkpoint": str(path),
            "best_val_ppl": st.best_val_ppl,
        }

    def _send_ready(self) -> None:
        if self.telemetry is not None:
            self.telemetry.send(
                {
                    "type": "ready",
                    "launch": self.launch,
                    "step": self.state.step,
                    "time": self.now(),
                    "setup_s": self.setup_s,
                    "prepared": self.prepared,
                }
            )

    def _loop_step(self) -> str | None:
        """One step of the loop with its row, evaluation and checkpoint; why the launch stops after it."""
        st = self.state
        t0 = time.perf_counter()
        out = self.train_step(self.evaluator.due(st.step, self.now() - st.last_eval_time))
        wall_iter_s = time.perf_counter() - t0  # the step returns after the device finished it
        iter_s = self.clock.step(out.strategy, st.step, wall_iter_s)
        st.time = self.now()
        if self.strategy != out.strategy:  # resized after this step: the gap before the next one
            self.clock.resized(self.strategy)
        self._settle()
        self._emit_step(out, iter_s, wall_iter_s)
        val_ppl = self.run_eval() if out.control.eval else None
        reason = self.commands.stop_rule(st.step, st.consumed_samples, val_ppl) or out.control.cause
        self.checkpointer.after_step(st.step, out.control.save, out.control.writing, stopping=reason is not None)
        self.commands.sync(st.step, self.launch)
        return reason

    def _settle(self) -> None:
        """After the launch's first step (communicators built, shapes inferred): the steady-state
        collective timeout, and peak memory measured from here on (not start-up and loading)."""
        if self.timeouts_shortened:
            return
        shorten_timeouts(self.cfg.cluster.collective_timeout_s, [self.mesh[d].get_group() for d in ("pp", "dp", "tp")])
        self.timeouts_shortened = True
        reset_peak_memory(self.device)

    def _emit_step(self, out: StepOut, iter_s: float, wall_iter_s: float) -> None:
        st, s = self.state, out.strategy
        self.emit(
            {
                "kind": "step",
                "step": st.step,
                "time": round(st.time, 4),
                "loss": out.loss,
                "lr": self.opt.param_groups[0]["lr"],
                "lr_gain": self.lr_calibration.gain,
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
    signalled = worker.commands.signalled = True


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
        sys.exit(REFUSED_EXIT)
    torch.set_num_threads(threads_per_rank())
    hooks = testhooks.from_env(run_dir, dist.get_rank())
    built = layout if resume is not None else None
    with exit_on_out_of_memory(lambda: strategy, device):
        worker = Worker(cfg, run_dir, strategy, launch, device, built, resume is None, hooks)
    # SIGTERM from torchrun or the controller: finish the step, checkpoint, exit.
    signal.signal(signal.SIGTERM, lambda *_: _stop_on_signal(worker))
    if resume is not None:
        _restore(worker, resume, device)
    worker.setup_s = time.time() - t_start
    try:
        with exit_on_out_of_memory(lambda: worker.strategy, device):
            result = worker.train(stop_step, fresh=resume is None)
    except checkpoint.SaveError as e:  # every rank alike; the committed checkpoints are kept
        print(f"cona-worker: checkpoint not saved: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(STORAGE_EXIT)
    if worker.rank == 0:
        _write_outcome(RunDir(run_dir).launch_outcome(launch), result)
    worker.batches.close()
    dist.destroy_process_group()


def _restore(worker: Worker, resume: Path, device: torch.device) -> None:
    """Load the launch's checkpoint; one that cannot be loaded ends the rank with `BAD_CHECKPOINT_EXIT`."""
    try:
        with exit_on_out_of_memory(lambda: worker.strategy, device):  # memory, not the checkpoint: it stays
            worker.restore(resume)
    except checkpoint.CheckpointError as e:
        print(f"cona-worker rank {worker.rank}: bad checkpoint: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not sys.exit: after a failed DCP load, interpreter shutdown can abort (SIGABRT,
        # "terminate called without an active exception") and the controller would never see the code.
        os._exit(BAD_CHECKPOINT_EXIT)


def _write_outcome(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
