"""Worker side of telemetry: rank 0 streams JSON lines to the controller and polls for commands.

A job started by a controller (the environment names its address and token) must reach it: a worker
that cannot, or whose connection breaks, checkpoints and exits (`launch.worker`), since nothing else
would stop it. Without a controller (a worker run by hand) nothing is sent and training goes on;
metrics.jsonl is written either way.
"""

from __future__ import annotations

import json
import os
import select
import socket
from typing import Any


class TelemetryClient:
    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._buf = b""
        addr, token = os.environ.get("CONA_TELEMETRY_ADDR"), os.environ.get("CONA_TELEMETRY_TOKEN")
        self.expected = bool(addr and token)  # a controller started this job
        if not addr or not token:
            return
        host, _, port = addr.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=5)
            self._sock.setblocking(False)
        except OSError:
            self._sock = None
            return
        self.send({"type": "hello", "token": token})

    @property
    def connected(self) -> bool:
        """False before connecting, without a controller, or once the connection broke."""
        return self._sock is not None

    def close(self) -> None:
        """Drop the connection (the controller sees it close)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def send(self, message: dict[str, Any]) -> None:
        if self._sock is None:
            return
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(2)
            self._sock.sendall((json.dumps(message) + "\n").encode())
            self._sock.setblocking(False)
        except OSError:
            self._sock = None

    def poll(self, timeout: float = 0.0) -> list[dict[str, Any]]:
        """Commands received since the last poll, waiting up to `timeout` seconds for one if none is
        there (0: not at all)."""
        if self._sock is None:
            return []
        if timeout > 0 and b"\n" not in self._buf:
            select.select([self._sock], [], [], timeout)
        try:
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    self._sock = None
                    break
                self._buf += chunk
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._sock = None
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            try:
                msg = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(msg, dict):
                out.append(msg)
        return out
