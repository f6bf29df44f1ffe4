"""The nodes of a run and the torchrun command line each node's agent runs.

A single-node `local` run keeps torchrun's `--standalone`. Otherwise every launch starts one torchrun
agent per node; they meet in a c10d rendezvous (a fresh id, and by default a free port on the head
node, per launch) whose store the head node's agent hosts. The head node is this machine, where the
controller runs: the first of `cluster.nodes` for `ssh`, the first host of the allocation for
`slurm` (an sbatch script runs there), loopback for `local`.

The rendezvous id is on every node's command line, where `ps` shows it to anyone: it is a digest of the
launch's name under a key random to this controller, unique per launch and the same on every node
(every command line is built here), and it tells nothing of the name, which may hold a secret.

`local` nodes share this machine, and its GPUs: with a GPU backend every rank needs its own GPU
(nodes x procs_per_node of them, else a one-line refusal before anything starts), and each local node
sees only its own slice through CUDA_VISIBLE_DEVICES (its ranks take cuda:LOCAL_RANK, which would
otherwise be the same GPUs on every node: NCCL's "Duplicate GPU detected").
"""

from __future__ import annotations

import glob
import hmac
import os
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cona_cli.cluster.slurm import SlurmError, allocation_hosts
from cona_core.config import ClusterConfig, ConfigError

DEFAULT_RDZV_PORT = 29400  # torchrun's default, for an explicit endpoint host without a port
_RDZV_KEY = secrets.token_bytes(16)  # this controller's key of rendezvous ids


class ClusterError(ValueError):
    """The cluster cannot run this job (unreachable node, storage not shared); one line."""


@dataclass(frozen=True)
class Node:
    index: int
    name: str  # how logs and events name it: the ssh destination, the Slurm host, or nodeN (local)
    addr: str  # the address other nodes reach it at
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "."


def resolve_nodes(cluster: ClusterConfig, environ: Mapping[str, str] | None = None) -> list[Node]:
    """The nodes a launch runs on, in node order (node 0 is the head)."""
    workdir = cluster.workdir or os.getcwd()
    if cluster.launcher == "ssh":
        return [Node(i, h.host, h.addr, dict(h.env), h.workdir or workdir) for i, h in enumerate(cluster.hosts)]
    if cluster.launcher == "slurm":
        hosts = allocation_hosts(environ)
        if len(hosts) != cluster.nodes:
            raise SlurmError(
                f"the allocation has {len(hosts)} nodes ({', '.join(hosts)}) but cluster.nodes is {cluster.nodes}"
            )
        return [Node(i, h, h, {}, workdir) for i, h in enumerate(hosts)]
    addr = cluster.head_addr or "127.0.0.1"
    envs = local_device_envs(cluster, visible_gpus())
    return [Node(i, f"node{i}", addr, envs[i], workdir) for i in range(cluster.nodes)]


def gpu_device_nodes() -> bool:
    """Whether this machine has a GPU device node (NVIDIA's /dev/nvidiaN, ROCm's /dev/kfd): without one no
    CUDA or HIP runtime sees a GPU."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def visible_gpus() -> list[str]:
    """This machine's GPUs as this process sees them: CUDA_VISIBLE_DEVICES entries (numbers or UUIDs), else
    0..n-1 (torch counts them through NVML, without creating a CUDA context)."""
    if not gpu_device_nodes():  # torch's import costs the controller's start seconds
        return []
    import torch  # only here: the rest of the controller's start does not need it

    count = torch.cuda.device_count()
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in given.split(",") if d.strip()][:count]


def local_device_envs(cluster: ClusterConfig, gpus: list[str]) -> list[dict[str, str]]:
    """Each local node's extra environment: its own GPUs under a GPU backend. Raises ConfigError (one line)
    when this machine cannot give every rank a GPU."""
    c = cluster
    none: list[dict[str, str]] = [{} for _ in range(c.nodes)]
    if c.backend == "gloo" or (c.backend == "auto" and not gpus):
        return none
    if not gpus:
        raise ConfigError(
            "cluster.backend: nccl but this machine has no GPU (torch.cuda.device_count() is 0: a CPU-only "
            "torch, no driver, or CUDA_VISIBLE_DEVICES hides them); use backend gloo or auto"
        )
    need = c.nodes * c.procs_per_node
    if len(gpus) < need:
        what = (
            f"cluster.nodes: {c.nodes} local nodes x {c.procs_per_node} procs_per_node = {need} ranks"
            if c.nodes > 1
            else f"cluster.procs_per_node: {need} ranks"
        )
        raise ConfigError(f"{what} need one GPU each but this machine has {len(gpus)} (cluster.backend {c.backend})")
    if c.nodes == 1:
        return none
    p = c.procs_per_node
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * p : (i + 1) * p])} for i in range(c.nodes)]


def is_multi_node(cluster: ClusterConfig) -> bool:
    """Whether launches use a c10d rendezvous (anything but one local node)."""
    return cluster.nodes > 1 or cluster.launcher != "local"


def head_address(cluster: ClusterConfig, nodes: list[Node]) -> str:
    """This machine's address as the workers reach it (telemetry, default rendezvous host)."""
    if cluster.head_addr:
        return cluster.head_addr
    return "127.0.0.1" if cluster.launcher == "local" else nodes[0].addr


