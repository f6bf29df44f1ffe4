"""Resharding checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout: `ROOT/step_000120/` holds the DCP shards, `trainer.json` (step, consumed samples, strategy,
schedule and statistics state) and a `COMMITTED` marker written last. Saving goes to
`ROOT/.tmp-step_000120/` first; once every rank has finished, rank 0 writes `trainer.json` and the
marker there, fsyncs them and the folder, renames the folder to its final name and fsyncs `ROOT`, so
a crash (or power loss) mid-save never leaves a `step_*` folder that looks complete and is not.
Loading ignores folders without the marker, and reshards to whatever layout is running: parameter
names are the same under every (dp, tp, pp). Pruning keeps the `keep` highest steps (by the number
in the name, which grows past six digits), and runs only after a newer checkpoint is committed, so
the newest committed one is never deleted first.

A read that fails with a transient I/O error (EIO, ESTALE, EMFILE, a timeout: shared storage
hiccups) is tried `LOAD_TRIES` times with a short backoff before the load fails: a good checkpoint
is quarantined only for a failure that repeats or a content check that fails.

A save that cannot write (disk full, quota, permission, read-only storage) raises `SaveError` on
every rank with one line naming the path and what it needs; its temporary folder is removed and the
committed checkpoints are left as they are (nothing is pruned), so `--resume` continues from the last
good one. The worker exits with `cona_core.exits.STORAGE_EXIT`.

Running out of memory while loading says nothing about the checkpoint: it is raised as out of memory
(every rank together), never as CheckpointError, so the controller marks the strategy infeasible and
keeps the checkpoint instead of quarantining it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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

from cona_core.rundir import MARKER, TRAINER_STATE, committed, read_trainer_state, step_dir
from launch import testhooks
from launch.device import is_out_of_memory

# Flattened optimizer state: the default nests param_groups in one pickled entry that DCP keeps from
# a single rank, which breaks Adam under pipeline parallelism (KeyError: 'betas').
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# Test hook: "STEP:ERRNO" (e.g. "8:ENOSPC") makes rank 0's write of trainer.json fail from that step on.
_FAULT_ENV = "CONA_TEST_SAVE_ERRNO"
_NO_ROOM = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large"}
_NOT_WRITABLE = {errno.EACCES: "permission denied", errno.EPERM: "not permitted", errno.EROFS: "read-only file system"}
LOAD_TRIES = 3  # reads of a checkpoint that fail with a transient I/O error, tried this often in all
LOAD_BACKOFF_S = 0.5  # the wait before the second try, doubled before each further one
_TRANSIENT = {errno.EIO, errno.ESTALE, errno.EMFILE, errno.ETIMEDOUT}
_T = TypeVar("_T")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the model."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (storage full or not writable); raised on every rank alike."""


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

    Raises SaveError on every rank if any could not write; the committed checkpoints stay, and older
    ones are pruned only once this one is committed. `before_commit` runs on every rank once its
    shards are written (a test hook: die or linger there)."""
    t0 = time.perf_counter()
    final, tmp = _begin(root, step, model, optimizer)
    states = _states(model, optimizer)
    _together(lambda: dcp.save(states, checkpoint_id=str(tmp)), root, tmp, model, optimizer)
    _commit(root, step, tmp, trainer_state, keep, model, optimizer, before_commit)
    return final, time.perf_counter() - t0, _dir_bytes(final)


def async_saves(setting: bool | str, device: torch.device) -> bool:
    """Whether periodic checkpoints are written in the background (`train.checkpoint_async`): `auto` on
    GPUs, where the step waits only for the copy to host memory; not on CPUs, where the writing thread
    would take the cores the step runs on."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@dataclass
class PendingSave:
    """A checkpoint whose shards are being written in the background (`save_async`), not yet committed."""

    step: int
    tmp: Path
    future: Future
    trainer_state: dict[str, Any]  # as it was when the state was staged
    blocked_s: float  # how long training waited for it so far

    def written(self) -> bool:
        """Whether this rank's shards are written (or the write failed): `finish_save` will not wait."""
        return self.future.done()


