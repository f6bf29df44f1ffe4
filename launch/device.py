"""One resolved device per rank: the backend, the device, the process group and what is measured on it.

`cluster.backend: auto` means NCCL on CUDA when this node has GPUs, gloo on the CPU otherwise. With
NCCL each rank takes GPU `LOCAL_RANK` (the node must have at least `procs_per_node` of them), sets it
as the current device and joins the group with `device_id`, asynchronous error handling and a long
first timeout that `shorten_timeouts` cuts once the first step is through. Everything else in the
worker asks this module for its device: no device literal lives anywhere else.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cona_cli.config import ClusterConfig


class DeviceError(RuntimeError):
    """The node cannot run the configured backend (one line, naming the config key)."""


@dataclass(frozen=True)
class Placement:
    backend: str  # "nccl" or "gloo"
    device: torch.device


def resolve(backend: str, procs_per_node: int, local_rank: int, cuda_count: int) -> Placement:
    """The backend and device of local rank `local_rank` for `cluster.backend` on a node with `cuda_count` GPUs."""
    if backend == "gloo" or (backend == "auto" and cuda_count == 0):
        return Placement("gloo", torch.device("cpu"))
    if cuda_count < procs_per_node:
        raise DeviceError(
            f"cluster.procs_per_node: {procs_per_node} ranks per node but this node has {cuda_count} GPU(s)"
            + (" (cluster.backend nccl needs one GPU per rank)" if backend == "nccl" else "")
        )
    return Placement("nccl", torch.device("cuda", local_rank))


def placement(cluster: ClusterConfig) -> Placement:
    """This rank's backend and device (from LOCAL_RANK and the node's GPUs)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve(cluster.backend, cluster.procs_per_node, local_rank, cuda_count)


def init_distributed(cluster: ClusterConfig) -> torch.device:
    """Join the job's process group on this rank's device (unless joined already); returns the device."""
    if dist.is_initialized():
        return group_device()
    place = placement(cluster)
    timeout = timedelta(seconds=cluster.startup_timeout_s)
    if place.backend == "nccl":
        # A failed collective aborts the communicators and ends the rank instead of hanging it.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(place.device)
        dist.init_process_group("nccl", device_id=place.device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return place.device


def group_device() -> torch.device:
    """The device of this rank in the initialised default group (CUDA's current device under NCCL)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shorten_timeouts(seconds: float, groups: list[dist.ProcessGroup]) -> None:
    """After the first step (communicators built, shapes inferred): the steady-state collective timeout."""
    for group in [None, *groups]:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> list[float]:
    """[peak allocated, peak reserved] bytes since the rank started on CUDA; [peak RSS, 0] on the CPU."""
    if device.type == "cuda":
        return [float(torch.cuda.max_memory_allocated(device)), float(torch.cuda.max_memory_reserved(device))]
    return [float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), 0.0]  # Linux: KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak (CUDA only: a process's peak resident set cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator failing to allocate."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)
    )
