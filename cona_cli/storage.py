"""Before a multi-node run starts: every node must see the run folder (checkpoints, corpus, results).

Each node writes a probe file into a fresh folder under RUN_DIR/.probe and waits to see the
controller's and every other node's (`launch.storage_probe`); the controller refuses to start with
one line naming the node and what it could not see, or the node that could not be reached.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import threading
from pathlib import Path

from cona_cli.cluster import ClusterError, Node
from cona_cli.launchers import Launcher

EXTRA_WAIT_S = 60.0  # on top of the probe timeout, for ssh connections and interpreter start-up


def check_shared(launcher: Launcher, nodes: list[Node], run_dir: Path, timeout_s: float) -> None:
    """Raise ClusterError unless every node sees every other node's probe file in `run_dir`."""
    folder = run_dir.absolute() / ".probe" / secrets.token_hex(4)
    folder.mkdir(parents=True)
    (folder / "controller").write_text(socket.gethostname())
    python = launcher.cluster.python or sys.executable

    def argv_for(node: Node | None) -> list[str]:
        index = "-" if node is None else str(node.index)
        return [python, "-m", "launch.storage_probe", str(folder), index, str(len(nodes)), f"{timeout_s:g}"]

    agents = launcher.start(nodes, argv_for, {})
    timer = threading.Timer(timeout_s + EXTRA_WAIT_S, lambda: [a.abandon() for a in agents])
    timer.start()
    try:
        outputs = [a.proc.stdout.read() if a.proc.stdout else "" for a in agents]
        codes = [a.proc.wait() for a in agents]
    finally:
        timer.cancel()
        for a in agents:
            if a.proc.stdin:
                a.proc.stdin.close()
    try:
        for agent, code, out in zip(agents, codes, outputs):
            if code != 0:
                lines = [line for line in out.splitlines() if line.strip()]
                said = lines[-1].strip() if lines else f"exit status {code}"
                raise ClusterError(f"cluster: node {agent.label} failed the shared-storage check of {run_dir}: {said}")
        unseen = sorted({f"node_{n.index}" for n in nodes} - set(os.listdir(folder)))
        if unseen:
            raise ClusterError(f"cluster: {run_dir} is not shared: this machine cannot see {', '.join(unseen)}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
