"""Multi-node pieces without a cluster: the `cluster` section, Slurm host lists, the torchrun, ssh and
srun command lines, the sbatch script, and which node a failure is blamed on."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.cluster.launchers import Agent, LocalLauncher, SlurmLauncher, SshLauncher
from cona_cli.cluster.nodes import (
    ClusterError,
    Node,
    Rendezvous,
    may_use_gpus,
    rendezvous,
    resolve_nodes,
    torchrun_args,
)
from cona_cli.cluster.sbatch import sbatch_script
from cona_cli.cluster.shared_storage import check_shared
from cona_cli.cluster.slurm import SlurmError, allocation_hosts, expand_nodelist
from cona_cli.control.failures import failed_host, parse_failure
from cona_cli.control.jobs import GLIBC_MALLOC_ENV, allocator_env
from cona_cli.run_config import load_config, resolve_allocation
from cona_core.config import ClusterConfig, ConfigError, config_from_dict
from tests.support import REPO, TINY, write_config


def _cfg(cluster: dict):
    doc = copy.deepcopy(TINY)
    doc["cluster"] = cluster
    doc["strategy"] = "dp4-tp1-pp1-mbs2-gbs16"
    return config_from_dict(resolve_allocation(doc))


def test_nodes_as_host_list_means_ssh_and_round_trips() -> None:
    cfg = _cfg(
        {
            "nodes": [
                "10.0.0.1",
                {"host": "me@10.0.0.2", "env": {"GLOO_SOCKET_IFNAME": "eth1"}, "workdir": "/shared/cona"},
            ],
            "procs_per_node": 2,
        }
    )
    c = cfg.cluster
    assert (c.nodes, c.launcher, c.world) == (2, "ssh", 4)
    assert [h.addr for h in c.hosts] == ["10.0.0.1", "10.0.0.2"]
    again = config_from_dict(json.loads(json.dumps(cfg.to_raw())))
    assert again.cluster == c
    nodes = resolve_nodes(c)
    assert [(n.index, n.name, n.addr) for n in nodes] == [(0, "10.0.0.1", "10.0.0.1"), (1, "me@10.0.0.2", "10.0.0.2")]
    assert nodes[1].env == {"GLOO_SOCKET_IFNAME": "eth1"} and nodes[1].workdir == "/shared/cona"
    assert nodes[0].workdir == os.getcwd()


@pytest.mark.parametrize(
    "cluster, message",
    [
        ({"nodes": "many"}, "cluster.nodes: must be a count, a list of hosts, or slurm"),
        ({"nodes": []}, "cluster.nodes: an empty list"),
        ({"nodes": ["a", "root@a"], "procs_per_node": 2}, "cluster.nodes: a is listed twice"),
        ({"nodes": [{"host": "a", "gpus": 8}, "b"], "procs_per_node": 2}, "cluster.nodes[0].gpus: unknown key"),
        (
            {"nodes": [{"host": "a", "env": {"X": 1}}, "b"], "procs_per_node": 2},
            "cluster.nodes[0].env: must be a mapping",
        ),
        ({"nodes": ["a", "b"], "procs_per_node": 2, "launcher": "local"}, "a list of hosts needs launcher ssh"),
        ({"nodes": 2, "procs_per_node": 2, "launcher": "ssh"}, "launcher ssh needs a list of hosts"),
        ({"nodes": 2, "procs_per_node": 2, "launcher": "mpirun"}, "cluster.launcher: must be one of local, ssh, slurm"),
        ({"nodes": 2, "procs_per_node": 2, "env": {"X": 3}}, "cluster.env: must be a mapping of names to strings"),
        ({"nodes": 2, "procs_per_node": 2, "ssh_args": "-p 22"}, "cluster.ssh_args: must be a list of a string"),
    ],
)
def test_bad_cluster_sections_name_the_key(cluster: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _cfg(cluster)


def test_slurm_nodelists_expand_like_scontrol() -> None:
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_nodelist("node[098-100]-ib,x1") == ["node098-ib", "node099-ib", "node100-ib", "x1"]
    with pytest.raises(SlurmError, match="cannot read node range"):
        expand_nodelist("gpu[a-b]")
    with pytest.raises(SlurmError, match="SLURM_JOB_NODELIST is not set"):
        allocation_hosts({})


def test_nodes_slurm_takes_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    cfg = _cfg({"nodes": "slurm", "procs_per_node": 2})
    assert (cfg.cluster.nodes, cfg.cluster.launcher) == (2, "slurm")
    assert [n.name for n in resolve_nodes(cfg.cluster)] == ["gpu1", "gpu2"]
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-4]")
    with pytest.raises(SlurmError, match=r"the allocation has 4 nodes .* cluster.nodes is 2"):
        resolve_nodes(cfg.cluster)
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    with pytest.raises(ConfigError, match="cluster.nodes: slurm: not inside a Slurm allocation"):
        _cfg({"nodes": "slurm", "procs_per_node": 2})


def test_local_nodes_meet_in_a_c10d_rendezvous_hosted_by_node_0() -> None:
    c = _cfg({"nodes": 2, "procs_per_node": 2}).cluster
    nodes = resolve_nodes(c)
    rdzv = rendezvous(c, nodes, "cona-abc-3")
    host, port = rdzv.endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and rdzv.host_node == 0
    argv = [torchrun_args(c, n, rdzv) for n in nodes]
    for i, a in enumerate(argv):
        assert a[:3] == [sys.executable, "-m", "launch.forkrun"]
        assert {
            "--nnodes=2",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv.endpoint}",
            f"--rdzv-id={rdzv.run_id}",
            "--max-restarts=0",
            "--local-addr=127.0.0.1",
            f"--rdzv-conf=is_host={int(i == 0)}",
        } <= set(a)
        assert "--standalone" not in a
    single = _cfg({"nodes": 1, "procs_per_node": 4}).cluster
    assert "--standalone" in torchrun_args(single, None, None)


def test_explicit_rendezvous_endpoint_is_kept() -> None:
    c = _cfg({"nodes": ["10.0.0.1", "10.0.0.2"], "procs_per_node": 2, "rdzv_endpoint": "10.0.0.2"}).cluster
    rdzv = rendezvous(c, resolve_nodes(c), "r")
    assert rdzv.endpoint == "10.0.0.2:29400" and rdzv.host_node == 1


def test_ssh_command_runs_the_node_agent_and_sends_the_environment_on_stdin() -> None:
    c = _cfg(
        {
            "nodes": ["alice@10.0.0.1", "10.0.0.2"],
            "procs_per_node": 2,
            "ssh_args": ["-p", "2222"],
            "env": {"NCCL_DEBUG": "WARN"},
            "python": "/opt/venv/bin/python",
        }
    ).cluster
    node = Node(0, "alice@10.0.0.1", "10.0.0.1", {"GLOO_SOCKET_IFNAME": "ib0"}, "/shared/my project")
    ssh = SshLauncher(c)
    cmd = ssh.command(node)
    assert cmd[:4] == ["ssh", "-T", "-o", "BatchMode=yes"] and cmd[4:7] == ["-p", "2222", "alice@10.0.0.1"]
    assert shlex.split(cmd[7]) == [
        "cd",
        "/shared/my project",
        "&&",
        "exec",
        "/opt/venv/bin/python",
        "-m",
        "launch.node.agent",
    ]
    env = ssh.remote_env(node, {"CONA_TELEMETRY_TOKEN": "secret"})
    assert env["NCCL_DEBUG"] == "WARN" and env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["CONA_TELEMETRY_TOKEN"] == "secret" and "secret" not in " ".join(cmd)


def test_srun_command_starts_one_agent_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """One task per node with the node's CPUs (a step does not inherit the job's --cpus-per-task), and
    --overlap: the standby's step shares the allocation with the running job's."""
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "64")
    c = _cfg({"nodes": "slurm", "procs_per_node": 2, "srun_args": ["--cpu-bind=none"]}).cluster
    nodes = resolve_nodes(c)
    assert SlurmLauncher(c).command(nodes) == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--label",
        "--cpu-bind=none",
    ]
    own = _cfg({"nodes": "slurm", "procs_per_node": 2, "srun_args": ["-c", "16"]}).cluster
    assert not any(a.startswith("--cpus-per-task") for a in SlurmLauncher(own).command(nodes))  # the user's stands
    assert not any(a.startswith("--cpus") for a in SlurmLauncher(c).command(nodes, environ={}))
    line = torchrun_args(c, None, Rendezvous("gpu1:29500", "r", None))  # one line for every node
    assert "--rdzv-endpoint=gpu1:29500" in line and not any(a.startswith(("--local-addr", "--rdzv-conf")) for a in line)


def test_sbatch_script(tmp_path: Path) -> None:
    doc = copy.deepcopy(TINY)
    doc["cluster"] = {
        "nodes": 2,
        "procs_per_node": 8,
        "launcher": "slurm",
        "backend": "nccl",
        "sbatch_options": ["--time=24:00:00", "--gpus-per-node=8"],
    }
    doc.pop("strategy")
    cfg_path = write_config(tmp_path / "c.yaml", doc)
    script = tmp_path / "job.sh"
    run = tmp_path / "runs" / "r1"
    result = CliRunner().invoke(
        app, ["train", str(cfg_path), "--sbatch", str(script), "--run-dir", str(run), "--max-steps", "50"]
    )
    assert result.exit_code == 0, result.output
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n") and os.access(script, os.X_OK)
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={run}/slurm-%j.out",
        "#SBATCH --time=24:00:00",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
    ):
        assert line in text.splitlines()
    assert run.is_dir()  # Slurm writes its log there from the first second
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    local = config_from_dict({**doc, "cluster": {"nodes": 2, "procs_per_node": 2}})
    with pytest.raises(ConfigError, match="--sbatch: cluster.launcher is local"):
        sbatch_script(local, [], run, tmp_path)


def test_sbatch_script_starts_the_run_then_resumes_it_when_run_again(tmp_path: Path) -> None:
    """The script as Slurm runs it (first submission, then requeued), with the nodes' python replaced by
    one that writes down what it was asked to run."""
    python = tmp_path / "python"
    called = tmp_path / "called"
    python.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {called}\n')
    python.chmod(0o755)
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["cluster"] = {"procs_per_node": 2, "launcher": "slurm", "python": str(python), "requeue_signal_s": 90}
    cfg_path = write_config(tmp_path / "c.yaml", doc)
    script, run = tmp_path / "job.sh", tmp_path / "runs" / "r1"
    args = ["train", str(cfg_path), "--sbatch", str(script), "--run-dir", str(run), "--max-steps", "50"]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert "#SBATCH --signal=B:USR1@90" in script.read_text().splitlines()

    def runs() -> list[str]:
        assert subprocess.run(["bash", str(script)], cwd=tmp_path).returncode == 0
        return called.read_text().splitlines()

    assert runs() == ["-m", "cona_cli", "train", str(cfg_path), "--run-dir", str(run), "--max-steps", "50"]
    (run / "controller_state.json").write_text("{}")  # the controller started: the folder is a run now
    assert runs() == ["-m", "cona_cli", "train", "--resume", str(run)]


def test_python_m_cona_cli_is_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "cona_cli", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout


SRUN_LOG = """\
1: [rank3]: RuntimeError: CUDA error: an illegal memory access was encountered
srun: error: gpu7: task 1: Exited with exit code 1
srun: error: gpu6: task 0: Terminated
"""


def test_failure_blame() -> None:
    agent = Agent("srun", [Node(0, "gpu6", "gpu6"), Node(1, "gpu7", "gpu7")], proc=None)  # type: ignore[arg-type]
    assert failed_host(agent, SRUN_LOG) == "gpu7"
    assert failed_host(Agent("b", [Node(1, "b", "b")], proc=None), "") == "b"  # type: ignore[arg-type]
    root = (
        "Root Cause (first observed failure):\n[0]:\n  time : x\n  host : h\n  rank      : 0 (local_rank: 0)\n"
        "  exitcode  : 1 (pid: 5)\n"
    )
    lost_peer = parse_failure("[default0]:[rank0]: RuntimeError: Read error: Connection reset by peer\n" + root, 1)
    assert lost_peer.knock_on
    own = parse_failure("[default0]:[rank0]: ValueError: loss is nan\n" + root, 1)
    assert not own.knock_on and own.rank == 0
    unreachable = parse_failure("ssh: connect to host 10.0.0.9 port 22: Connection refused\n", 255)
    assert not unreachable.knock_on and unreachable.rank is None
    assert unreachable.describe() == "ssh exited with code 255 (connection failed or lost)"
    assert parse_failure("", -9).describe() == "its agent was killed by signal SIGKILL"


def test_storage_probe_passes_on_shared_storage_and_names_what_is_missing(tmp_path: Path) -> None:
    c = _cfg({"nodes": 2, "procs_per_node": 2, "workdir": str(REPO)}).cluster
    nodes = resolve_nodes(c)
    check_shared(LocalLauncher(c), nodes, tmp_path, timeout_s=10)
    assert list((tmp_path / ".probe").iterdir()) == []  # cleaned up


class AllButTheLast(LocalLauncher):
    """Every node but the last runs the probe (the last never writes its file)."""

    def start(self, nodes, argv_for, env):  # type: ignore[no-untyped-def]
        return super().start(nodes[:-1], argv_for, env)


def test_storage_probe_names_the_file_a_node_cannot_see(tmp_path: Path) -> None:
    c = _cfg({"nodes": 4, "procs_per_node": 1, "workdir": str(REPO)}).cluster
    with pytest.raises(
        ClusterError,
        match=r"node node0 failed the shared-storage check of .*: storage probe: "
        r"node 0 \(.*\) cannot see node_3 in",
    ):
        check_shared(AllButTheLast(c), resolve_nodes(c), tmp_path, timeout_s=1)


def test_shipped_cluster_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssh = load_config(REPO / "configs" / "cluster-ssh-a6000.yaml").cluster
    assert (ssh.launcher, ssh.world, [h.addr for h in ssh.hosts]) == ("ssh", 16, ["gpu-node-01", "gpu-node-02"])
    assert ssh.hosts[1].env == {"NCCL_SOCKET_IFNAME": "ens1f0"}
    local = load_config(REPO / "configs" / "tiny-2node.yaml").cluster
    assert (local.launcher, local.nodes, local.world) == ("local", 2, 4)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app,
        [
            "train",
            str(REPO / "configs" / "cluster-slurm-a6000.yaml"),
            "--sbatch",
            "job.sh",
            "--run-dir",
            "runs/gpt3",
            "--max-steps",
            "1000",
        ],
    )
    assert result.exit_code == 0, result.output
    text = (tmp_path / "job.sh").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text


def test_gpu_ranks_must_free_their_devices_before_the_next_launch() -> None:
    assert may_use_gpus(ClusterConfig(backend="nccl")) and not may_use_gpus(ClusterConfig(backend="gloo"))
    assert may_use_gpus(ClusterConfig(launcher="slurm"))  # remote nodes' devices are not visible here


def test_workers_keep_freed_memory_unless_the_user_set_malloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    cfg = config_from_dict(TINY, "t")
    assert allocator_env(cfg) == GLIBC_MALLOC_ENV
    mine = config_from_dict({**TINY, "cluster": {**TINY["cluster"], "env": {"MALLOC_TRIM_THRESHOLD_": "0"}}}, "t")
    assert allocator_env(mine) == {"MALLOC_MMAP_THRESHOLD_": GLIBC_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator_env(mine) == {}


def test_closing_the_pipe_to_an_ssh_client_that_already_exited_is_quiet() -> None:
    """ssh to a host that refuses the connection exits before the launcher's line is sent; that line
    stays buffered, and closing the pipe used to raise BrokenPipeError, which click turns into a
    silent exit 1 (seen as a flaky unreachable-node test: no one-line error)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, text=True, bufsize=1)
    proc.wait()
    with pytest.raises(BrokenPipeError):
        proc.stdin.write("a line for the agent\n")  # line-buffered: flushed now, into a closed pipe
    agent = Agent("127.0.0.3", [], proc, control=True)
    agent.close_stdin()
    assert proc.stdin.closed
