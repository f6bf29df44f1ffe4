"""The GPU paths a CPU can check (issue 27): out of memory that is not the caching allocator's, an OOM
while loading a checkpoint, local nodes sharing one machine's GPUs, refusing to run instead of
relaunching, environment forwarding to ssh nodes, peak-memory resets, and gpu_checks' exit status."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

from cona_cli.cluster import nodes as nodes_module
from cona_cli.cluster.launchers import NODE_THREADS, LocalLauncher, SlurmLauncher, SshLauncher
from cona_cli.cluster.nodes import Node, local_device_envs, resolve_nodes
from cona_cli.control.failures import parse_failure
from cona_cli.control.jobs import threads_per_proc
from cona_core.config import ConfigError, config_from_dict
from cona_core.exits import BAD_CHECKPOINT_EXIT, OUT_OF_MEMORY_EXIT, REFUSED_EXIT
from cona_core.strategy import Strategy
from launch import checkpoint, device
from tests.support import REPO, TINY, write_config

# -- 1. out of memory outside torch's caching allocator ------------------------------------------

# As torch 2.13 raises them: C10D_NCCL_CHECK (NCCLUtils.hpp) builds "NCCL error in: FILE:LINE, <ncclGetErrorString>,
# NCCL version V" + getNcclErrorDetailStr, whose "Last error" is NCCL's last WARN: CUCHECK's "Cuda failure %d '%s'"
# (cuMemCreate, NCCL >= 2.19's default allocator), CUDACHECK's "Cuda failure '%s'", or alloc.h's "Failed to CUDA
# calloc %ld bytes"; TORCH_CUDABLAS_CHECK (ATen/cuda/Exceptions.h) words cuBLAS handle creation; C10_CUDA_CHECK
# words cudaErrorMemoryAllocation with cudaGetErrorString.
_NCCL = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\n"
)
NCCL_OUT_OF_MEMORY = [
    _NCCL + "Cuda failure 2 'out of memory'",
    _NCCL + "Cuda failure 'out of memory'",
    _NCCL + "Failed to CUDA calloc 536870912 bytes",
    _NCCL + "Failed to CUDA calloc async 4 bytes",
]
CUBLAS_OUT_OF_MEMORY = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDA_RUNTIME_OUT_OF_MEMORY = (
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
NOT_OUT_OF_MEMORY = [
    _NCCL + "Cuda failure 401 'the operation cannot be performed in the present state'",  # NVLS without privilege
    "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version "
    "2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, lda)`",
    "CUDA error: an illegal memory access was encountered",
]


def _torchrun_log(rank_lines: list[str], exit_code: int) -> str:
    own = "\n".join(f"[default1]:{line}" for line in rank_lines)
    return (
        f"{own}\nRoot Cause (first observed failure):\n[0]:\n  time      : now\n  host      : h\n"
        f"  rank      : 1 (local_rank: 1)\n  exitcode  : {exit_code} (pid: 9)\n"
    )


def _traceback(kind: str, text: str) -> list[str]:
    head, *rest = text.splitlines()
    return [
        "Traceback (most recent call last):",
        '  File "launch/worker.py", line 530, in run',
        f"{kind}: {head}",
        *rest,
    ]


@pytest.mark.parametrize(
    "kind,text",
    [("torch.distributed.DistBackendError", t) for t in NCCL_OUT_OF_MEMORY]
    + [("RuntimeError", CUBLAS_OUT_OF_MEMORY), ("torch.AcceleratorError", CUDA_RUNTIME_OUT_OF_MEMORY)],
)
def test_nccl_cublas_and_cuda_runtime_out_of_memory_is_out_of_memory_on_both_sides(kind: str, text: str) -> None:
    error = {"RuntimeError": RuntimeError, "torch.AcceleratorError": torch.AcceleratorError}.get(
        kind, dist.DistBackendError
    )(text)
    assert not isinstance(error, torch.OutOfMemoryError)
    assert device.is_out_of_memory(error)
    wrapped = RuntimeError("pipeline send failed")
    wrapped.__cause__ = error
    assert device.is_out_of_memory(wrapped)  # re-raised by a caller: the cause still says it
    failure = parse_failure(_torchrun_log(_traceback(kind, text), 1), 1)  # a rank that died before saying more
    assert failure.out_of_memory and failure.refusal is None
    assert "ran out of memory" in failure.describe()


@pytest.mark.parametrize("text", NOT_OUT_OF_MEMORY)
def test_other_cuda_and_nccl_failures_are_not_out_of_memory(text: str) -> None:
    assert not device.is_out_of_memory(dist.DistBackendError(text))
    assert not parse_failure(_torchrun_log(_traceback("torch.distributed.DistBackendError", text), 1), 1).out_of_memory


def test_an_nccl_out_of_memory_ends_the_rank_with_the_out_of_memory_exit_and_its_peak(tmp_path: Path) -> None:
    """A real rank (gloo, world 1) raising NCCL's DistBackendError inside the worker's guard."""
    script = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from cona_core.strategy import Strategy
        from launch.device import init_distributed
        from launch.worker import exit_on_out_of_memory
        from cona_core.config import ClusterConfig
        device = init_distributed(ClusterConfig(backend="gloo", procs_per_node=1))
        with exit_on_out_of_memory(lambda: Strategy(1, 1, 1, 2, 8), device):
            raise dist.DistBackendError({NCCL_OUT_OF_MEMORY[0]!r})
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == OUT_OF_MEMORY_EXIT, proc.stderr[-2000:]
    failure = parse_failure(_torchrun_log(proc.stderr.splitlines(), OUT_OF_MEMORY_EXIT), 1)
    assert failure.out_of_memory and failure.strategy == "dp1-tp1-pp1-mbs2-gbs8" and failure.peak_bytes > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 2. out of memory while loading a checkpoint -----------------------------------------------------


@pytest.fixture
def one_rank(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def test_out_of_memory_while_loading_is_out_of_memory_and_the_checkpoint_stays(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model_and_optimizer()
    path, _, _ = checkpoint.save(
        tmp_path / "ckpt", 5, model, opt, {"trainer": {"step": 5, "consumed_samples": 40}}, keep=2
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def no_memory(*_: object, **__: object) -> None:  # what a CUDA read into the model's tensors raises
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(filesystem.FileSystemReader, "read_data", no_memory)
    fresh, fresh_opt = _model_and_optimizer()
    with pytest.raises(torch.OutOfMemoryError, match="rank 0 ran out of memory loading") as caught:
        checkpoint.load(path, fresh, fresh_opt)
    assert not isinstance(caught.value, checkpoint.CheckpointError) and device.is_out_of_memory(caught.value)
    # what the controller then reads: out of memory, not a bad checkpoint (no quarantine), and the folder is usable
    failure = parse_failure(_torchrun_log(["cona-worker rank 0: out of memory under dp1: peak 9 bytes"], 4), 1)
    assert failure.out_of_memory and not failure.bad_checkpoint
    monkeypatch.undo()
    assert checkpoint.load(path, fresh, fresh_opt)["trainer"]["step"] == 5
    assert all(torch.equal(v, weights[k]) for k, v in fresh.state_dict().items())

    def garbled(*_: object, **__: object) -> None:
        raise ValueError("truncated shard")

    monkeypatch.setattr(filesystem.FileSystemReader, "read_data", garbled)  # a real read error still is one
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot load \(ValueError: truncated shard\)"):
        checkpoint.load(path, fresh, fresh_opt)
    assert parse_failure(_torchrun_log(["bad checkpoint"], BAD_CHECKPOINT_EXIT), 1).bad_checkpoint


# -- 3. local nodes on one GPU machine -----------------------------------------------------------------


def _cluster(**kw: object):
    doc = {k: v for k, v in TINY.items() if k != "strategy"}  # any world size
    return config_from_dict({**doc, "cluster": {**TINY["cluster"], **kw}}, "t").cluster


def test_local_nodes_get_their_own_gpus_or_a_one_line_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    two = _cluster(nodes=2, procs_per_node=2, backend="nccl")
    assert local_device_envs(two, ["0", "1", "2", "3"]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    with pytest.raises(ConfigError, match=r"^cluster.nodes: 2 local nodes x 2 procs_per_node = 4 ranks need one GPU"):
        local_device_envs(two, ["0", "1", "2"])
    with pytest.raises(ConfigError, match=r"^cluster.procs_per_node: 4 ranks need one GPU each but this machine has 2"):
        local_device_envs(_cluster(procs_per_node=4, backend="auto"), ["0", "1"])
    with pytest.raises(ConfigError, match=r"^cluster.backend: nccl but this machine has no GPU"):
        local_device_envs(_cluster(backend="nccl"), [])
    assert local_device_envs(_cluster(nodes=2, procs_per_node=2), []) == [{}, {}]  # auto on CPUs: gloo
    assert local_device_envs(_cluster(nodes=2, procs_per_node=2, backend="gloo"), ["0"]) == [{}, {}]
    # through resolve_nodes, with this machine's GPUs faked (and a CUDA_VISIBLE_DEVICES of the user's)
    monkeypatch.setattr(nodes_module, "gpu_device_nodes", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e")
    nodes = resolve_nodes(_cluster(nodes=2, procs_per_node=2))
    assert [n.env for n in nodes] == [{"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, {"CUDA_VISIBLE_DEVICES": "GPU-c,GPU-d"}]
    # ... and what each local node's process sees
    agents = LocalLauncher(_cluster(nodes=2, procs_per_node=2)).start(
        nodes, lambda n: [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"], {}
    )
    assert [a.proc.communicate(timeout=60)[0].strip() for a in agents] == ["GPU-a,GPU-b", "GPU-c,GPU-d"]


@pytest.mark.skipif(nodes_module.gpu_device_nodes(), reason="this machine has a GPU device node")
def test_the_controller_prepares_a_run_and_its_nodes_without_importing_torch_where_no_gpu_exists(
    tmp_path: Path,
) -> None:
    """`cona train`'s own process (the corpus, the run folder, the local nodes' devices) on a machine
    without GPUs: torch's import would add seconds to every start and resume."""
    cfg = write_config(tmp_path / "c.yaml", TINY)
    code = f"""if True:
        import sys
        from pathlib import Path
        from cona_cli.cluster.nodes import resolve_nodes
        from cona_cli.run_config import load_config
        from cona_cli.control.run_setup import prepare_run_dir
        cfg = load_config({str(cfg)!r})
        prepare_run_dir(Path({str(tmp_path / "run")!r}), Path({str(cfg)!r}), cfg)
        print(len(resolve_nodes(cfg.cluster)), "torch" in sys.modules)
    """
    env = {**os.environ, "CONA_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "False"]
    assert (tmp_path / "run" / "corpus.json").is_file()


def test_backend_nccl_without_gpus_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cona_cli.app import app

    assert torch.cuda.device_count() == 0  # this box
    doc = copy.deepcopy(TINY)
    doc["cluster"] = {"procs_per_node": 4, "backend": "nccl"}
    cfg = write_config(tmp_path / "c.yaml", doc)
    result = CliRunner().invoke(app, ["train", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cona: cluster.backend: nccl but this machine has no GPU"), lines
    assert not (tmp_path / "run" / "launches").exists()


# -- 4. auto must not quietly train on CPUs; a refusal ends the run -------------------------------------


def _cfg(**sections: dict):
    doc = copy.deepcopy(TINY)
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    return config_from_dict(doc, "t")


def test_gpu_profiles_and_gpu_requests_mean_gpus(tmp_path: Path) -> None:
    assert device.gpus_wanted(_cfg()) is None  # cpu-local
    assert device.gpus_wanted(_cfg(search={"hardware": "a6000-2x8"})) == "search.hardware a6000-2x8 is a GPU profile"
    slurm = _cfg(cluster={"launcher": "slurm", "sbatch_options": ["--time=1:00:00", "--gpus-per-node=8"]})
    assert device.gpus_wanted(slurm) == "cluster.sbatch_options asks for GPUs (--gpus-per-node=8)"
    assert "cluster.srun_args" in device.gpus_wanted(_cfg(cluster={"launcher": "slurm", "srun_args": ["--gres=gpu:4"]}))
    cpu_profile = tmp_path / "box.yaml"
    cpu_profile.write_text((REPO / "cona_cli" / "planner" / "profiles" / "cpu-local.yaml").read_text())
    assert device.gpus_wanted(_cfg(search={"hardware": str(cpu_profile)})) is None


def test_auto_without_gpus_refuses_when_the_run_wants_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "search.hardware h100-80gb-8 is a GPU profile"
    with pytest.raises(device.DeviceError, match=r"^cluster.backend: auto found no GPU on this node .* but search"):
        device.resolve("auto", 4, 0, cuda_count=0, gpus_wanted=why)
    assert device.resolve("auto", 4, 0, cuda_count=0).backend == "gloo"  # a CPU run stays one
    assert device.resolve("auto", 4, 1, cuda_count=4, gpus_wanted=why) == device.Placement(
        "nccl", torch.device("cuda", 1)
    )
    # CUDA faked absent, as on a node of an sbatch job without a GPU request
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(device.DeviceError, match="search.hardware h100-80gb-8 is a GPU profile"):
        device.init_distributed(_cluster(), why)


def test_rank_0_logs_the_placement_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(device.dist, "init_process_group", lambda backend, **kw: None)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        device.init_distributed(_cluster(procs_per_node=4))
    out = capsys.readouterr().out.splitlines()
    assert out == ["cona-worker: placement: backend nccl, one GPU per rank (cuda:LOCAL_RANK; 4 visible)"]


def test_a_workers_refusal_is_final_and_other_exit_codes_are_not() -> None:
    line = "cona-worker: cluster.procs_per_node: 4 ranks per node but this node has 0 GPU(s)"
    failure = parse_failure(_torchrun_log(["cona-worker: placement: backend gloo, CPU ranks", line], REFUSED_EXIT), 1)
    assert failure.refusal == "cluster.procs_per_node: 4 ranks per node but this node has 0 GPU(s)"
    assert parse_failure(_torchrun_log([line], 1), 1).refusal is None  # an exception: relaunch as before
    assert parse_failure(_torchrun_log(["Killed"], -9), 1).refusal is None


@pytest.mark.e2e
def test_auto_on_a_gpu_profile_without_gpus_ends_the_run_at_once_with_one_line(tmp_path: Path) -> None:
    doc = copy.deepcopy(TINY)
    doc["cluster"] = {"procs_per_node": 2}
    doc["strategy"] = "dp2-tp1-pp1-mbs2-gbs8"
    doc["search"] = {"hardware": "a6000-2x8"}
    cfg = write_config(tmp_path / "c.yaml", doc)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "cona_cli", "train", str(cfg), "--run-dir", str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == REFUSED_EXIT, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert err[0].startswith("cona: cluster.backend: auto found no GPU on this node"), err
    assert "search.hardware a6000-2x8 is a GPU profile" in err[0] and "giving up" not in proc.stderr
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events].count("launch") == 1
    assert events[-1]["kind"] == "exit" and events[-1]["code"] == REFUSED_EXIT and events[-1]["reason"] == "refused"


# -- 5. what ssh nodes get -----------------------------------------------------------------------------


def test_ssh_nodes_get_nccl_cuda_torch_and_the_allow_list_and_count_their_own_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line the ssh launcher writes to a (fake) ssh's stdin: the command and the node's environment."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(tmp_path / 'sent')!r}, 'w').write(sys.stdin.readline())\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    shell = {
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "GLOO_SOCKET_IFNAME": "eth1",
        "FI_PROVIDER": "efa",
        "MALLOC_TRIM_THRESHOLD_": "0",
        "CONA_CACHE": "/shared/cache",
    }
    for k, v in shell.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MY_SECRET_TOKEN", "not for the nodes")
    c = _cluster(nodes=["10.0.0.1", "10.0.0.2"], procs_per_node=2, env={"NCCL_IB_HCA": "mlx5_2"})
    node = Node(0, "10.0.0.1", "10.0.0.1", {}, "/work")
    [agent] = SshLauncher(c).start([node], lambda n: ["python", "-m", "launch.forkrun"], {"OMP_NUM_THREADS": "8"})
    agent.proc.wait(timeout=60)
    sent = json.loads((tmp_path / "sent").read_text())
    assert sent["argv"] == ["python", "-m", "launch.forkrun"]
    env = sent["env"]
    assert {k: env[k] for k in shell} == {**shell, "NCCL_IB_HCA": "mlx5_2"}  # cluster.env wins
    assert "MY_SECRET_TOKEN" not in env and "PATH" not in env and "HOME" not in env
    assert {k: env[k] for k in NODE_THREADS} == {"CONA_THREADS_PER_PROC": "node", "OMP_NUM_THREADS": "1"}
    fixed = _cluster(nodes=["10.0.0.1"], procs_per_node=2, threads_per_proc=3)
    assert SshLauncher(fixed).remote_env(node, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    assert "CONA_THREADS_PER_PROC" not in SshLauncher(fixed).remote_env(node, {"OMP_NUM_THREADS": "3"})
    assert SlurmLauncher(c).node_threads({"OMP_NUM_THREADS": "8"})["CONA_THREADS_PER_PROC"] == "node"


def test_a_node_divides_its_own_cpus_among_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert device.threads_per_rank() == 1  # the controller's count (a local node: the same machine)
    monkeypatch.setenv("CONA_THREADS_PER_PROC", "node")
    assert device.threads_per_rank() == cpus
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cpus))
    assert device.threads_per_rank() == 1


