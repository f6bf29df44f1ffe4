"""What went wrong in a failed launch, read from torchrun's output (launched with `--tee 3`).

When one rank dies the others only report gloo "Connection closed by peer"; the real cause is the
rank torchrun names under "Root Cause (first observed failure)", and that rank's own output lines
(prefixed `[default<local_rank>]:` by the tee).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

from cona_cli.checkpoints import BAD_CHECKPOINT_EXIT

_BLOCK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_ROOT = "Root Cause (first observed failure)"
TAIL = 15


@dataclass(frozen=True)
class Failure:
    exit_code: int  # torchrun's own exit code
    rank: int | None = None  # the root-cause rank, if torchrun named one
    rank_exit_code: int | None = None
    exit_codes: dict[int, int] = field(default_factory=dict)  # every failed rank's exit code
    last_lines: list[str] = field(default_factory=list)  # the root-cause rank's last lines (else the log's)

    @property
    def bad_checkpoint(self) -> bool:
        """A rank could not load the checkpoint it was given."""
        return BAD_CHECKPOINT_EXIT in self.exit_codes.values()

    def describe(self) -> str:
        if self.rank is None:
            return f"torchrun exited with code {self.exit_code}"
        code = self.rank_exit_code
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 and -code in \
            signal.valid_signals() else f"exit code {code}"
        return f"rank {self.rank} failed first ({how})"


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
        own = [line[len(prefix):] for line in lines if line.startswith(prefix)]
        lines = own or lines
    return Failure(exit_code, root[0] if root else None, root[2] if root else None, codes, lines[-TAIL:])