def save_async(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    group: dist.ProcessGroup,
) -> PendingSave:
    """Collective: stage the state to host memory and write it in a background thread (DCP's async_save,
    its collectives on `group`, a gloo group of its own so that they never interleave with training's);
    training continues at once. `finish_save` commits it. Until then the newest committed checkpoint is
    the one a restart uses, and nothing is pruned."""
    t0 = time.perf_counter()
    _, tmp = _begin(root, step, model, optimizer)
    states = _states(model, optimizer)
    started: list[Future] = []
    _together(
        lambda: started.append(dcp.async_save(states, checkpoint_id=str(tmp), process_group=group)),
        root,
        tmp,
        model,
        optimizer,
    )
    frozen = json.loads(json.dumps(trainer_state))  # the trainer's state moves on while the write runs
    return PendingSave(step, tmp, started[0], frozen, time.perf_counter() - t0)


def finish_save(
    pending: PendingSave,
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    keep: int,
    before_commit: Callable[[], None] | None = None,
) -> tuple[Path, float, int]:
    """Collective: wait for a `save_async` write on every rank and commit it as `save` does. Returns
    (committed path, seconds training waited for it in all, bytes); SaveError as `save`."""
    t0 = time.perf_counter()
    _together(pending.future.result, root, pending.tmp, model, optimizer)
    final = _commit(root, pending.step, pending.tmp, pending.trainer_state, keep, model, optimizer, before_commit)
    return final, pending.blocked_s + time.perf_counter() - t0, _dir_bytes(final)


def _begin(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Path, Path]:
    """Collective: a fresh temporary folder for step `step`'s checkpoint; (final path, temporary path)."""
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"

    def start() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    _together(start if dist.get_rank() == 0 else None, root, tmp, model, optimizer)
    return final, tmp


def _commit(
    root: Path,
    step: int,
    tmp: Path,
    trainer_state: dict[str, Any],
    keep: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    before_commit: Callable[[], None] | None,
) -> Path:
    """Collective, once every rank's shards are in `tmp`: rank 0 writes the trainer state and the marker,
    both durable with their folder, then renames the folder to its final name durably; then older
    checkpoints are pruned."""
    final = step_dir(root, step)
    rank0 = dist.get_rank() == 0
    if before_commit is not None:
        before_commit()
    dist.barrier()  # every rank past its hook before rank 0 commits

    def commit() -> None:
        _maybe_fault(step, tmp / TRAINER_STATE)
        _write_durably(tmp / TRAINER_STATE, json.dumps(trainer_state))
        _write_durably(tmp / MARKER, f"{step}\n")
        _fsync_dir(tmp)
        if final.exists():  # an unusable attempt at the same step (a usable one is never re-saved)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)

    _together(commit if rank0 else None, root, tmp, model, optimizer)
    if rank0:
        _prune(root, keep)  # only now: the new checkpoint is committed
    dist.barrier()
    return final


def _write_durably(path: Path, text: str) -> None:
    """Write `path` and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """fsync a folder: the names created in or renamed into it survive a crash (on file systems that
    cannot sync a folder, EINVAL, their own guarantees hold)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _maybe_fault(step: int, path: Path) -> None:
    hook = os.environ.get(_FAULT_ENV)
    if hook:
        at, name = hook.split(":")
        if step >= int(at):
            code = getattr(errno, name)
            raise OSError(code, os.strerror(code), str(path))


