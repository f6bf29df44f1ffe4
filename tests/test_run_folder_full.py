"""A run folder that takes no more writes (disk full, read-only) while the controller writes its own state
or events stops the run in one line, naming the file and the checkpoint kept, with exit code 1."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from cona_cli.control.controller import Controller
from cona_core.rundir import MARKER, RunDir, step_dir


def _controller(run: Path) -> tuple[Controller, io.StringIO]:
    out = io.StringIO()
    c = Controller.__new__(Controller)
    c.run_dir, c.files, c.multi_node, c._exiting = run, RunDir(run), False, []
    c.console = Console(file=out, width=400)
    c.out = contextlib.nullcontext()  # type: ignore[assignment]
    closed = SimpleNamespace(drop=lambda: None, close=lambda: None)
    c.standbys = c.telemetry = c.sinks = closed  # type: ignore[assignment]
    return c, out


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_the_controller_stops_in_one_line_when_its_run_folder_is_full(tmp_path: Path, code: int) -> None:
    run = tmp_path / "run"
    for step in (40, 1_000_000):  # the newest by step, not by name
        (step_dir(RunDir(run).checkpoints, step)).mkdir(parents=True)
        (step_dir(RunDir(run).checkpoints, step) / MARKER).write_text(f"{step}\n")
    c, out = _controller(run)
    state = RunDir(run).controller_state

    def full() -> int:
        raise OSError(code, os.strerror(code), str(state))

    c._run = full  # type: ignore[method-assign]
    assert c.run() == 1
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"cona: cannot write {state}: {os.strerror(code)}; the run stops")
    assert f"its last checkpoint {step_dir(RunDir(run).checkpoints, 1_000_000)} is kept" in lines[0]
    assert f"cona train --resume {run}" in lines[0]


def test_another_os_error_is_not_taken_for_a_full_folder(tmp_path: Path) -> None:
    c, _ = _controller(tmp_path / "run")

    def broken() -> int:
        raise OSError(errno.EBADF, "bad file descriptor")

    c._run = broken  # type: ignore[method-assign]
    with pytest.raises(OSError):
        c.run()
