"""A process that dies with its parent: Linux's PR_SET_PDEATHSIG, asked for right after the fork.

Without it a SIGKILLed torchrun agent left its ranks training for 45 minutes, reparented to init
and writing into the run folder (issue #25): the ranks are children of the fork server
(`launch.forkrun`), which leaves when the agent does, but nothing told them. Now the fork server
dies with its agent (SIGKILL: it holds nothing), each rank with the fork server (SIGKILL: the agent
that would have stopped it gracefully is already gone), and an agent started by a local controller
with that controller (SIGTERM: torchrun stops its ranks with SIGTERM and they checkpoint).

The kernel sends the signal when the *thread* that forked the child exits, so each of these is
forked from a thread that lives as long as its process (the controller's and agent's main threads,
the single-threaded fork server). A parent that died between the fork and the prctl is caught by
comparing getppid() with the pid it had. Off Linux this does nothing; there the ranks still stop
when the controller's telemetry connection closes (`launch.worker`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent (pid `parent`, read before the fork)
    exits; sent now if it already has. Returns whether the kernel took the request (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        taken = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if taken and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return taken