def test_the_controller_keeps_a_users_omp_num_threads_as_torchrun_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cluster.threads_per_proc` first, then an OMP_NUM_THREADS the user set, then the CPUs this process
    may run on shared by the ranks of the machine."""
    cpus = len(os.sched_getaffinity(0))
    one = {**TINY, "strategy": "dp1-tp1-pp1-mbs2-gbs4"}
    cfg = config_from_dict({**one, "cluster": {"procs_per_node": 1}}, "tiny")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_proc(cfg) == 3
    fixed = config_from_dict({**one, "cluster": {"procs_per_node": 1, "threads_per_proc": 5}}, "tiny")
    assert threads_per_proc(fixed) == 5
    for unset in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert threads_per_proc(cfg) == cpus
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_proc(cfg) == cpus
    nodes = config_from_dict({**TINY, "strategy": "auto", "cluster": {"procs_per_node": 1, "nodes": 2 * cpus}}, "t")
    assert threads_per_proc(nodes) == 1  # local nodes share this machine


# -- 6. peak memory resets -----------------------------------------------------------------------------


def test_reset_peak_memory_resets_cuda_peaks_and_leaves_the_cpu_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(d))
    device.reset_peak_memory(torch.device("cpu"))
    assert calls == []
    device.reset_peak_memory(torch.device("cuda", 1))
    assert calls == ["empty_cache", torch.device("cuda", 1)]


def test_the_worker_resets_peaks_after_its_first_step_and_after_a_resize(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launch import worker as worker_module
    from launch.data.corpus import prepare_corpus

    doc = {**copy.deepcopy(TINY), "cluster": {"procs_per_node": 1}, "strategy": "dp1-tp1-pp1-mbs2-gbs4"}
    doc["train"] = {**doc["train"], "eval_interval": None, "gns": False}
    cfg = config_from_dict(doc, "t")
    (tmp_path / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    (tmp_path / "corpus.json").write_text(prepare_corpus(cfg.data, seed=cfg.train.seed).to_json())
    resets: list[int] = []
    w = worker_module.Worker(cfg, tmp_path, Strategy(1, 1, 1, 2, 4), 1, torch.device("cpu"))
    monkeypatch.setattr(worker_module, "reset_peak_memory", lambda d: resets.append(w.state.step))
    w.train(stop_step=3, fresh=False)
    assert resets == [1]  # after the first step only
    w.resize(replace(w.strategy, mbs=2, gbs=8))
    assert resets == [1, 3]
    assert w.metrics is not None
    w.metrics.close()


# -- 7. gpu_checks is a gate -----------------------------------------------------------------------------


@pytest.mark.e2e
def test_gpu_checks_exits_non_zero_when_a_row_fails() -> None:
    def run(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        cmd += [str(REPO / "scripts" / "gpu_checks.py"), "--cpu", "--checks", "reshard", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:  # each waits mostly on its ranks' start
        ok_run, bad_run = pool.submit(run), pool.submit(run, "--fail-check", "-> dp1-tp2")
        ok, bad = ok_run.result(), bad_run.result()
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    rows = [line for line in ok.stdout.splitlines() if line.startswith("DCP reshard")]
    # through every layout of world 2 (its own save each) and back to the first
    assert len(rows) == 3 and all(line.endswith("yes") for line in rows), ok.stdout
    assert bad.returncode != 0, bad.stdout[-2000:]
    rows = [line for line in bad.stdout.splitlines() if line.startswith("DCP reshard")]
    assert [line.endswith("NO") for line in rows] == [True, False, False] and "1 of 3 checks failed" in bad.stdout


@pytest.mark.e2e
def test_gpu_checks_times_the_step_with_and_without_the_noise_scale(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(REPO / "scripts" / "gpu_checks.py"), "--cpu", "--checks", "time", "--out", str(tmp_path / "rows.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]  # timing on a shared CPU may fail
    rows = {r["check"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert set(rows) == {"step time / plain loop", "step with GNS / without"}
    assert rows["step with GNS / without"]["layout"] == "dp2-tp1-pp1-mbs2-gbs8"
    assert all(r["value"] > 0 for r in rows.values()), rows  # figures of this host, not bounds
