"""Controller side of telemetry: a TCP server for newline-delimited JSON from worker rank 0.

Workers get the address and a random per-run token through the environment
(`CONA_TELEMETRY_ADDR`, `CONA_TELEMETRY_TOKEN`). The first line of a connection must be
`{"type": "hello", "token": ...}`; a connection without the token, an oversized line or a line
that is not a JSON object is dropped and logged; nothing is ever unpickled. Commands flow back on
the same connection (`{"cmd": "checkpoint_and_exit"}`).
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
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20  # bytes


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
        self._authed: set[socket.socket] = set()
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
            for key, _ in self._sel.select(timeout=0.2):
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        conn.setblocking(False)
        with self._lock:
            self._buffers[conn] = bytearray()
            self._sel.register(conn, selectors.EVENT_READ, None)

    def _close(self, conn: socket.socket) -> None:
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self._buffers.pop(conn, None)
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
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > MAX_LINE:
                    self._drop(conn, f"line over {MAX_LINE} bytes")
                return
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            if len(line) > MAX_LINE:
                self._drop(conn, f"line over {MAX_LINE} bytes")
                return
            if not self._handle(conn, line):
                return

    def _handle(self, conn: socket.socket, line: bytes) -> bool:
        try:
            msg = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            msg = None
        if not isinstance(msg, dict):
            self._drop(conn, "not a JSON object")
            return False
        if conn not in self._authed:
            token = msg.get("token")
            if (
                msg.get("type") != "hello"
                or not isinstance(token, str)
                or not hmac.compare_digest(token.encode(), self.token.encode())
            ):
                self._drop(conn, "bad or missing token")
                return False
            with self._lock:
                self._authed.add(conn)
            return True
        self.messages.put(msg)
        return True
