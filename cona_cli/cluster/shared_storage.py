"""Before a multi-node run starts: every node must see the run folder (checkpoints, corpus, results).

Each node writes a probe file into a fresh folder under RUN_DIR/.probe and waits to see the
controller's and every other node's (`launch.node.storage_probe`); the controller refuses to start with
one line naming the node and what it could not see, or the node that could not be reached.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

from cona_cli.cluster.launchers import Agent, Launcher
from cona_cli.cluster.nodes import ClusterError, Node
from cona_core.exits import MISSING_CONTROLLER, MISSING_NODES
from cona_core.rundir import RunDir

VERDICTS = (MISSING_CONTROLLER, MISSING_NODES)  # the probe ran and saw its folder incomplete
EXTRA_WAIT_S = 60.0  # on top of the probe timeout, for ssh connections and interpreter start-up


def check_shared(launcher: Launcher, nodes: list[Node], run_dir: Path, timeout_s: float) -> None:
    """Raise ClusterError unless every node sees every other node's probe file in `run_dir`."""
    folder = RunDir(run_dir.absolute()).probe / secrets.token_hex(4)
    folder.mkdir(parents=True)
    (folder / "controller").write_text(socket.gethostname())
    python = launcher.cluster.python or sys.executable

    def argv_for(node: Node | None) -> list[str]:
        index = "-" if node is None else str(node.index)
        return [python, "-m", "launch.node.storage_probe", str(folder), index, str(len(nodes)), f"{timeout_s:g}"]

    agents = launcher.start(nodes, argv_for, {})
    try:
        outputs, stopped = _wait(agents, timeout_s + EXTRA_WAIT_S)
        failed = [a for i, a in enumerate(agents) if a.poll() != 0 and i not in stopped]
        if not failed and stopped:
            raise ClusterError(
                f"cluster: the shared-storage check of {run_dir} did not finish within "
                f"{timeout_s + EXTRA_WAIT_S:g} s (node {agents[min(stopped)].label})"
            )
        if failed:  # blame a node that could not run the probe, then one that misses the controller's file
            agent = min(failed, key=lambda a: (a.poll() in VERDICTS, a.poll() == MISSING_NODES))
            said = _last_line(outputs[agents.index(agent)], agent.poll())
            raise ClusterError(f"cluster: node {agent.label} failed the shared-storage check of {run_dir}: {said}")
        unseen = sorted({f"node_{n.index}" for n in nodes} - set(os.listdir(folder)))
        if unseen:
            raise ClusterError(f"cluster: {run_dir} is not shared: this machine cannot see {', '.join(unseen)}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(agents: list[Agent], deadline_s: float) -> tuple[list[str], set[int]]:
    """Every agent's output once all have ended, and the indices of those stopped here: once one fails
    without a probe verdict (e.g. ssh could not connect), or time runs out, the rest are stopped."""
    outputs: list[list[str]] = [[] for _ in agents]
    readers = [
        threading.Thread(target=lambda a=a, out=out: out.extend(a.proc.stdout or ()), daemon=True)
        for a, out in zip(agents, outputs)
    ]
    for r in readers:
        r.start()
    stopped: set[int] = set()
    end = time.monotonic() + deadline_s
    while any(a.poll() is None for a in agents):
        if any(a.poll() not in (None, 0, *VERDICTS) for a in agents) or time.monotonic() > end:
            running = {i for i, a in enumerate(agents) if a.poll() is None} - stopped
            for i in running:
                agents[i].abandon()
            stopped |= running
        time.sleep(0.1)
    for r, a in zip(readers, agents):
        r.join(timeout=5)
        a.close_stdin()
    return ["".join(out) for out in outputs], stopped


def _last_line(output: str, code: int | None) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {code}"
