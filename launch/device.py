"""One resolved device per rank: the backend, the device, the process group and what is measured on it.

`cluster.backend: auto` means NCCL on CUDA when this node has GPUs, gloo on the CPU otherwise. With
NCCL each rank takes GPU `LOCAL_RANK` (the node must have at least `procs_per_node` of them), sets it
as the current device and joins the group with `device_id`, asynchronous error handling and a long
first timeout that `shorten_timeouts` cuts once the first step is through. Everything else in the
worker asks this module for its device: no device literal lives anywhere else.

`auto` never falls back to the CPU silently when the run says it wants GPUs (a GPU hardware profile, or
an sbatch/srun request for GPUs): an sbatch script without a GPU request, a CPU-only wheel or a driver
mismatch then fail in one line instead of training on CPU cores.

Peak memory: on CUDA the caching allocator's peaks, reset by `reset_peak_memory` (after the first step
and after each in-place resize). On the CPU the figure is the process's peak resident set since it
started (`getrusage` ru_maxrss: interpreter, libraries, start-up and checkpoint loading included); Linux
offers no way to reset it, so it never goes down after a resize to a smaller batch.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from cona_core.config import ClusterConfig, Config, ConfigError, read_yaml

# Out of memory as each library words it (cona_cli/control/failures.py reads the same texts from a log):
# torch's caching allocator ("CUDA out of memory. Tried to allocate ..."), a CUDA runtime call through
# C10_CUDA_CHECK ("CUDA error: out of memory", cudaErrorMemoryAllocation), NCCL's buffers at communicator
# init or the first P2P send (its last error "Cuda failure 2 'out of memory'", older NCCL "Cuda failure
# 'out of memory'", or "Failed to CUDA calloc 536870912 bytes"), cuBLAS/cuDNN handle and workspace
# creation ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), the driver
# API's name (CUDA_ERROR_OUT_OF_MEMORY), and the CPU allocator.
OUT_OF_MEMORY_TEXT = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|Cuda failure (?:\d+ )?'out of memory'|Failed to CUDA calloc"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"
    r"|DefaultCPUAllocator: can't allocate memory"
)


class DeviceError(RuntimeError):
    """The node cannot run the configured backend (one line, naming the config key)."""


@dataclass(frozen=True)
class Placement:
    backend: str  # "nccl" or "gloo"
    device: torch.device


_GPU_REQUEST = re.compile(r"^(?:--gpus(?:-per-\w+)?=[^0]|--gres=(?:\S*,)?gpu|-G ?[1-9])")


def gpus_wanted(cfg: Config) -> str | None:
    """Why this run means to train on GPUs (a GPU hardware profile, or a GPU request in the launcher's
    options), or None: what `backend: auto` must not quietly replace by CPU cores."""
    c = cfg.cluster
    for field, options in (("cluster.srun_args", c.srun_args), ("cluster.sbatch_options", c.sbatch_options)):
        asked = next((o for o in options if _GPU_REQUEST.match(o)), None)
        if asked is not None:
            return f"{field} asks for GPUs ({asked})"
    hardware = cfg.search.hardware
    if hardware == "cpu-local":
        return None
    if Path(hardware).suffix in (".yaml", ".yml"):  # a profile of one's own: a CPU one gives cores_per_node
        try:
            raw = read_yaml(Path(hardware))
        except (ConfigError, OSError):
            return None  # the controller validated it; unreadable here says nothing about devices
        if isinstance(raw, dict) and raw.get("cores_per_node"):
            return None
    return f"search.hardware {hardware} is a GPU profile"


def resolve(
    backend: str, procs_per_node: int, local_rank: int, cuda_count: int, gpus_wanted: str | None = None
) -> Placement:
    """The backend and device of local rank `local_rank` for `cluster.backend` on a node with `cuda_count` GPUs
    (`gpus_wanted`: why the run expects GPUs, if it does; `auto` then refuses to fall back to the CPU)."""
    if backend == "auto" and cuda_count == 0 and gpus_wanted is not None:
        raise DeviceError(
            f"cluster.backend: auto found no GPU on this node (torch.cuda.device_count() is 0: no GPU in the "
            f"allocation, a CPU-only torch or a driver mismatch) but {gpus_wanted}; "
            "to train on CPUs set search.hardware: cpu-local"
        )
    if backend == "gloo" or (backend == "auto" and cuda_count == 0):
        return Placement("gloo", torch.device("cpu"))
    if cuda_count < procs_per_node:
        raise DeviceError(
            f"cluster.procs_per_node: {procs_per_node} ranks per node but this node has {cuda_count} GPU(s)"
            + (" (cluster.backend nccl needs one GPU per rank)" if backend == "nccl" else "")
        )
    return Placement("nccl", torch.device("cuda", local_rank))


def placement(cluster: ClusterConfig, gpus_wanted: str | None = None) -> Placement:
    """This rank's backend and device (from LOCAL_RANK and the node's GPUs)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve(cluster.backend, cluster.procs_per_node, local_rank, cuda_count, gpus_wanted)


