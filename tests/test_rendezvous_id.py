"""The rendezvous id on every node's torchrun command line (visible in `ps`) tells nothing of the
telemetry token, and still names one launch: the same on all its nodes, another for the next launch."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from cona_cli.cluster.launchers import Agent, ArgvFor, Launcher
from cona_cli.cluster.nodes import Node, is_multi_node, resolve_nodes
from cona_cli.control.jobs import JobStarter
from cona_cli.control.telemetry_server import TelemetryServer
from cona_core.config import config_from_dict
from cona_core.rundir import RunDir
from tests.support import TINY

PIECE = 6  # token pieces this long are looked for (shorter ones turn up by chance in any hex digest)


class _Recording(Launcher):
    """Starts nothing: keeps each node's command line."""

    lines: list[list[str]]

    def start(self, nodes: list[Node], argv_for: ArgvFor, env: dict[str, str]) -> list[Agent]:
        self.lines = [argv_for(n) for n in nodes]
        return []


@pytest.fixture
def telemetry() -> Iterator[TelemetryServer]:
    srv = TelemetryServer()
    yield srv
    srv.close()


@pytest.mark.parametrize(
    "cluster",
    [
        {"nodes": 2, "procs_per_node": 2},
        {"nodes": ["10.0.0.1", "10.0.0.2"], "procs_per_node": 2, "rdzv_endpoint": "10.0.0.1"},
    ],
    ids=["local", "ssh"],
)
def test_launch_command_lines_hold_no_piece_of_the_token(
    tmp_path: Path, telemetry: TelemetryServer, cluster: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONA_TEST_NO_JOBS")  # the recording launcher starts nothing
    doc = copy.deepcopy(TINY)
    doc["cluster"], doc["strategy"] = cluster, "dp4-tp1-pp1-mbs2-gbs16"
    cfg = config_from_dict(doc)
    launcher = _Recording(cfg.cluster)
    nodes = resolve_nodes(cfg.cluster)
    starter = JobStarter(
        cfg, RunDir(tmp_path), nodes, launcher, telemetry, 0.0, Console(), False, is_multi_node(cfg.cluster)
    )
    ids = []
    for launch in (3, 4):
        assert starter.start(launch, ["-m", "launch.worker"]) == ([], [])
        assert len(launcher.lines) == 2
        line = " ".join(" ".join(argv) for argv in launcher.lines)
        token = telemetry.token
        assert [token[i : i + PIECE] for i in range(len(token) - PIECE + 1) if token[i : i + PIECE] in line] == []
        per_node = {a for argv in launcher.lines for a in argv if a.startswith("--rdzv-id=")}
        assert len(per_node) == 1  # every node of the launch meets under one id
        ids.append(per_node.pop())
    assert ids[0] != ids[1]
