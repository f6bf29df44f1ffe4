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
    start = time.monotonic()
    with pytest.raises(type(error)):
        forkrun.run_module(name, "--flag", "1")
    assert (time.monotonic() - start >= 0.3) == late


def test_only_modules_are_run() -> None:
    with pytest.raises(SystemExit, match="runs a module"):
        forkrun.main(["--standalone", "--nproc-per-node=1", "train.py"])


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


def test_ranks_and_their_server_do_not_outlive_a_killed_agent(tmp_path) -> None:
    """SIGKILL the agent: its fork server dies with it and each rank gets SIGTERM (the worker's stop:
    checkpoint, return), then leaves without waiting for an agent to collect its result: nothing of the
    job trains on or lingers."""
    (tmp_path / "cona_sleeping_rank.py").write_text(
        "import os, signal, sys, time\n"
        "def main():\n"
        "    base = os.path.join(sys.argv[1], os.environ['RANK'])\n"
        "    stop = []\n"
        "    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # as the worker: finish, then return\n"
        "    open(base + '.pids', 'w').write(f'{os.getpid()} {os.getppid()}')\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not stop and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    open(base + '.term', 'w').close()\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    argv = [sys.executable, "-m", "launch.forkrun", "--standalone", "--nproc-per-node=2"]
    agent = subprocess.Popen([*argv, "-m", "cona_sleeping_rank", str(tmp_path)], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{r}.pids").is_file() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {int(p) for r in (0, 1) for p in (tmp_path / f"{r}.pids").read_text().split()}
        assert len(pids) == 3 and agent.pid not in pids  # two ranks and their server
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)]
        assert all((tmp_path / f"{r}.term").is_file() for r in (0, 1))
    finally:
        agent.kill()


def test_ranks_stopped_by_sigterm_leave_without_waiting_for_the_agent_to_collect_them(tmp_path) -> None:
    """SIGTERM to the job's process group (how the controller and a node's agent stop a job): ranks that
    say a signal stopped them (`signalled`) leave once main returns, instead of waiting for a result
    the stopping agent never reads until its 30 s close timeout kills them."""
    (tmp_path / "cona_stopped_rank.py").write_text(
        "import os, signal, sys, time\n"
        "signalled = False\n"
        "def main():\n"
        "    def stop(*_):\n"
        "        global signalled\n"
        "        signalled = True\n"
        "    signal.signal(signal.SIGTERM, stop)\n"
        "    open(os.path.join(sys.argv[1], os.environ['RANK'] + '.pid'), 'w').write(str(os.getpid()))\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not signalled and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    argv = [sys.executable, "-m", "launch.forkrun", "--standalone", "--nproc-per-node=2"]
    agent = subprocess.Popen(
        [*argv, "-m", "cona_stopped_rank", str(tmp_path)], cwd=REPO, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{r}.pid").is_file() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)]
        os.killpg(agent.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20  # torchrun's close timeout is 30 s: a rank waiting on it is still here
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)]
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