def init_distributed(cluster: ClusterConfig, gpus_wanted: str | None = None) -> torch.device:
    """Join the job's process group on this rank's device (unless joined already); returns the device.
    Rank 0 prints the placement once (backend, device count, this node's devices)."""
    if dist.is_initialized():
        return group_device()
    place = placement(cluster, gpus_wanted)
    timeout = timedelta(seconds=cluster.startup_timeout_s)
    if os.environ.get("RANK", "0") == "0":
        print(placement_line(place), flush=True)
    if place.backend == "nccl":
        # A failed collective aborts the communicators and ends the rank instead of hanging it.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(place.device)
        enable_tf32()
        dist.init_process_group("nccl", device_id=place.device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return place.device


def enable_tf32() -> None:
    """fp32 matmuls and convolutions on tensor cores (TF32, 10-bit mantissa): on H100 an fp32 GEMM is
    otherwise ~1/8-1/15 of TF32's speed. Called for CUDA ranks only: the CPU's fp32 numerics stay exact
    (`set_float32_matmul_precision("high")` would also let CPU matmuls use bf16 passes)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def placement_line(place: Placement) -> str:
    """What rank 0 says about where the job runs."""
    if place.backend == "nccl":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = f"{torch.cuda.device_count()} visible" + (f", CUDA_VISIBLE_DEVICES={visible}" if visible else "")
        return f"cona-worker: placement: backend nccl, one GPU per rank (cuda:LOCAL_RANK; {names})"
    return f"cona-worker: placement: backend gloo, CPU ranks ({torch.cuda.device_count()} GPU(s) visible)"


def threads_per_rank() -> int:
    """Intra-op threads of this rank: OMP_NUM_THREADS as the controller computed it, or, where it left the
    count to the node (CONA_THREADS_PER_PROC=node: ssh and srun nodes), this node's CPUs (those this
    process may run on) shared by its LOCAL_WORLD_SIZE ranks."""
    if os.environ.get("CONA_THREADS_PER_PROC") == "node":
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return max(1, len(os.sched_getaffinity(0)) // max(1, ranks))
    return int(os.environ.get("OMP_NUM_THREADS", "1"))


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


def headroom_bytes(device: torch.device, margin: float) -> float:
    """What this rank could still add at its peak and keep `margin` of its memory free: on CUDA the
    device's total less the allocator's peak reservation and what lives outside the allocator (context,
    NCCL buffers); on the CPU this rank's share of the node's RAM (ranks split it evenly) less its peak
    resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = total - free - torch.cuda.memory_reserved(device)
        return (1 - margin) * total - torch.cuda.max_memory_reserved(device) - outside
    share = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return (1 - margin) * share - resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak (CUDA only: a process's peak resident set cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def is_out_of_memory(e: BaseException | None) -> bool:
    """An out-of-memory error: torch's caching allocator, a CUDA runtime call, NCCL's or cuBLAS's own
    allocations (raised as DistBackendError or RuntimeError, recognised by their text), the CPU allocator;
    also one inside a DCP CheckpointException or as the cause of another exception."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError):
            return True
        if isinstance(e, CheckpointException):
            return any(is_out_of_memory(exc) for exc, _ in e.failures.values())
        if isinstance(e, RuntimeError) and OUT_OF_MEMORY_TEXT.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False
