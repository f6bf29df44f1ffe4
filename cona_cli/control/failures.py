"""What went wrong in a failed launch, read from torchrun's output (launched with `--tee 3`).

When one rank dies the others only report gloo "Connection closed by peer" (NCCL: a remote error,
an aborted communicator or a watchdog timeout); the real cause is the rank torchrun names under "Root
Cause (first observed failure)", and that rank's own output lines (prefixed `[default<local_rank>]:` by
the tee). Out of memory is recognised by the worker's exit code or the error text of torch, CUDA, NCCL or
cuBLAS (NCCL and cuBLAS allocations do not go through torch's allocator and fail as DistBackendError or
RuntimeError: the same texts as `launch.device.OUT_OF_MEMORY_TEXT`). A rank that exits with
`REFUSED_EXIT` refused deterministically (its node cannot run the config, e.g. no GPU for NCCL): running
it again cannot help, and the run ends with the worker's one line. So does a rank that exits with
`STORAGE_EXIT` (its checkpoint could not be written: disk full or not writable); that run may continue
with `--resume` once there is room, from the last good checkpoint, which is kept.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cona_core.exits import (
    BAD_CHECKPOINT_EXIT,
    OUT_OF_MEMORY_EXIT,
    PEER_LOST,
    REFUSED_EXIT,
    SIGNALLED_EXIT,
    STORAGE_EXIT,
)

if TYPE_CHECKING:
    from cona_cli.cluster.launchers import Agent

_BLOCK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_ROOT = "Root Cause (first observed failure)"
# torch's caching allocator, a CUDA runtime call (cudaErrorMemoryAllocation), NCCL's buffers (its last
# error: "Cuda failure 2 'out of memory'" from cuMem*, "Cuda failure 'out of memory'", "Failed to CUDA
# calloc N bytes"), cuBLAS/cuDNN handles ("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
# the driver API, torch's exception name, the CPU allocator.
_OUT_OF_MEMORY = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|Cuda failure (?:\d+ )?'out of memory'|Failed to CUDA calloc"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"
    r"|OutOfMemoryError|DefaultCPUAllocator: can't allocate memory"
)
_REFUSAL = re.compile(r"^\s*cona-worker: (?!placement: )(.+)$")  # the worker's one line before REFUSED_EXIT
_STORAGE = re.compile(r"^\s*cona-worker: (checkpoint not saved: .+)$")  # the worker's one line before STORAGE_EXIT
_PEAK = re.compile(r"out of memory under (\S+): peak (\d+) bytes")  # the worker's own line
_SRUN_TASK = re.compile(r"srun: error: (\S+): task \d+: (?!.*Terminated)")
TAIL = 15
SSH_FAILED = 255  # ssh's own exit status when it cannot connect or loses the connection
# Why a job that stopped on its own, without the controller's asking, did (the worker's outcome reason).
STOPPED_ON_ITS_OWN = {
    "signal": "a rank got SIGTERM",
    "controller_lost": "rank 0 lost its telemetry connection",
    "command": "a stop command this controller did not send",
}


@dataclass(frozen=True)
class Failure:
    exit_code: int  # torchrun's own exit code
    rank: int | None = None  # the root-cause rank, if torchrun named one
    rank_exit_code: int | None = None
    exit_codes: dict[int, int] = field(default_factory=dict)  # every failed rank's exit code
    last_lines: list[str] = field(default_factory=list)  # the root-cause rank's last lines (else the log's)
    stopped: str | None = None  # the job exited cleanly but stopped on its own: its outcome's reason

    @classmethod
    def stopped_on_its_own(cls, reason: str) -> Failure:
        """A launch whose job checkpointed and exited without the controller's asking (`reason`, its
        outcome's): a failure to recover from, though every rank exited 0."""
        return cls(0, stopped=reason)

    @property
    def knock_on(self) -> bool:
        """This node only failed because another one did: its first failed rank lost a peer or was
        stopped by SIGTERM (sent to every node once one fails)."""
        if self.rank_exit_code in (-signal.SIGTERM, SIGNALLED_EXIT):
            return True
        return self.rank is not None and any(k in line for line in self.last_lines for k in PEER_LOST)

    @property
    def out_of_memory(self) -> bool:
        """The failing rank ran out of device (or host) memory."""
        return OUT_OF_MEMORY_EXIT in self.exit_codes.values() or any(
            _OUT_OF_MEMORY.search(line) for line in self.last_lines
        )

    @property
    def refusal(self) -> str | None:
        """The worker's one line when the root-cause rank refused to run (exit `REFUSED_EXIT`): the same
        config on the same nodes fails the same way, so the run ends instead of relaunching."""
        if self.rank_exit_code != REFUSED_EXIT or self.out_of_memory:
            return None
        said = [m.group(1).strip() for line in self.last_lines for m in [_REFUSAL.match(line)] if m]
        if said:
            return said[-1]
        lines = [line.strip() for line in self.last_lines if line.strip()]
        return lines[-1] if lines else f"rank {self.rank} exited with code {REFUSED_EXIT}"

    @property
    def storage(self) -> str | None:
        """The worker's one line when a rank could not write its checkpoint (exit `STORAGE_EXIT`): relaunching
        would only fail at the next save, so the run stops (resumable once there is room)."""
        if STORAGE_EXIT not in self.exit_codes.values():
            return None
        said = [m.group(1).strip() for line in self.last_lines for m in [_STORAGE.match(line)] if m]
        return said[-1] if said else f"a rank exited with code {STORAGE_EXIT} (checkpoint not saved)"

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
        if self.stopped is not None:
            return f"the job stopped on its own: {STOPPED_ON_ITS_OWN.get(self.stopped, self.stopped)}"
        if self.rank is None:
            if self.exit_code == SSH_FAILED:
                return "ssh exited with code 255 (connection failed or lost)"
            if self.exit_code < 0 and -self.exit_code in signal.valid_signals():
                return f"its agent was killed by signal {signal.Signals(-self.exit_code).name}"
            return f"torchrun exited with code {self.exit_code}"
        how = _how_it_ended(self.rank_exit_code)
        return f"rank {self.rank} {'ran out of memory' if self.out_of_memory else 'failed first'} ({how})"


def _how_it_ended(code: int | None) -> str:
    """A rank's exit code in words: the signal that killed it, a SIGTERM it checkpointed on, or the code."""
    if code is not None and code < 0 and -code in signal.valid_signals():
        return f"signal {signal.Signals(-code).name}"
    return "SIGTERM, checkpointed" if code == SIGNALLED_EXIT else f"exit code {code}"


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
