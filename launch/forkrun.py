"""torchrun whose ranks are forked from an agent that has already imported them.

`python -m launch.forkrun [torchrun flags] -m MODULE [ARGS]` takes torchrun's flags and does what
`python -m torch.distributed.run` does (same elastic agent, rendezvous, tee and failure summary),
except that the agent imports MODULE before the rendezvous and starts its ranks with fork, each
running `MODULE.main()` with ARGS. Importing torch and the worker costs ~4 CPU-seconds; torchrun's
own start method pays it once per rank plus once in the agent (on 2 cores with 4 ranks: ~6 s of a
cold switch), this one once per node. The agent touches no device before forking (CUDA stays
uninitialised, so the ranks may use it).
"""

from __future__ import annotations

import importlib
import sys
import time
import uuid

from torch.distributed import run as torchrun
from torch.distributed.launcher.api import elastic_launch

from cona_cli.rundir import PEER_LOST

FALLBACK_MASTER_PORT = 29500  # what torchrun sets when none is given (unused by the c10d rendezvous)
# Forked ranks are watched as one group that reports only the first failure it sees: a rank that
# only lost a peer leaves this much later, so that the failure reported is the peer's own.
PEER_LOST_DELAY_S = 1.0


def run_module(module: str, *args: str) -> None:
    """A rank: `MODULE.main()` with ARGS as its command line (the module is already imported)."""
    sys.argv = [module, *args]
    try:
        importlib.import_module(module).main()
    except Exception as e:
        if any(k in str(e) for k in PEER_LOST):
            time.sleep(PEER_LOST_DELAY_S)
        raise


def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.module:
        raise SystemExit("launch.forkrun: runs a module (-m MODULE), not a script")
    importlib.import_module(args.training_script)
    if args.standalone:  # as torchrun: a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = FALLBACK_MASTER_PORT
    args.start_method = "fork"
    config, _, _ = torchrun.config_from_args(args)
    elastic_launch(config, run_module)(args.training_script, *args.training_script_args)


if __name__ == "__main__":
    main()
