"""What went wrong in a failed launch, read from torchrun's output (launched with `--tee 3`).

When one rank dies the others only report gloo "Connection closed by peer" (NCCL: a remote error,
an aborted communicator or a watchdog timeout); the real cause is the rank torchrun names under "Root
Cause (first observed failure)", and that rank's own output lines (prefixed `[default<local_rank>]:` by
the tee). Out of memory is recognised by the worker's exit code or torch's own error text.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cona_cli.rundir import BAD_CHECKPOINT_EXIT, OUT_OF_MEMORY_EXIT, PEER_LOST

if TYPE_CHECKING:
    from cona_cli.cluster.launchers import Agent

_BLOCK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_ROOT = "Root Cause (first observed failure)"
_OUT_OF_MEMORY = (  # torch's CUDA caching allocator, a CUDA kernel or NCCL, the CPU allocator
    "CUDA out of memory",
    "CUDA error: out of memory",
    "Cuda failure 'out of memory'",
    "OutOfMemoryError",
    "DefaultCPUAllocator: can't allocate memory",
)
_PEAK = re.compile(r"out of memory under (\S+): peak (\d+) bytes")  # the worker's own line
_SRUN_TASK = re.compile(r"srun: error: (\S+): task \d+: (?!.*Terminated)")
TAIL = 15
SSH_FAILED = 255  # ssh's own exit status when it cannot connect or loses the connection


@dataclass(frozen=True)
class Failure:
    exit_code: int  # torchrun's own exit code
    rank: int | None = None  # the root-cause rank, if torchrun named one
    rank_exit_code: int | None = None
    exit_codes: dict[int, int] = field(default_factory=dict)  # every failed rank's exit code
    last_lines: list[str] = field(default_factory=list)  # the root-cause rank's last lines (else the log's)

    @property
    def knock_on(self) -> bool:
        """This node only failed because another one did: its first failed rank lost a peer or was
        stopped by SIGTERM (sent to every node once one fails)."""
        if self.rank_exit_code == -signal.SIGTERM:
            return True
        return self.rank is not None and any(k in line for line in self.last_lines for k in PEER_LOST)

    @property
    def out_of_memory(self) -> bool:
        """The failing rank ran out of device (or host) memory."""
        return OUT_OF_MEMORY_EXIT in self.exit_codes.values() or any(
            k in line for line in self.last_lines for k in _OUT_OF_MEMORY
        )

    @property
    def peak_bytes(self) -> int | None:
        """The out-of-memory rank's measured peak (allocated on CUDA, resident on the CPU), if it said."""
        found = [int(m.group(2)) for line in self.last_lines for m in [_PEAK.search(line)] if m]
        return found[-1] if found else None

    @property
    def strategy(self) -> str | None:
        """The strategy the out-of-memory rank ran (after an in-place resize, not the launch's), if it said."""
        found = [m.group(1) for line in self.last_lines for m in [_PEAK.search(line)] if m]
        return found[-1] if found else None

    @property
    def bad_checkpoint(self) -> bool:
        """A rank could not load the checkpoint it was given."""
        return BAD_CHECKPOINT_EXIT in self.exit_codes.values()

    def describe(self) -> str:
        if self.rank is None:
            if self.exit_code == SSH_FAILED:
                return "ssh exited with code 255 (connection failed or lost)"
            if self.exit_code < 0 and -self.exit_code in signal.valid_signals():
                return f"its agent was killed by signal {signal.Signals(-self.exit_code).name}"
            return f"torchrun exited with code {self.exit_code}"
        code = self.rank_exit_code
        how = (
            f"signal {signal.Signals(-code).name}"
            if code is not None and code < 0 and -code in signal.valid_signals()
            else f"exit code {code}"
        )
        return f"rank {self.rank} {'ran out of memory' if self.out_of_memory else 'failed first'} ({how})"


def parse_failure(log: str, exit_code: int) -> Failure:
    """The failure torchrun reports at the end of `log`."""
    codes: dict[int, int] = {}
    for rank, _local, code in _BLOCK.findall(log):
        codes.setdefault(int(rank), int(code))
    root = None
    if _ROOT in log:
        found = _BLOCK.search(log.rsplit(_ROOT, 1)[1])
        if found:
            root = (int(found.group(1)), int(found.group(2)), int(found.group(3)))
            codes[root[0]] = root[2]
    lines = log.splitlines()
    if root is not None:
        prefix = f"[default{root[1]}]:"
        own = [line[len(prefix) :] for line in lines if line.startswith(prefix)]
        lines = own or lines
    return Failure(exit_code, root[0] if root else None, root[2] if root else None, codes, lines[-TAIL:])


def failed_host(agent: Agent, log: str) -> str:
    """The node a failed agent stood for; under srun, the first host srun reports a failed task on."""
    if len(agent.nodes) == 1:
        return agent.nodes[0].name
    found = _SRUN_TASK.search(log)
    return found.group(1) if found else agent.label
