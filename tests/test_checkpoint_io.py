"""Checkpoint I/O on flaky shared storage: transient read errors are retried (a good checkpoint is not
thrown away for one), failures that repeat still fail, the commit is durable and marked before the
rename, and keep-last-K orders by step number, also past six digits (one process, a gloo group of 1)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from cona_cli.control import usable_checkpoints
from cona_core import rundir
from launch import checkpoint


@pytest.fixture
def one_process(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, keep: int = 3) -> Path:
    state = {"trainer": {"step": step, "consumed_samples": 8 * step}}
    return checkpoint.save(root, step, model, opt, state, keep=keep)[0]


def _failing(monkeypatch: pytest.MonkeyPatch, errors: list[BaseException]) -> list[int]:
    """Make DCP's load raise `errors` one per call, then load for real; returns the calls made (a list to count)."""
    real = checkpoint.dcp.load
    calls: list[int] = []

    def load(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        real(*args, **kwargs)

    monkeypatch.setattr(checkpoint.dcp, "load", load)
    monkeypatch.setattr(checkpoint, "LOAD_BACKOFF_S", 0.0)
    return calls


def _eio() -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO), "__0_0.distcp")


@pytest.mark.parametrize(
    "error",
    [
        _eio(),
        OSError(errno.ESTALE, os.strerror(errno.ESTALE)),
        TimeoutError("read timed out"),
        CheckpointException("read_data", {0: (_eio(), None)}),  # as DCP wraps a rank's own error
    ],
    ids=["EIO", "ESTALE", "timeout", "wrapped-EIO"],
)
def test_a_read_that_fails_once_is_retried_and_the_checkpoint_kept(
    tmp_path: Path, one_process: None, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    root = tmp_path / "checkpoints"
    model, opt = _trained(0)
    path = _save(root, 4, model, opt)
    fresh, fresh_opt = _trained(1)
    calls = _failing(monkeypatch, [error])
    assert checkpoint.load(path, fresh, fresh_opt)["trainer"]["step"] == 4
    assert len(calls) == 2
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert [p.name for p in root.iterdir()] == ["step_000004"]  # nothing quarantined, nothing renamed
    assert usable_checkpoints.newest_usable(root, None, pytest.fail) == (path, 0)


def test_a_trainer_state_read_that_fails_once_is_retried(
    tmp_path: Path, one_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained(0)
    path = _save(tmp_path / "checkpoints", 4, model, opt)
    real = checkpoint.read_trainer_state
    calls: list[int] = []

    def flaky(at: Path) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            try:
                raise _eio()
            except OSError:  # as cona_core.rundir says it: the I/O error is the context
                raise ValueError(f"{at}: unreadable trainer.json") from None
        return real(at)

    monkeypatch.setattr(checkpoint, "read_trainer_state", flaky)
    monkeypatch.setattr(checkpoint, "LOAD_BACKOFF_S", 0.0)
    assert checkpoint.load(path, *_trained(1))["trainer"] == {"step": 4, "consumed_samples": 32}
    assert len(calls) == 2


def test_a_read_error_that_repeats_or_is_not_transient_still_fails(
    tmp_path: Path, one_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    model, opt = _trained(0)
    path = _save(root, 4, model, opt)
    calls = _failing(monkeypatch, [_eio()] * checkpoint.LOAD_TRIES)
    with pytest.raises(checkpoint.CheckpointError, match=r"step_000004: cannot load \(OSError: .*Input/output error"):
        checkpoint.load(path, *_trained(1))
    assert len(calls) == checkpoint.LOAD_TRIES
    calls = _failing(monkeypatch, [OSError(errno.ENOENT, os.strerror(errno.ENOENT), "__0_0.distcp")])
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot load \(FileNotFoundError: "):
        checkpoint.load(path, *_trained(1))
    assert len(calls) == 1  # a missing shard is the checkpoint's fault: no retry


def test_pruning_keeps_the_highest_steps_past_six_digits(tmp_path: Path, one_process: None) -> None:
    root = tmp_path / "checkpoints"
    model, opt = _trained(0)
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        _save(root, step, model, opt, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_1000000", "step_1000001"]


def test_the_controller_lists_checkpoints_by_step_number(tmp_path: Path) -> None:
    for name in ("step_999999", "step_1000000", "step_000120", "step_x"):
        (tmp_path / name).mkdir()
    assert [p.name for p in usable_checkpoints.candidates(tmp_path)] == [
        "step_1000000",
        "step_999999",
        "step_000120",
        "step_x",
    ]


def test_the_marker_is_durable_before_the_rename_and_the_rename_after(
    tmp_path: Path, one_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    model, opt = _trained(0)
    final, tmp = rundir.step_dir(root, 7), root / ".tmp-step_000007"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        if Path(dst) == final:
            events.append(("marker then", str((Path(src) / rundir.MARKER).read_text())))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert _save(root, 7, model, opt) == final
    order = [
        ("fsync", str(tmp / rundir.TRAINER_STATE)),
        ("fsync", str(tmp / rundir.MARKER)),
        ("fsync", str(tmp)),
        ("replace", f"{tmp} -> {final}"),
        ("marker then", "7\n"),
        ("fsync", str(root)),
    ]
    assert [e for e in events if e in order] == order
    assert (final / rundir.MARKER).read_text() == "7\n" and not tmp.exists()
