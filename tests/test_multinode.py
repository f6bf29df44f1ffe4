"""Real two-node jobs on this machine: two `local` torchrun agents on loopback, and two nodes reached
through a real sshd (127.0.0.1 and 127.0.0.2). Each trains, switches (2,1,2) -> (4,1,1) across the two
nodes and must produce the same losses, step for step, as the same chain on one node."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.sshd import Sshd, sshd_binary, start_sshd
from tests.support import REPO, TINY, write_config

pytestmark = pytest.mark.e2e

CHAIN = [{"dp": 2, "tp": 1, "pp": 2, "mbs": 2, "gbs": 16, "steps": 5}, {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16}]
STEPS = 10


def _doc(cluster: dict) -> dict:
    doc = copy.deepcopy(TINY)
    doc.pop("strategy")
    doc["chain"] = CHAIN
    doc["cluster"] = cluster
    doc["train"] = {**doc["train"], "max_steps": STEPS}
    return doc


def _train(
    tmp: Path, cluster: dict, env: dict[str, str] | None = None, wrap: list[str] | None = None
) -> subprocess.CompletedProcess:
    """`cona train` of the chain on `cluster`; `wrap` prefixes the command (run it in a namespace)."""
    cfg = write_config(tmp / "cfg.yaml", _doc(cluster))
    cmd = [*(wrap or []), sys.executable, "-m", "cona_cli", "train", str(cfg), "--run-dir", str(tmp / "run")]
    return subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=300, env={**os.environ, **(env or {})})


def _events(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _losses(run: Path) -> dict[int, float]:
    """Each step's loss (a step repeated after a restart: its last run)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}


