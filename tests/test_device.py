"""One resolved device per rank (CUDA faked present or absent), and out-of-memory / NCCL failures
classified from real torch error text."""

from __future__ import annotations

import pytest
import torch

from cona_cli.control.failures import parse_failure
from cona_core.config import ConfigError, config_from_dict
from cona_core.strategy import Strategy
from launch import device
from launch.worker import out_of_memory_line
from tests.support import TINY


def _cluster(**kw: object):
    return config_from_dict({**TINY, "cluster": {**TINY["cluster"], **kw}}, "t").cluster


def test_auto_is_gloo_on_the_cpu_and_nccl_on_gpus() -> None:
    assert device.resolve("auto", 4, 2, cuda_count=0) == device.Placement("gloo", torch.device("cpu"))
    assert device.resolve("auto", 4, 2, cuda_count=8) == device.Placement("nccl", torch.device("cuda", 2))
    assert device.resolve("gloo", 4, 2, cuda_count=8).backend == "gloo"
    with pytest.raises(device.DeviceError, match="cluster.procs_per_node: 4 ranks per node but this node has 2"):
        device.resolve("auto", 4, 0, cuda_count=2)
    with pytest.raises(device.DeviceError, match="cluster.backend nccl needs one GPU per rank"):
        device.resolve("nccl", 1, 0, cuda_count=0)


@pytest.mark.parametrize("gpus", [0, 4])
def test_init_distributed_sets_the_device_and_timeout(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(device.dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    got = device.init_distributed(_cluster(startup_timeout_s=1234))
    assert calls["timeout"].total_seconds() == 1234
    if gpus:
        assert got == torch.device("cuda", 3) == calls["set_device"] == calls["device_id"]
        assert calls["backend"] == "nccl"
        import os

        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    else:
        assert got == torch.device("cpu") and calls["backend"] == "gloo" and "device_id" not in calls


def test_a_rank_that_joined_already_is_not_joined_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby's CPU ranks join their process group while they wait; the launch then reuses it."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("init_process_group called twice")

    monkeypatch.setattr(device.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(device.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(device.dist, "init_process_group", refuse)
    assert device.init_distributed(_cluster()) == torch.device("cpu")


def test_fp16_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="^search.precision: fp16 needs loss scaling"):
        config_from_dict({**TINY, "search": {"precision": "fp16"}}, "t")


def _torchrun_log(rank_lines: list[str], exit_code: int) -> str:
    own = "\n".join(f"[default1]:{line}" for line in rank_lines)
    return (
        f"{own}\nRoot Cause (first observed failure):\n[0]:\n  time      : now\n  host      : h\n"
        f"  rank      : 1 (local_rank: 1)\n  exitcode  : {exit_code} (pid: 9)\n"
    )


def test_a_real_cpu_out_of_memory_is_classified_with_its_peak() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte: the CPU allocator's own error
    assert device.is_out_of_memory(caught.value)
    assert not device.is_out_of_memory(RuntimeError("shape mismatch"))
    line = out_of_memory_line(1, Strategy(2, 1, 2, 1, 16), 123456789, caught.value)
    failure = parse_failure(_torchrun_log(["Traceback ...", line], 4), 1)
    assert failure.out_of_memory and failure.peak_bytes == 123456789 and not failure.knock_on
    assert failure.strategy == "dp2-tp1-pp2-mbs1-gbs16"  # the one it ran (an in-place resize changes it)
    assert "ran out of memory" in failure.describe()
    # torch's text alone (a rank that died before the worker could say more) is enough
    text = f"RuntimeError: {str(caught.value).splitlines()[0]}"
    assert parse_failure(_torchrun_log([text], 1), 1).out_of_memory


def test_cuda_and_nccl_error_text() -> None:
    # c10/cuda/CUDACachingAllocator.cpp's message; torch.OutOfMemoryError is what CUDA raises
    cuda = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
        "of 79.15 GiB of which 2.31 MiB is free."
    )
    assert parse_failure(_torchrun_log([cuda], 1), 1).out_of_memory
    assert device.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    # what the surviving ranks print when a peer died (ProcessGroupNCCL / NCCLUtils): not blamed
    for peer in (
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=600000) ran for 600003 milliseconds before timing out.",
        "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5",
    ):
        failure = parse_failure(_torchrun_log([peer], 1), 1)
        assert failure.knock_on and not failure.out_of_memory, peer
