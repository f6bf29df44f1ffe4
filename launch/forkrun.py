"""torchrun whose ranks are forked from a server that has already imported them.

`python -m launch.forkrun [torchrun flags] -m MODULE [ARGS]` takes torchrun's flags and does what
`python -m torch.distributed.run` does (same elastic agent, rendezvous, tee and failure summary),
except that its ranks are forked, each running `MODULE.main()` with ARGS, from a fork server that
imported torch and MODULE once. Importing them costs ~4 CPU-seconds; torchrun's own start method pays
it once per rank plus once in the agent (on 2 cores with 4 ranks: ~6 s of a cold switch), this one
once per node in the server, while the agent imports torch beside it.

The ranks are not forked from the agent itself: its rendezvous and store threads resolve host names,
and a fork taken while one of them held glibc's resolver lock left a rank deadlocked in its first
`getaddrinfo` (seen once in the test suite). The server is single-threaded. Neither touches a device
(CUDA stays uninitialised, so the ranks may use it).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import signal
import sys
import time
import uuid

from cona_cli.rundir import PEER_LOST

FALLBACK_MASTER_PORT = 29500  # what torchrun sets when none is given (unused by the c10d rendezvous)
# Forked ranks are watched as one group that reports only the first failure it sees: a rank that
# only lost a peer leaves this much later, so that the failure reported is the peer's own.
PEER_LOST_DELAY_S = 1.0


def run_module(module: str, *args: str) -> None:
    """A rank: `MODULE.main()` with ARGS as its command line (the module is already imported)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores SIGTERM; a rank does not
    sys.argv = [module, *args]
    try:
        importlib.import_module(module).main()
    except Exception as e:
        if any(k in str(e) for k in PEER_LOST):
            time.sleep(PEER_LOST_DELAY_S)
        raise


def module_named(argv: list[str]) -> str | None:
    """MODULE in `... -m MODULE ARGS`, before torchrun's own parser (which needs torch) has run."""
    flag = next((i for i, a in enumerate(argv[:-1]) if a in ("-m", "--module")), None)
    return None if flag is None else argv[flag + 1]


def start_fork_server(module: str) -> None:
    """Start the fork server, importing this module and MODULE. It ignores SIGTERM: a stop signal
    goes to the whole process group, the ranks handle it, and a server that died of it would make
    the agent believe they had all exited. It leaves when the agent does."""
    multiprocessing.set_forkserver_preload(["launch.forkrun", module])
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    module = module_named(argv)
    if module is None:
        raise SystemExit("launch.forkrun: runs a module (-m MODULE), not a script")
    start_fork_server(module)  # it imports while this process imports torch below
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from launch.forkrun import run_module as entrypoint  # by its module's name: pickled to the ranks

    args = torchrun.parse_args(argv)
    if args.standalone:  # as torchrun: a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = FALLBACK_MASTER_PORT
    args.start_method = "forkserver"
    config, _, _ = torchrun.config_from_args(args)
    elastic_launch(config, entrypoint)(args.training_script, *args.training_script_args)


if __name__ == "__main__":
    main()
