"""`cluster.standby` (default on) and where the next launch may start before the old job has exited."""

from __future__ import annotations

import pytest

from cona_cli.config import ClusterConfig, ConfigError, config_from_dict
from cona_cli.control.standby import may_use_gpus
from tests.support import TINY


def test_gpu_ranks_must_free_their_devices_before_the_next_launch() -> None:
    assert may_use_gpus(ClusterConfig(backend="nccl")) and not may_use_gpus(ClusterConfig(backend="gloo"))
    assert may_use_gpus(ClusterConfig(launcher="slurm"))  # remote nodes' devices are not visible here


def test_standby_is_on_by_default_and_takes_true_or_false() -> None:
    assert ClusterConfig().standby is True
    assert config_from_dict({**TINY, "cluster": {"procs_per_node": 4, "standby": False}}).cluster.standby is False
    with pytest.raises(ConfigError, match="cluster.standby: must be true or false"):
        config_from_dict({**TINY, "cluster": {"procs_per_node": 4, "standby": "auto"}})
