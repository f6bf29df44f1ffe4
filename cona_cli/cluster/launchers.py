"""Start and stop one command per node with the tools clusters already have: local processes, ssh, srun.

cona runs no process manager of its own: on each node the command is a torchrun agent (or the
storage probe), and a launcher only starts it, signals it and reports its output and exit status.

- `local`: one process per node on this machine, each in its own process group.
- `ssh`: `ssh -T -o BatchMode=yes <node> 'cd WORKDIR && exec PYTHON -m launch.node.agent'`; the
  command and the run's environment go over stdin (never on a command line), and stopping writes
  `term`/`kill` to it. If the controller dies, ssh's stdin closes and the node stops its job.
  ssh carries no environment, so the node gets the run's variables plus these of the controller's shell:
  every `CONA_*`, `NCCL_*` (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...), `CUDA_*`, `TORCH_*`, `PYTORCH_*`,
  `GLOO_*`, `FI_*` (libfabric, e.g. EFA) and `UCX_*` variable, and MALLOC_MMAP_THRESHOLD_ /
  MALLOC_TRIM_THRESHOLD_ (`FORWARDED_PREFIXES`, `FORWARDED_NAMES`); `cluster.env` and a host's `env` win.
- `slurm`: one `srun --ntasks-per-node=1 --cpus-per-task=$SLURM_CPUS_ON_NODE --overlap --kill-on-bad-exit=1
  --label` for all nodes of the allocation (srun passes the whole environment on; `--overlap` lets the
  standby's step share the allocation with the running one, srun(1): "allows steps to share all
  resources (CPUs, memory, and GRES) with all other steps").

Threads per rank on ssh and srun nodes: unless `cluster.threads_per_proc` fixes it, each node divides its
own CPUs among its ranks (`CONA_THREADS_PER_PROC=node`, read by `launch.device.threads_per_rank`), not the
controller's machine's count.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

from cona_cli.cluster.nodes import Node
from cona_core.config import ClusterConfig

ArgvFor = Callable[[Node | None], list[str]]  # the command for a node (None: one line for all nodes)
# Variables of this process that ssh nodes get too (srun forwards the whole environment itself).
FORWARDED_PREFIXES = ("CONA_", "NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "GLOO_", "FI_", "UCX_")
FORWARDED_NAMES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
NODE_THREADS = {"CONA_THREADS_PER_PROC": "node", "OMP_NUM_THREADS": "1"}  # the node counts its own CPUs


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What of `environ` (the controller's) a remote node gets."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


class Agent:
    """The local end of what runs for one node (under srun: for all nodes)."""

    def __init__(self, label: str, nodes: list[Node], proc: subprocess.Popen, control: bool = False) -> None:
        self.label, self.nodes, self.proc = label, nodes, proc
        self.control = control  # stop through stdin lines (ssh) rather than local signals

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """SIGTERM: checkpoint and stop; SIGKILL: stop now."""
        if self.control and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("kill\n" if sig == signal.SIGKILL else "term\n")
                self.proc.stdin.flush()
                return
            except (BrokenPipeError, OSError, ValueError):
                sig = signal.SIGKILL  # the connection is gone: only the local end is left to stop
        self._killpg(sig)

    def close_stdin(self) -> None:
        """Close the pipe to an ssh agent: it tells the node nothing is coming (a line left unsent when
        ssh had already exited, e.g. a host that refused the connection, is dropped)."""
        if self.proc.stdin is None:
            return
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the close still releases the pipe; its flush found the reader gone

    def abandon(self) -> None:
        """Kill the local end (an ssh client whose node stopped answering)."""
        self._killpg(signal.SIGKILL)

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def _popen(
    argv: list[str], env: dict[str, str], cwd: str | None = None, stdin: int = subprocess.DEVNULL
) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        bufsize=1,
    )


class Launcher(ABC):
    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster

    @abstractmethod
    def start(self, nodes: list[Node], argv_for: ArgvFor, env: dict[str, str]) -> list[Agent]:
        """Start the command on every node; `env` is added to each node's environment."""

    def node_threads(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a node that is another machine: the thread count the controller computed from its own
        CPUs (OMP_NUM_THREADS) is left to the node unless `cluster.threads_per_proc` fixed it."""
        if self.cluster.threads_per_proc is not None or "OMP_NUM_THREADS" not in env:
            return env
        return {**env, **NODE_THREADS}


class LocalLauncher(Launcher):
    def start(self, nodes: list[Node], argv_for: ArgvFor, env: dict[str, str]) -> list[Agent]:
        return [
            Agent(n.name, [n], _popen(argv_for(n), {**os.environ, **self.cluster.env, **n.env, **env}, cwd=n.workdir))
            for n in nodes
        ]


class SshLauncher(Launcher):
    def command(self, node: Node) -> list[str]:
        python = self.cluster.python or sys.executable
        remote = f"cd {shlex.quote(node.workdir)} && exec {shlex.quote(python)} -m launch.node.agent"
        return ["ssh", "-T", "-o", "BatchMode=yes", *self.cluster.ssh_args, node.name, remote]

    def remote_env(self, node: Node, env: dict[str, str]) -> dict[str, str]:
        return {**forwarded_env(os.environ), **self.cluster.env, **node.env, **self.node_threads(env)}

    def start(self, nodes: list[Node], argv_for: ArgvFor, env: dict[str, str]) -> list[Agent]:
        agents = []
        for n in nodes:
            proc = _popen(self.command(n), dict(os.environ), stdin=subprocess.PIPE)
            agent = Agent(n.name, [n], proc, control=True)
            try:
                proc.stdin.write(json.dumps({"argv": argv_for(n), "env": self.remote_env(n, env)}) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # ssh already failed (host unreachable): its exit status and output tell
            agents.append(agent)
        return agents


class SlurmLauncher(Launcher):
    def command(self, nodes: list[Node], environ: Mapping[str, str] | None = None) -> list[str]:
        n = len(nodes)
        env = os.environ if environ is None else environ
        given = self.cluster.srun_args
        # Since Slurm 22.05 a step does not inherit the job's --cpus-per-task: ask for the node's CPUs,
        # or the agent and all its ranks share one.
        cpus = env.get("SLURM_CPUS_ON_NODE")
        asks_cpus = any(a == "-c" or a.startswith("--cpus-per-task") for a in given)
        return [
            "srun",
            f"--nodes={n}",
            f"--ntasks={n}",
            "--ntasks-per-node=1",
            *([f"--cpus-per-task={cpus}"] if cpus and not asks_cpus else []),
            "--overlap",  # the standby's step starts while the running job's step holds the CPUs and GPUs
            "--kill-on-bad-exit=1",
            "--label",
            *given,
        ]

    def start(self, nodes: list[Node], argv_for: ArgvFor, env: dict[str, str]) -> list[Agent]:
        argv = self.command(nodes) + argv_for(None)
        environ = {**os.environ, **self.cluster.env, **self.node_threads(env)}
        return [Agent("srun", list(nodes), _popen(argv, environ))]


LAUNCHER_TYPES: dict[str, type[Launcher]] = {"local": LocalLauncher, "ssh": SshLauncher, "slurm": SlurmLauncher}


def make_launcher(cluster: ClusterConfig) -> Launcher:
    return LAUNCHER_TYPES[cluster.launcher](cluster)
