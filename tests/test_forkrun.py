"""launch.forkrun: a forked rank that only lost a peer fails late, so the peer's own failure is the one
torch's forked-process group reports; any other failure is immediate; the agent keeps torchrun's exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from launch import forkrun
from tests.support import REPO


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
    slept: list[float] = []
    monkeypatch.setattr(forkrun.time, "sleep", slept.append)
    with pytest.raises(type(error)):
        forkrun.run_module(name, "--flag", "1")
    assert slept == ([forkrun.PEER_LOST_DELAY_S] if late else [])


def test_only_modules_are_run() -> None:
    with pytest.raises(SystemExit, match="runs a module"):
        forkrun.main(["--standalone", "--nproc-per-node=1", "train.py"])


@pytest.mark.e2e
def test_ranks_come_from_a_single_threaded_fork_server_with_their_module_loaded(tmp_path) -> None:
    """Not from the agent, whose threads may hold libc locks at a fork, but from a server the agent
    forked after importing the module; each rank takes SIGTERM."""
    (tmp_path / "cona_probe_rank.py").write_text(
        "import json, os, signal, sys\n"
        "IMPORTED_IN = os.getpid()\n"
        "def main():\n"
        "    out = os.path.join(sys.argv[1], os.environ['RANK'] + '.json')\n"
        "    handler = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
        "    threads = len(os.listdir(f'/proc/{os.getppid()}/task'))\n"
        "    doc = {'ppid': os.getppid(), 'sigterm_default': handler, 'imported_in': IMPORTED_IN, 'threads': threads}\n"
        "    open(out, 'w').write(json.dumps(doc))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    argv = [sys.executable, "-m", "launch.forkrun", "--standalone", "--nproc-per-node=2"]
    agent = subprocess.Popen([*argv, "-m", "cona_probe_rank", str(tmp_path)], cwd=REPO, env=env)
    assert agent.wait(timeout=120) == 0
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["ppid"] == ranks[1]["ppid"] != agent.pid  # siblings, children of the fork server
    assert ranks[0]["threads"] == 1  # the server: nothing else runs while it forks
    assert all(r["sigterm_default"] and r["imported_in"] == agent.pid for r in ranks)  # imported once, by the agent


@pytest.mark.e2e
def test_the_agent_exits_with_torchruns_codes_without_teardown(tmp_path) -> None:
    """The agent leaves by os._exit (no interpreter teardown) but keeps torchrun's exit codes and messages."""
    (tmp_path / "cona_failing_rank.py").write_text("def main():\n    raise RuntimeError('rank failed on purpose')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    argv = [sys.executable, "-m", "launch.forkrun", "--standalone", "--nproc-per-node=1"]
    refused = subprocess.run([*argv, "train.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "runs a module (-m MODULE), not a script" in refused.stderr
    failed = subprocess.run(
        [*argv, "-m", "cona_failing_rank"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 1 and "ChildFailedError" in failed.stderr and "rank failed on purpose" in failed.stderr


def _alive(pid: int) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def _two_waiting_ranks(tmp_path, name: str, source: str) -> tuple[subprocess.Popen, list[list[int]]]:
    """Start forkrun (its own process group) with two ranks of module `name`, whose main writes
    `RANK.pids` (its pid and its parent's) and then runs `source`; returns the agent and each rank's pids."""
    head = "import os, signal, sys, time\nsignalled = stopped = False\ndef main():\n"
    pids = "    out = os.path.join(sys.argv[1], os.environ['RANK'])\n"
    pids += "    open(out + '.pids', 'w').write(f'{os.getpid()} {os.getppid()}')\n"
    (tmp_path / f"{name}.py").write_text(head + pids + source)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    argv = [sys.executable, "-m", "launch.forkrun", "--standalone", "--nproc-per-node=2", "-m", name, str(tmp_path)]
    agent = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True)
    files = [tmp_path / f"{r}.pids" for r in (0, 1)]
    deadline = time.monotonic() + 60
    while not all(f.is_file() and f.read_text().count(" ") == 1 for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    return agent, [[int(p) for p in f.read_text().split()] for f in files]


def _still_alive_after(pids: set[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _until_sigterm(flag: str) -> str:
    """A rank's main that handles SIGTERM as the worker does: set module global `flag`, finish, return."""
    return (
        "    def stop(*_):\n"
        f"        global {flag}\n"
        f"        {flag} = True\n"
        "    signal.signal(signal.SIGTERM, stop)\n"
        "    deadline = time.monotonic() + 120\n"
        f"    while not {flag} and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
    )


@pytest.mark.e2e
def test_ranks_and_their_server_do_not_outlive_a_killed_agent(tmp_path) -> None:
    """SIGKILL the agent: its fork server dies with it and each rank gets SIGTERM (the worker's stop:
    checkpoint, return), then leaves without waiting for an agent to collect its result: nothing of the
    job trains on or lingers. (These ranks leave `signalled` False: only their dead server lets them go.)"""
    term = "    open(out + '.term', 'w').close()\n"
    agent, ranks = _two_waiting_ranks(tmp_path, "cona_sleeping_rank", _until_sigterm("stopped") + term)
    try:
        pids = {p for rank in ranks for p in rank}
        assert len(pids) == 3 and agent.pid not in pids  # two ranks and their server
        agent.kill()
        agent.wait()
        assert not _still_alive_after(pids, 10)
        assert all((tmp_path / f"{r}.term").is_file() for r in (0, 1))
    finally:
        os.killpg(agent.pid, signal.SIGKILL)


@pytest.mark.e2e
def test_ranks_stopped_by_sigterm_leave_without_waiting_for_the_agent_to_collect_them(tmp_path) -> None:
    """SIGTERM to the job's process group (how the controller and a node's agent stop a job): ranks that
    say a signal stopped them (`signalled`) leave once main returns, instead of waiting for a result
    the stopping agent never reads until its 30 s close timeout kills them."""
    agent, ranks = _two_waiting_ranks(tmp_path, "cona_stopped_rank", _until_sigterm("signalled"))
    try:
        os.killpg(agent.pid, signal.SIGTERM)
        # torchrun's close timeout is 30 s: a rank waiting on it would still be here after 20
        assert not _still_alive_after({pid for pid, _ in ranks}, 20)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
