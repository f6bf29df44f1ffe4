"""torchrun whose ranks are forked from a server that has already imported them.

`python -m launch.forkrun [torchrun flags] -m MODULE [ARGS]` takes torchrun's flags and does what
`python -m torch.distributed.run` does (same elastic agent, rendezvous, tee and failure summary),
except that its ranks are forked, each running `MODULE.main()` with ARGS, from a fork server that
already holds torch and MODULE. Importing them costs ~4 CPU-seconds; torchrun's own start method pays
it once per rank plus once in the agent (on 2 cores with 4 ranks: ~6 s of a cold switch), this one
once per node.

The agent imports torch and MODULE, then forks the fork server from itself before it starts any
thread of its own (multiprocessing's forkserver, forked instead of spawned, so it needs no import of
its own). Ranks are never forked from the agent: its rendezvous and store threads resolve host names,
and a fork taken while one of them held glibc's resolver lock left a rank deadlocked in its first
`getaddrinfo` (seen once in the test suite). The server has a single thread (fork copies only the
caller). Neither process touches a device (CUDA stays uninitialised, so the ranks may use it).

No rank outlives its agent. The server dies with the agent (SIGKILL: it holds nothing), and each rank
gets SIGTERM when the server goes (Linux's parent-death signal), which the worker handles like any
stop: it finishes its step, checkpoints with the other ranks and exits. An agent lost to a crash or the
OOM killer thus leaves no ranks that train on, hold devices or write into the run folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence

from torch.distributed import run as torchrun
from torch.distributed.launcher.api import elastic_launch

from cona_core.exits import PEER_LOST, SIGNALLED_EXIT

FALLBACK_MASTER_PORT = 29500  # what torchrun sets when none is given (unused by the c10d rendezvous)
# Forked ranks are watched as one group that reports only the first failure it sees: a rank that
# only lost a peer leaves this much later, so that the failure reported is the peer's own.
PEER_LOST_DELAY_S = 1.0


_PR_SET_PDEATHSIG = 1
_server_pid: int | None = None  # set in the fork server; its ranks inherit it


def die_with_parent(sig: int, parent: int) -> None:
    """Get `sig` when process `parent`, this one's parent, is gone (Linux; elsewhere nothing). If it
    went before the request took effect, get it now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _orphaned() -> bool:
    """Whether this rank's fork server, and so its agent, is gone."""
    return _server_pid is not None and os.getppid() != _server_pid


def run_module(module: str, *args: str) -> None:
    """A rank: `MODULE.main()` with ARGS as its command line (the module is already imported).

    Once `main` returns, torchrun's wrapper waits for the agent to read the rank's return value. An agent
    that is gone, or that is stopping its job with SIGTERM, never reads it, so such a rank (checkpointed,
    done) would linger until the agent's 30 s close timeout kills it, or for ever. It leaves at once
    instead: when its fork server is gone, or when MODULE says a signal stopped it (`signalled`), then with
    `SIGNALLED_EXIT`: a SIGTERM that came to this rank alone, its agent not stopping, fails the launch
    (which the controller recovers from) instead of leaving the agent to wait for this rank for ever. A
    rank that returns takes SIGTERM's default back, so a stopping agent's signal ends it while it waits."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores SIGTERM; a rank does not
    if _server_pid is not None:
        die_with_parent(signal.SIGTERM, _server_pid)
    sys.argv = [module, *args]
    mod = importlib.import_module(module)
    try:
        mod.main()
    except BaseException as e:
        if _orphaned():
            traceback.print_exc()
            exit_without_teardown(e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1)
        if any(k in str(e) for k in PEER_LOST):
            time.sleep(PEER_LOST_DELAY_S)
        raise
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # main is done: nothing is left to checkpoint
    if getattr(mod, "signalled", False):
        exit_without_teardown(SIGNALLED_EXIT)
    if _orphaned():
        exit_without_teardown(0)


def _fork_server_process(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
    """`multiprocessing.util.spawnv_passfds` for the fork server: fork this process and run the
    server's `-c` command in the child, which keeps only the descriptors a spawn would pass."""
    if "-c" not in args:  # not the forkserver command this was written for: spawn it as usual
        return _spawnv_passfds(path, args, passfds)
    command = args[list(args).index("-c") + 1]
    agent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    global _server_pid
    _server_pid = os.getpid()
    try:  # the child: the descriptors a spawn would have passed, then serve until the agent leaves
        die_with_parent(signal.SIGKILL, agent)
        keep = sorted({0, 1, 2, *passfds})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        exec(command, {"__name__": "__mp_forkserver__"})
    finally:
        os._exit(0)


_spawnv_passfds = multiprocessing.util.spawnv_passfds


@contextlib.contextmanager
def _forking_spawn() -> Iterator[None]:
    multiprocessing.util.spawnv_passfds = _fork_server_process
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = _spawnv_passfds


def start_fork_server(module: str) -> None:
    """Import MODULE and fork the fork server (see the module docstring). It ignores SIGTERM: a stop
    signal goes to the whole process group, the ranks handle it, and a server that died of it would
    make the agent believe they had all exited. It leaves when the agent does."""
    importlib.import_module(module)  # before the fork: the server and every rank inherit it
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with _forking_spawn():
            multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.module:
        raise SystemExit("launch.forkrun: runs a module (-m MODULE), not a script")
    start_fork_server(args.training_script)
    if args.standalone:  # as torchrun: a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = FALLBACK_MASTER_PORT
    args.start_method = "forkserver"
    config, _, _ = torchrun.config_from_args(args)
    # Pickled to the ranks as __main__.run_module: the fork server is a fork of this process, so its
    # __main__ is this module too.
    elastic_launch(config, run_module)(args.training_script, *args.training_script_args)


def exit_without_teardown(code: int) -> None:
    """Leave now: finalizing an interpreter that holds torch takes ~0.75 s of CPU, which on a small
    host the next launch (started while this job exits) would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = 1
    try:
        main()
        code = 0
    except SystemExit as e:  # a message (printed, as Python would) or an exit code
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        else:
            code = e.code or 0
    except BaseException:
        traceback.print_exc()
    exit_without_teardown(code)
