"""A launch's checkpoints: loads, saves (collective), periodic ones by steps or time (in the background
on a gloo group of their own where async saves are on), the commit of a background save, and the report
of each to the controller. The DCP reads and writes are `launch.checkpoint`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cona_core.clock import WallClock
from cona_core.config import TrainConfig
from launch import checkpoint
from launch.step_control import Save
from launch.telemetry_client import TelemetryClient
from launch.testhooks import FaultHooks


class Checkpointer:
    def __init__(
        self,
        root: Path,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        contents: Callable[[], dict[str, Any]],
        train: TrainConfig,
        clock: WallClock,
        telemetry: TelemetryClient | None,
        launch: int,
        hooks: FaultHooks,
        device: torch.device,
    ) -> None:
        """`contents`: what a checkpoint holds besides model and optimizer (its `trainer.step` is the step
        saved); `telemetry`: rank 0's, where each committed checkpoint is reported."""
        self.root, self.model, self.opt, self.contents = root, model, opt, contents
        self.train, self.clock, self.telemetry, self.launch, self.hooks = train, clock, telemetry, launch, hooks
        self.saved: tuple[int, Path] | None = None  # (step, path) of the checkpoint this state is in
        # (Not under the virtual clock: when a background write is done is the host's business.)
        background = checkpoint.async_saves(train.checkpoint_async, device) and not clock.virtual
        self.async_group = dist.new_group(backend="gloo") if background else None
        self.pending: checkpoint.PendingSave | None = None  # a periodic checkpoint still being written
        self.last_save_time = clock.now()
        self.last_save_s = 0.0  # how long the last save took: stretches the periodic interval

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at `path` into model and optimizer; returns what else it holds."""
        saved = checkpoint.load(path, self.model, self.opt)
        self.saved = (saved["trainer"]["step"], path)
        return saved

    def save(self, reason: str) -> Path:
        """Checkpoint the current state (collective); a state already saved is not saved again."""
        self.finish()
        step = self._step()
        if self.saved is not None and self.saved[0] == step:
            return self.saved[1]
        path, seconds, nbytes = checkpoint.save(
            self.root, step, self.model, self.opt, self.contents(), self.train.checkpoint_keep, self._hook(step)
        )
        self._saved(step, path, seconds, nbytes, reason)
        return path

    def save_periodic(self) -> None:
        """A periodic checkpoint (collective): in the background where async saves are on, else as `save`."""
        if self.async_group is None:
            self.save("periodic")
            return
        self.finish()
        step = self._step()
        if self.saved is not None and self.saved[0] == step:
            return
        self.pending = checkpoint.save_async(self.root, step, self.model, self.opt, self.contents(), self.async_group)
        self.last_save_time = self.clock.now()

    def finish(self) -> None:
        """Commit the periodic checkpoint being written in the background, waiting for it if need be."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        path, seconds, nbytes = checkpoint.finish_save(
            pending, self.root, self.model, self.opt, self.train.checkpoint_keep, self._hook(pending.step)
        )
        self._saved(pending.step, path, seconds, nbytes, "periodic")

    def writing(self) -> bool:
        """This rank's shards of the background checkpoint are not all written yet."""
        return self.pending is not None and not self.pending.written()

    def vote(self, save_first: bool) -> Save:
        """Rank 0's checkpoint decision for after this step: `RESIZE` when the job resizes after it, the
        controller asked for a checkpoint first (`save_first`) and this launch has none to go back to but
        the run's start (a kill after the climb then keeps it); else `PERIODIC` when its time has come."""
        if save_first and self.saved is None:
            return Save.RESIZE
        return Save.PERIODIC if self.due_by_time() else Save.NONE

    def due_by_time(self) -> bool:
        t = self.train
        if t.checkpoint_interval_s is None:
            return False
        interval = max(t.checkpoint_interval_s, self.last_save_s / t.checkpoint_max_share)  # saves ≤ that share
        return self.clock.now() - self.last_save_time >= interval

    def after_step(self, step: int, agreed: Save, writing: bool, stopping: bool) -> None:
        """After step `step` (collective): commit the background checkpoint once no rank is `writing` it,
        then save the one due unless the launch is `stopping` (its last checkpoint comes then): the
        `agreed` vote's, else a periodic one every `checkpoint_interval` steps."""
        if not writing:
            self.finish()
        if stopping:
            return
        interval = self.train.checkpoint_interval
        if agreed == Save.NONE and interval is not None and step % interval == 0:
            agreed = Save.PERIODIC
        if agreed == Save.RESIZE:
            self.save("resize")
        elif agreed == Save.PERIODIC:
            self.save_periodic()

    def _step(self) -> int:
        return self.contents()["trainer"]["step"]

    def _hook(self, step: int) -> Callable[[], None]:
        """What runs inside step `step`'s save, after this rank's shards are written and before the commit."""
        return lambda: self.hooks.in_save(step)

    def _saved(self, step: int, path: Path, seconds: float, nbytes: int, reason: str) -> None:
        """A checkpoint of step `step` is committed: `seconds` is how long training waited for it."""
        seconds = self.clock.saved(seconds)
        self.saved, self.last_save_s = (step, path), seconds
        if reason != "periodic" or self.async_group is None:  # (async: the interval counts from its start)
            self.last_save_time = self.clock.now()
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
