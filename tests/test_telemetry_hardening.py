"""The telemetry server under strangers: idle connections are closed after the hello deadline, a flood
of them neither delays an authenticated worker's rows nor locks a new worker out, and malformed rows
of an authenticated worker are refused one by one while its connection stays."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cona_cli.control import telemetry_server
from cona_cli.control.telemetry_server import TelemetryServer
from launch.telemetry_client import TelemetryClient

FLOOD = 1000


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    assert cond()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[TelemetryServer]:
    monkeypatch.setattr(telemetry_server, "AUTH_TIMEOUT_S", 1.0)
    srv = TelemetryServer()
    for key, value in srv.env().items():
        monkeypatch.setenv(key, value)
    yield srv
    srv.close()


def _connect(srv: TelemetryServer) -> socket.socket:
    host, port = srv.address.rsplit(":", 1)
    assert host == "127.0.0.1"
    return socket.create_connection((host, int(port)), timeout=10)


def _wait_closed_by_server(socks: list[socket.socket], timeout: float = 30.0) -> None:
    """Until every socket has seen the server close it (end of file or reset)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_ = set(socks)
    deadline = time.monotonic() + timeout
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                if s.recv(1) != b"":  # type: ignore[union-attr]
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            sel.unregister(s)
            open_.discard(s)  # type: ignore[arg-type]
    sel.close()
    assert not open_, f"{len(open_)} connections still open"


def _rows(srv: TelemetryServer) -> list[dict[str, Any]]:
    out = []
    while not srv.messages.empty():
        out.append(srv.messages.get_nowait())
    return out


def _metric(launch: int, step: int) -> dict[str, Any]:
    return {"type": "metric", "kind": "step", "step": step, "launch": launch}


def test_a_flood_of_idle_connections_stalls_no_worker_and_is_closed(server: TelemetryServer) -> None:
    worker = TelemetryClient()
    flood: list[socket.socket] = []
    sent: list[int] = []
    late: TelemetryClient | None = None
    try:
        for i in range(FLOOD):
            flood.append(_connect(server))
            if i % 10 == 0:
                worker.send(_metric(1, i))
                sent.append(i)
            if i == FLOOD // 2:  # the pending connections are at their bound: a new worker still gets in
                late = TelemetryClient()
                late.send(_metric(2, i))
        assert worker.connected and late is not None and late.connected
        _wait(lambda: server.messages.qsize() == len(sent) + 1)
        rows = _rows(server)
        assert [r["step"] for r in rows if r["launch"] == 1] == sent
        assert [r["step"] for r in rows if r["launch"] == 2] == [FLOOD // 2]
        _wait_closed_by_server(flood)  # pushed out by newer ones, or no hello within AUTH_TIMEOUT_S
        assert server.dropped == FLOOD
        assert server.send({"cmd": "checkpoint_and_exit"}) == 2  # both workers still connected
        worker.send(_metric(1, FLOOD))
        assert server.messages.get(timeout=10) == _metric(1, FLOOD)
    finally:
        for s in flood:
            s.close()


def test_idle_connections_are_closed_after_the_hello_deadline(server: TelemetryServer) -> None:
    idle = [_connect(server) for _ in range(10)]
    worker = TelemetryClient()
    try:
        _wait_closed_by_server(idle)
        assert server.dropped == len(idle)
        worker.send(_metric(1, 3))  # authenticated in time: kept past the deadline
        assert server.messages.get(timeout=10) == _metric(1, 3)
    finally:
        for s in idle:
            s.close()


def test_an_oversized_hello_closes_the_connection(server: TelemetryServer) -> None:
    stranger = _connect(server)
    try:
        stranger.sendall(b"{" * (telemetry_server.MAX_HELLO + 1))
        _wait_closed_by_server([stranger])
        assert server.dropped == 1
    finally:
        stranger.close()


def test_malformed_rows_are_refused_and_the_worker_stays_connected(server: TelemetryServer) -> None:
    bad = [
        b"[1, 2]",
        b'"a string"',
        b"\x80\x04\x95 not json",
        b"[" * 5000,  # nested deeper than the parser recurses
        b'{"kind": "step", "step": 1}',  # no type
        b'{"type": 3}',
        b'{"type": "metric", "step": 1}',  # no kind
        b'{"type": "metric", "kind": "step"}',  # no step
        b'{"type": "metric", "kind": "step", "step": "1"}',
        b'{"type": "metric", "kind": "step", "step": true}',
    ]
    good = [_metric(1, 1), {"type": "checkpoint", "step": 1, "path": "/r/step_000001"}, {"type": "later-kind"}]
    conn = _connect(server)
    try:
        hello = json.dumps({"type": "hello", "token": server.token}).encode()
        conn.sendall(b"\n".join([hello, *bad, *(json.dumps(r).encode() for r in good)]) + b"\n")
        _wait(lambda: server.messages.qsize() == len(good))
        assert _rows(server) == good
        assert server.dropped == len(bad)
        assert server.send({"cmd": "checkpoint_and_exit"}) == 1
        assert json.loads(conn.recv(4096)) == {"cmd": "checkpoint_and_exit"}
    finally:
        conn.close()