def _together(
    part: Callable[[], object] | None,
    root: Path,
    tmp: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Run one part of a save (on the ranks given one), then agree: if any rank could not write, every
    rank raises the same SaveError (after rank 0 removed the temporary folder)."""
    error: str | None = None
    try:
        if part is not None:
            part()
    except (OSError, CheckpointException) as e:
        found = _os_error(e)
        if found is None:
            raise
        error = _storage_message(found, root, model, optimizer)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    said = next((e for e in errors if e is not None), None)
    if said is not None:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed attempt wrote
        raise SaveError(said)


def _os_error(e: BaseException) -> OSError | None:
    """The storage error behind `e` (DCP wraps each rank's in a CheckpointException), or None."""
    if isinstance(e, CheckpointException):
        inner = [err for errs in e.failures.values() for err in (errs if isinstance(errs, tuple) else (errs,))]
        e = next((err for err in inner if isinstance(err, OSError)), e)
    if isinstance(e, OSError) and e.errno in (_NO_ROOM | _NOT_WRITABLE):
        return e
    return None


def _storage_message(e: OSError, root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """One line: which path could not be written, why, and what it needs."""
    path = Path(e.filename) if e.filename else root
    if e.errno in _NOT_WRITABLE:
        need = f"{root} must be writable by this user (uid {os.getuid()})"
        return f"cannot write checkpoint {path}: {_NOT_WRITABLE[e.errno]}; {need}"
    newest = committed(root)
    size = _dir_bytes(newest[0]) if newest else _state_bytes(model, optimizer) * dist.get_world_size()
    try:
        free = f", {shutil.disk_usage(root).free / 1e6:.1f} MB free"
    except OSError:
        free = ""
    kept = f"; the last good checkpoint {newest[0]} is kept" if newest else ""
    return f"cannot write checkpoint {path}: {_NO_ROOM[e.errno]}; needs about {size / 1e6:.1f} MB on {root}{free}{kept}"


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Rough size of this rank's model and optimizer state (parameters and Adam's two moments)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return params + sum(t.numel() * t.element_size() for t in moments)


def _prune(root: Path, keep: int) -> None:
    """Keep the `keep` committed checkpoints of the highest steps; drop stale temporary folders."""
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
        trainer_state = _retrying(lambda: read_trainer_state(path), path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    states = _states(model, optimizer)  # out of memory here (the optimizer's moments) is raised as it is
    error: tuple[bool, str] | None = None  # (out of memory, what went wrong)
    failed: BaseException | None = None
    try:
        _retrying(lambda: _read_shards(states, path), path)
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


def _read_shards(states: dict[str, Any], path: Path) -> None:
    """This rank's pieces of the checkpoint at `path` into `states`, in place (no collectives)."""
    testhooks.load_fault()
    with warnings.catch_warnings():  # DCP warns that no_dist means one process; here it means no collectives
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(states, checkpoint_id=str(path), no_dist=True)


def _retrying(read: Callable[[], _T], path: Path) -> _T:
    """`read()`, tried again after a backoff while it fails with a transient I/O error (`LOAD_TRIES` in all);
    any other error, or the last try's, is raised as it is."""
    for attempt in range(1, LOAD_TRIES):
        try:
            return read()
        except (Exception, CheckpointException) as e:
            if not _transient(e):
                raise
            wait = LOAD_BACKOFF_S * 2 ** (attempt - 1)
            said = f"reading checkpoint {path} failed ({_describe(e)}); try {attempt + 1} of {LOAD_TRIES} in {wait:g} s"
            print(f"cona checkpoint: {said}", file=sys.stderr, flush=True)
            time.sleep(wait)
    return read()


def _transient(e: BaseException) -> bool:
    """Whether `e`, or an error it wraps or was raised from, is an I/O error that may pass: EIO, ESTALE,
    EMFILE or a timeout."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, TimeoutError) or (isinstance(err, OSError) and err.errno in _TRANSIENT):
            return True
        if isinstance(err, CheckpointException):  # DCP's: each failed rank's (error, traceback)
            todo += [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        todo += [err.__cause__, err.__context__]
    return False


def _describe(e: BaseException) -> str:
    """`Type: first line` of an error; for DCP's CheckpointException, of the first failed rank's own error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
