"""Run on every node before the first launch: is the run folder shared storage?

`python -m launch.node.storage_probe DIR NODE NODES TIMEOUT_S` writes DIR/node_NODE, then waits until DIR
holds the controller's file and every node's. Exit 0 when it sees them all; when the timeout passes
first, one line naming what is missing and exit MISSING_CONTROLLER (this node does not see the
controller's file: its storage is the odd one out) or MISSING_NODES (only other nodes' files).
NODE `-` means $SLURM_NODEID (one srun line for all).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from cona_core.exits import MISSING_CONTROLLER, MISSING_NODES

POLL_S = 0.2


def main(argv: list[str]) -> int:
    folder, node, nodes, timeout = Path(argv[0]), argv[1], int(argv[2]), float(argv[3])
    index = int(os.environ["SLURM_NODEID"]) if node == "-" else int(node)
    host = socket.gethostname()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"node_{index}").write_text(host)
    wanted = {"controller"} | {f"node_{i}" for i in range(nodes)}
    deadline = time.monotonic() + timeout
    while True:
        missing = sorted(wanted - set(os.listdir(folder)))  # listdir refreshes NFS attribute caches
        if not missing:
            print(f"storage probe: node {index} ({host}) sees every node's file in {folder}", flush=True)
            return 0
        if time.monotonic() > deadline:
            print(f"storage probe: node {index} ({host}) cannot see {', '.join(missing)} in {folder}", flush=True)
            return MISSING_CONTROLLER if "controller" in missing else MISSING_NODES
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
