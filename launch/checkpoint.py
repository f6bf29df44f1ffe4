"""Resharding checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout: `ROOT/step_000120/` holds the DCP shards, `trainer.json` (step, consumed samples, strategy,
schedule and statistics state) and a `COMMITTED` marker written last. Saving goes to
`ROOT/.tmp-step_000120/` first and is renamed once every rank has finished, so a crash mid-save
never leaves a folder that looks complete. Loading ignores folders without the marker, and reshards
to whatever layout is running: parameter names are the same under every (dp, tp, pp). Pruning
runs only after a newer checkpoint is committed, so the newest committed one is never deleted first.

Running out of memory while loading says nothing about the checkpoint: it is raised as out of memory
(every rank together), never as CheckpointError, so the controller marks the strategy infeasible and
keeps the checkpoint instead of quarantining it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from cona_cli.rundir import MARKER, TRAINER_STATE, committed, read_trainer_state, step_dir
from launch.device import is_out_of_memory

# Flattened optimizer state: the default nests param_groups in one pickled entry that DCP keeps from
# a single rank, which breaks Adam under pipeline parallelism (KeyError: 'betas').
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the model."""


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIONS)}


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer the state a load fills in place (DCP builds it with a zero-gradient,
    zero-LR step: 0.25-0.5 s under DTensor TP on 2 CPU cores); `load` does it when not done before."""
    get_optimizer_state_dict(model, optimizer, options=_OPTIONS)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
    before_commit: Callable[[], None] | None = None,
) -> tuple[Path, float, int]:
    """Collective: every rank calls it. Returns (committed path, seconds, bytes) on every rank.

    `before_commit` runs on every rank once its shards are written (a test hook: die or linger there)."""
    t0 = time.perf_counter()
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_states(model, optimizer), checkpoint_id=str(tmp))
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state))
        if final.exists():  # an unusable attempt at the same step (a usable one is never re-saved)
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(final / MARKER, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        _prune(root, keep)
    dist.barrier()
    return final, time.perf_counter() - t0, _dir_bytes(final)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints; drop stale temporary folders."""
    for old in committed(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-step_*"):
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: load a committed checkpoint into the local (resharded) model and optimizer.

    Each rank plans and reads its own pieces (DCP's load plan needs no global coordination; its
    collectives cost ~0.3-0.7 s of a switch on 2 CPU cores), then one all-gather makes every rank
    fail together if any could not read."""
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: not a committed checkpoint (no {MARKER} marker)")
    try:
        trainer_state = read_trainer_state(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    states = _states(model, optimizer)  # out of memory here (the optimizer's moments) is raised as it is
    error: tuple[bool, str] | None = None  # (out of memory, what went wrong)
    failed: BaseException | None = None
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process; here it means no collectives
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(states, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # several types for missing/truncated/garbled shards
        failed, error = e, (is_out_of_memory(e), _describe(e))
    errors: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # every rank fails (the same way) if one cannot read its shards
    oom = next((r for r, e in enumerate(errors) if e is not None and e[0]), None)
    if oom is not None:  # memory, not the checkpoint: raised as out of memory on every rank
        said = errors[oom]
        assert said is not None
        raise torch.OutOfMemoryError(f"rank {oom} ran out of memory loading {path} ({said[1]})") from failed
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(f"{path}: cannot load ({first[1]})")
    try:
        set_model_state_dict(model, states["model"])
        set_optimizer_state_dict(model, optimizer, states["optim"], options=_OPTIONS)
    except Exception as e:
        if is_out_of_memory(e):
            raise
        raise CheckpointError(f"{path}: does not fit the model ({type(e).__name__}: {str(e)[:200]})") from None
    return trainer_state


def _describe(e: BaseException) -> str:
    """`Type: first line` of an error; for DCP's CheckpointException, of the first failed rank's own error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
