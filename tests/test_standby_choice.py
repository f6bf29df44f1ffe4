"""`cluster.standby: auto` pre-warms only where the ranks leave cores free for it."""

from __future__ import annotations

import pytest

from cona_cli.config import ClusterConfig, ConfigError, config_from_dict
from cona_cli.control import standby
from cona_cli.control.standby import may_use_gpus, standby_wanted
from tests.support import TINY


def test_auto_needs_spare_cores_on_this_machine_and_assumes_them_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    assert may_use_gpus(ClusterConfig(backend="nccl")) and not may_use_gpus(ClusterConfig(backend="gloo"))
    assert may_use_gpus(ClusterConfig(launcher="slurm"))  # remote nodes' devices are not visible here
    monkeypatch.setattr(standby, "may_use_gpus", lambda cluster: cluster.backend == "nccl")  # a CPU-only host
    local = ClusterConfig(procs_per_node=4)
    assert standby_wanted(local, cores=2) is False  # 4 CPU ranks on 2 cores: a standby's imports cost training
    assert standby_wanted(local, cores=16) is True
    assert standby_wanted(ClusterConfig(procs_per_node=4, backend="nccl"), cores=2) is True
    assert standby_wanted(ClusterConfig(procs_per_node=4, launcher="slurm"), cores=2) is True
    assert standby_wanted(ClusterConfig(procs_per_node=4, standby=True), cores=2) is True
    assert standby_wanted(ClusterConfig(procs_per_node=4, standby=False), cores=64) is False


def test_standby_takes_true_false_or_auto() -> None:
    with pytest.raises(ConfigError, match="cluster.standby: must be true, false or auto"):
        config_from_dict({**TINY, "cluster": {"procs_per_node": 4, "standby": "sometimes"}})
