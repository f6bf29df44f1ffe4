"""Controller side of telemetry: a TCP server for newline-delimited JSON from worker rank 0.

Workers get the address and a random per-run token through the environment
(`CONA_TELEMETRY_ADDR`, `CONA_TELEMETRY_TOKEN`). The first line of a connection must be
`{"type": "hello", "token": ...}`, sent within `AUTH_TIMEOUT_S`; a connection that sends anything
else, an oversized line, or no hello in time is closed and logged. At most `MAX_PENDING` connections
wait to authenticate at once: a new one beyond that closes the one that has waited longest, so whoever
floods the port holds a bounded number of sockets and cannot lock a worker out by holding them all.
One thread serves every connection and accepts at most `ACCEPTS_PER_WAKE` of them between two rounds
of reads: an authenticated worker's rows are read between any two batches of a flood, and a new
worker's connection lasts at least `MAX_PENDING / ACCEPTS_PER_WAKE` rounds, time for the hello it
sends as soon as it connects.

An authenticated connection's rows must be JSON objects with a string `type` (for `metric`, also a
string `kind` and an integer `step`); other rows are refused and logged, and the connection stays.
Nothing is ever unpickled. `dropped` counts the connections closed and the rows refused. Commands
flow back on the same connection (`{"cmd": "checkpoint_and_exit"}`).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import secrets
import selectors
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20  # bytes of a line of an authenticated connection
MAX_HELLO = 4096  # bytes of a connection's first line, the hello
AUTH_TIMEOUT_S = 5.0  # a connection without a valid hello this long after it was accepted is closed
MAX_PENDING = 64  # connections waiting to authenticate at once; a further one closes the longest waiting
ACCEPTS_PER_WAKE = 16  # connections accepted before the established ones are read again
_TICK_S = 0.2  # the longest the thread waits before it checks the stop flag and the hello deadlines


class TelemetryServer:
    """Accepts worker connections in a background thread and queues their messages."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        self.token = token or secrets.token_hex(16)
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.dropped = 0
        self._sock = socket.create_server((host, port))
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._buffers: dict[socket.socket, bytearray] = {}
        self._pending: dict[socket.socket, float] = {}  # not yet authenticated: its hello deadline (monotonic)
        self._authed: set[socket.socket] = set()
        self._full = False  # MAX_PENDING reached (warned once until there is room again)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="cona-telemetry", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def env(self) -> dict[str, str]:
        return {"CONA_TELEMETRY_ADDR": self.address, "CONA_TELEMETRY_TOKEN": self.token}

    def send(self, message: dict[str, Any]) -> int:
        """Send a command to every authenticated worker connection; returns how many got it."""
        data = (json.dumps(message) + "\n").encode()
        sent = 0
        with self._lock:
            for conn in list(self._authed):
                try:
                    conn.sendall(data)
                    sent += 1
                except OSError:
                    self._close(conn)
        return sent

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            for conn in list(self._buffers):
                self._close(conn)
        self._sel.close()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=_TICK_S):
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    self._serve_one(key.fileobj)  # type: ignore[arg-type]
            self._expire()

    def _serve_one(self, conn: socket.socket) -> None:
        """Read what a connection sent; a connection whose rows break the server's own code is closed."""
        try:
            self._read(conn)
        except Exception:
            log.exception("telemetry: error serving a connection")
            self._drop(conn, "error serving it")

    def _accept(self) -> None:
        """Accept up to ACCEPTS_PER_WAKE waiting connections, each with its hello deadline."""
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, _ = self._sock.accept()
            except OSError:  # none left (or no descriptor free): the next wake tries again
                return
            self._make_room()
            conn.setblocking(False)
            with self._lock:
                self._buffers[conn] = bytearray()
                self._pending[conn] = time.monotonic() + AUTH_TIMEOUT_S
                self._sel.register(conn, selectors.EVENT_READ, None)

    def _make_room(self) -> None:
        """Where MAX_PENDING connections wait to authenticate, close the one that has waited longest."""
        if len(self._pending) < MAX_PENDING:
            self._full = False
            return
        if not self._full:
            log.warning("telemetry: %d connections wait to authenticate; closing the oldest for new ones", MAX_PENDING)
            self._full = True
        self.dropped += 1
        with self._lock:
            self._close(next(iter(self._pending)))  # insertion order: the oldest first

    def _expire(self) -> None:
        """Close the connections whose hello deadline has passed."""
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, deadline in self._pending.items() if deadline <= now]
            self.dropped += len(late)  # before the closes: whoever sees one closed sees it counted
            for conn in late:
                self._close(conn)
        if late:
            log.warning("telemetry: closed %d connections without a hello within %g s", len(late), AUTH_TIMEOUT_S)

    def _close(self, conn: socket.socket) -> None:
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self._buffers.pop(conn, None)
        self._pending.pop(conn, None)
        self._authed.discard(conn)
        conn.close()

    def _drop(self, conn: socket.socket, why: str) -> None:
        self.dropped += 1
        log.warning("telemetry: dropped a connection: %s", why)
        with self._lock:
            self._close(conn)

    def _read(self, conn: socket.socket) -> None:
        try:
            chunk = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            with self._lock:
                self._close(conn)
            return
        buf = self._buffers.get(conn)
        if buf is None:
            return
        buf.extend(chunk)
        while conn in self._buffers:
            limit = MAX_LINE if conn in self._authed else MAX_HELLO
            nl = buf.find(b"\n", 0, limit + 1)
            if nl < 0:
                if len(buf) > limit:
                    self._drop(conn, f"line over {limit} bytes")
                return
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            self._handle(conn, _parse(line))

    def _handle(self, conn: socket.socket, msg: Any) -> None:
        """A row of a connection: the hello of a new one, else a row to queue or refuse."""
        if conn not in self._authed:
            if not _is_hello(msg, self.token):
                self._drop(conn, "first line is not a hello with the run's token")
                return
            with self._lock:
                self._authed.add(conn)
                self._pending.pop(conn, None)
            return
        why = _refusal(msg)
        if why is not None:
            self.dropped += 1
            log.warning("telemetry: refused a row: %s", why)
            return
        self.messages.put(msg)


def _parse(line: bytes) -> Any:
    """The JSON value of a line; None if it is not JSON."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        return None


def _is_hello(msg: Any, token: str) -> bool:
    """Whether `msg` is `{"type": "hello", "token": <the run's token>}`."""
    if not isinstance(msg, dict) or msg.get("type") != "hello":
        return False
    given = msg.get("token")
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())


def _refusal(msg: Any) -> str | None:
    """Why a row of an authenticated connection is refused, or None to queue it."""
    if not isinstance(msg, dict):
        return "not a JSON object"
    if not isinstance(msg.get("type"), str):
        return "no string `type`"
    if msg["type"] == "metric":
        if not isinstance(msg.get("kind"), str):
            return "a metric without a string `kind`"
        step = msg.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return "a metric without an integer `step`"
    return None