def _assert_same_training(run: Path, reference: dict[int, float]) -> None:
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, abs=1e-5), step
    (switch,) = _events(run, "switch")
    assert (switch["from"]["dp"], switch["from"]["pp"], switch["to"]["dp"], switch["step"]) == (2, 2, 4, 5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The chain on one node of four ranks."""
    tmp = tmp_path_factory.mktemp("one-node")
    out = _train(tmp, {"nodes": 1, "procs_per_node": 4})
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(tmp / "run")


def test_two_local_nodes_switch_survive_a_node_failure_and_match_one_node(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    # global rank 3 lives on the second node; it dies in step 8, after the switch checkpoint at step 5
    out = _train(tmp_path, {"nodes": 2, "procs_per_node": 2}, env={"CONA_TEST_DIE_AT_STEP": "8:3"})
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    _assert_same_training(run, reference)
    (failure,) = _events(run, "failure")
    assert (failure["host"], failure["rank"], failure["rank_exit_code"]) == ("node1", 3, -9)
    relaunch = _events(run, "launch")[-1]
    assert relaunch["reason"] == "restart" and relaunch["from_checkpoint"].endswith("step_000005")
    assert {p.name for p in (run / "logs").iterdir()} >= {"launch_001.node0.log", "launch_001.node1.log"}
    assert "launch 2 failed: node node1: rank 3 failed first (signal SIGKILL)" in out.stderr


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Sshd:
    if sshd_binary() is None:
        pytest.skip("OpenSSH server not installed (.ci/run installs Debian's openssh-server)")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


def _processes() -> list[tuple[int, str]]:
    """(pid, command line) of every process; -ww: lines never cut at the terminal width."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [(int(pid), args) for pid, args in (line.strip().split(None, 1) for line in ps.splitlines())]


def _node_processes(run: Path) -> list[str]:
    return [args for _, args in _processes() if str(run) in args]


def test_killed_controller_stops_the_ssh_nodes_which_checkpoint_first(tmp_path: Path, sshd: Sshd) -> None:
    """SIGKILL leaves the controller no chance to stop anything: ssh's stdin closes, and each node's
    agent stops its job with SIGTERM, on which the workers checkpoint."""
    doc = _doc({"nodes": ["127.0.0.1", "127.0.0.2"], "procs_per_node": 2, "ssh_args": sshd.ssh_args})
    doc.pop("chain")
    doc["strategy"] = "dp2-tp1-pp2-mbs2-gbs16"  # one stage: no checkpoint before the kill
    doc["train"]["max_steps"] = 10_000
    cfg = write_config(tmp_path / "cfg.yaml", doc)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cona_cli", "train", str(cfg), "--run-dir", str(run)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").is_file() or len(_losses(run)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while _node_processes(run):
        assert time.monotonic() < deadline, _node_processes(run)
        time.sleep(0.5)
    committed = [p for p in (run / "checkpoints").glob("step_*") if (p / "COMMITTED").exists()]
    assert committed, "the workers did not checkpoint on SIGTERM"
    assert all(p.name != "step_000000" for p in committed)


def _second_launch_ssh_client(run: Path, host: str) -> int | None:
    """The pid of the ssh client reaching `host` for the run's second launch, once it exists."""
    if not (run / "events.jsonl").is_file() or len(_events(run, "launch")) < 2:
        return None
    return next((pid for pid, args in _processes() if args.startswith("ssh ") and f" {host} " in args), None)


def test_lost_ssh_connection_is_a_node_failure_named_by_host(
    tmp_path: Path, sshd: Sshd, reference: dict[int, float]
) -> None:
    """Two ssh nodes run the chain; the ssh client of 127.0.0.2 dies as the second launch starts (as when
    the host stops answering): the job restarts from the switch checkpoint, the failure names that host,
    training continues exactly as on one node, each node's launch has its log and no process is left."""
    cluster = {"nodes": ["127.0.0.1", "127.0.0.2"], "procs_per_node": 2, "ssh_args": sshd.ssh_args}
    cfg = write_config(tmp_path / "cfg.yaml", _doc(cluster))
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cona_cli", "train", str(cfg), "--run-dir", str(run)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (ssh_client := _second_launch_ssh_client(run, "127.0.0.2")):  # kill it while the job starts
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.kill(ssh_client, signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    failures = _events(run, "failure")
    assert failures and failures[0]["host"] == "127.0.0.2"
    assert _events(run, "launch")[-1]["reason"] == "restart"
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, abs=1e-5), step
    assert (run / "logs" / "launch_003.127.0.0.2.log").is_file()
    assert _node_processes(run) == []


def test_unreachable_ssh_node_is_refused_in_one_line(tmp_path: Path, sshd: Sshd) -> None:
    # nothing listens on 127.0.0.3
    out = _train(tmp_path, {"nodes": ["127.0.0.1", "127.0.0.3"], "procs_per_node": 2, "ssh_args": sshd.ssh_args})
    assert out.returncode == 1
    (line,) = [line for line in out.stderr.splitlines() if "shared-storage check" in line]
    assert line.startswith("cona: cluster: node 127.0.0.3 failed the shared-storage check of ")
    assert "Connection refused" in line
    assert _events(tmp_path / "run", "launch") == []


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) to give one node a private mount namespace",
)
def test_node_that_cannot_see_the_run_folder_is_refused(tmp_path: Path, sshd: Sshd) -> None:
    """A second sshd on 127.0.0.3 runs in its own mount namespace with an empty tmpfs over the runs
    folder: that node writes its probe file where no other node can see it."""
    runs = tmp_path / "runs"
    runs.mkdir()
    hide = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs none {runs} && exec "$@"',
        "sh",
    ]
    key = Path(sshd.ssh_args[sshd.ssh_args.index("-i") + 1])
    private = start_sshd(tmp_path / "sshd-private", addrs=("127.0.0.3",), port=sshd.port, wrap=hide, user_key=key)
    try:
        out = _train(
            runs,
            {"nodes": ["127.0.0.1", "127.0.0.3"], "procs_per_node": 2, "ssh_args": sshd.ssh_args, "probe_timeout_s": 3},
        )
    finally:
        private.stop()
    assert out.returncode == 1
    (line,) = [line for line in out.stderr.splitlines() if "shared-storage check" in line]
    assert "node 127.0.0.3 failed the shared-storage check" in line
    assert "cannot see controller, node_0" in line


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_two_hosts_in_network_namespaces(tmp_path: Path, reference: dict[int, float]) -> None:
    """Each node its own network stack and address, joined by a veth pair; an sshd in each; the
    controller on the first; gloo told which interface to use through each node's env."""
    if sshd_binary() is None:
        pytest.skip("OpenSSH server not installed (.ci/run installs Debian's openssh-server)")
    with netns.two_hosts() as (a, b):
        first = start_sshd(tmp_path / "sshd-a", addrs=(a.addr,), wrap=a.run([]))
        key = Path(first.ssh_args[first.ssh_args.index("-i") + 1])
        second = start_sshd(tmp_path / "sshd-b", addrs=(b.addr,), port=first.port, wrap=b.run([]), user_key=key)
        try:
            nodes = [{"host": h.addr, "env": {"GLOO_SOCKET_IFNAME": h.ifname}} for h in (a, b)]
            out = _train(tmp_path, {"nodes": nodes, "procs_per_node": 2, "ssh_args": first.ssh_args}, wrap=a.run([]))
        finally:
            first.stop()
            second.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    _assert_same_training(run, reference)
    assert (run / "logs" / f"launch_002.{b.addr}.log").is_file()