def free_port(host: str) -> int:
    """A port free on `host` now (an address of this machine)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    endpoint: str  # host:port of the c10d store
    run_id: str
    host_node: int | None  # the node whose agent hosts the store (None: torchrun decides by hostname)


def rendezvous(cluster: ClusterConfig, nodes: list[Node], launch_name: str) -> Rendezvous:
    """The rendezvous of the launch named `launch_name` (unique to it): `cluster.rdzv_endpoint`, else the
    head node and a free port; its id is `rendezvous_id(launch_name)`."""
    if cluster.rdzv_endpoint:
        host, sep, port = cluster.rdzv_endpoint.rpartition(":")
        if not sep or not port.isdigit():
            host, port = cluster.rdzv_endpoint, str(DEFAULT_RDZV_PORT)
    else:
        host = head_address(cluster, nodes)
        try:
            port = str(free_port(host))
        except OSError as e:
            raise ClusterError(f"cluster.head_addr: {host} is not an address of this machine ({e.strerror})") from None
    # Under slurm one srun command line serves every node: torchrun matches the host name itself.
    hosting = [] if cluster.launcher == "slurm" else [n.index for n in nodes if n.addr == host]
    return Rendezvous(f"{host}:{port}", rendezvous_id(launch_name), hosting[0] if hosting else None)


def rendezvous_id(launch_name: str) -> str:
    """`cona-` and 16 hex digits of an HMAC of `launch_name` under this controller's random key."""
    return "cona-" + hmac.new(_RDZV_KEY, launch_name.encode(), "sha256").hexdigest()[:16]


def may_use_gpus(cluster: ClusterConfig) -> bool:
    """Whether the ranks may hold GPUs: NCCL, or `auto` where this machine has NVIDIA devices or the nodes
    are other machines (their devices are not visible from here)."""
    if cluster.backend != "auto":
        return cluster.backend == "nccl"
    return cluster.launcher != "local" or any(Path("/dev").glob("nvidia[0-9]*"))


def torchrun_args(cluster: ClusterConfig, node: Node | None, rdzv: Rendezvous | None) -> list[str]:
    """`python -m launch.forkrun ...` (torchrun's flags; ranks forked from one import) for one node
    (`node` None: the same line for all nodes)."""
    args = [
        cluster.python or sys.executable,
        "-m",
        "launch.forkrun",
        "--tee",
        "3",
        f"--nproc-per-node={cluster.procs_per_node}",
    ]
    if rdzv is None:
        return args + ["--standalone"]
    args += [
        f"--nnodes={cluster.nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv.endpoint}",
        f"--rdzv-id={rdzv.run_id}",
        "--max-restarts=0",
    ]
    if node is not None:
        args.append(f"--local-addr={node.addr}")
        if rdzv.host_node is not None:
            args.append(f"--rdzv-conf=is_host={int(node.index == rdzv.host_node)}")
    return args
