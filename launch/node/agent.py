"""What `ssh <node>` runs: start one command in its own process group and stop it with the controller.

The controller writes one JSON line to stdin, {"argv": [...], "env": {...}}, so the run's environment
(the telemetry token among it) never shows in a process listing. Later stdin lines `term` / `kill`
signal the command's process group; end of stdin (the controller or its ssh connection is gone)
means SIGTERM, then SIGKILL after a grace period. The exit status is the command's (128 + signal
number when a signal ended it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

GRACE_S = 120.0  # for workers to checkpoint after SIGTERM, as the controller allows
SIGNALS = {"term": signal.SIGTERM, "kill": signal.SIGKILL}


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _watch_stdin(proc: subprocess.Popen) -> None:
    for line in sys.stdin:
        sig = SIGNALS.get(line.strip())
        if sig is not None:
            _signal_group(proc, sig)
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    proc = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: _signal_group(proc, signal.SIGTERM))
    threading.Thread(target=_watch_stdin, args=(proc,), daemon=True).start()
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
