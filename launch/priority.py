"""Idle scheduling for the parts of a standby that run beside a training job (no torch import here:
a standby's agent lowers its priority before it imports torch)."""

from __future__ import annotations

import os
import resource

IDLE_IMPORT_ENV = "CONA_IDLE_IMPORT"  # set by the controller for a standby's agents


def lower_priority() -> tuple[int, int] | None:
    """Idle scheduling for this process where it can be undone (root, or RLIMIT_NICE allows the
    current nice value back); returns the (policy, nice) to restore, None if left as it was."""
    old = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    if os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20 - old[1]:
        return None
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return None
    return old


def restore_priority(old: tuple[int, int] | None) -> bool:
    """Back to the scheduling recorded by `lower_priority`; False where the system does not allow it."""
    if old is None:
        return True
    try:
        os.sched_setscheduler(0, old[0], os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, old[1])
    except OSError:
        return False
    return True
