"""The telemetry server: authenticated JSON lines in, commands out; bad peers dropped, never fatal."""

from __future__ import annotations

import json
import socket
import time

import pytest

from cona_cli.control.telemetry_server import TelemetryServer
from launch.telemetry_client import TelemetryClient


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    assert cond()


@pytest.fixture
def server():
    srv = TelemetryServer()
    yield srv
    srv.close()


def _connect(srv: TelemetryServer) -> socket.socket:
    host, port = srv.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def test_client_streams_and_receives_commands(server: TelemetryServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    client = TelemetryClient()
    client.send({"type": "metric", "kind": "step", "step": 1, "loss": 2.5})
    msg = server.messages.get(timeout=5)
    assert msg == {"type": "metric", "kind": "step", "step": 1, "loss": 2.5}
    assert server.send({"cmd": "checkpoint_and_exit"}) == 1
    received: list[dict] = []
    _wait(lambda: bool(received.extend(client.poll()) or received))
    assert received == [{"cmd": "checkpoint_and_exit"}]


def test_bad_peers_are_dropped_and_server_survives(server: TelemetryServer) -> None:
    wrong = _connect(server)
    wrong.sendall(b'{"type": "hello", "token": "not-the-token"}\n{"type": "metric", "step": 99}\n')
    garbage = _connect(server)
    garbage.sendall(b"\x80\x04\x95 this is a pickle, not json\n")
    big = _connect(server)
    big.sendall(json.dumps({"type": "hello", "token": server.token}).encode() + b"\n")
    try:
        big.sendall(b"x" * (10 * 1024 * 1024) + b"\n")
    except OSError:
        pass  # the server may already have hung up on us
    _wait(lambda: server.dropped == 3, timeout=10)
    assert server.messages.empty()
    good = _connect(server)
    good.sendall(
        json.dumps({"type": "hello", "token": server.token}).encode()
        + b"\n"
        + json.dumps({"type": "metric", "kind": "step", "step": 1}).encode()
        + b"\n"
    )
    assert server.messages.get(timeout=5) == {"type": "metric", "kind": "step", "step": 1}
    for s in (wrong, garbage, big, good):
        s.close()


def test_client_without_controller_keeps_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONA_TELEMETRY_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("CONA_TELEMETRY_TOKEN", "t")
    client = TelemetryClient()
    client.send({"type": "metric"})
    assert client.poll() == []
