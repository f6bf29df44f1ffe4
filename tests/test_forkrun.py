"""launch.forkrun: a forked rank that only lost a peer fails late, so the peer's own failure is the one
torch's forked-process group reports; any other failure is immediate."""

from __future__ import annotations

import sys
import time
import types

import pytest

from launch import forkrun


def _rank_module(monkeypatch: pytest.MonkeyPatch, error: Exception) -> str:
    module = types.ModuleType("cona_test_rank")

    def main() -> None:
        assert sys.argv == ["cona_test_rank", "--flag", "1"]  # the rank's own command line
        raise error

    module.main = main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(forkrun, "PEER_LOST_DELAY_S", 0.3)
    return module.__name__


@pytest.mark.parametrize(
    ("error", "late"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32650"), True),
        (RuntimeError("NCCL communicator was aborted on rank 3"), True),
        (ValueError("a bug in this rank"), False),
    ],
)
def test_a_rank_that_lost_a_peer_fails_late(monkeypatch: pytest.MonkeyPatch, error: Exception, late: bool) -> None:
    name = _rank_module(monkeypatch, error)
    start = time.monotonic()
    with pytest.raises(type(error)):
        forkrun.run_module(name, "--flag", "1")
    assert (time.monotonic() - start >= 0.3) == late


def test_only_modules_are_run() -> None:
    with pytest.raises(SystemExit, match="runs a module"):
        forkrun.main(["--standalone", "--nproc-per-node=1", "train.py"])
