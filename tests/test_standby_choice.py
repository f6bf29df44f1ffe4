"""`cluster.standby`: on by default, true or false."""

from __future__ import annotations

import pytest

from cona_core.config import ClusterConfig, ConfigError, config_from_dict
from tests.support import TINY


def test_standby_is_on_by_default_and_takes_true_or_false() -> None:
    assert ClusterConfig().standby is True
    assert config_from_dict({**TINY, "cluster": {"procs_per_node": 4, "standby": False}}).cluster.standby is False
    with pytest.raises(ConfigError, match="cluster.standby: must be true or false"):
        config_from_dict({**TINY, "cluster": {"procs_per_node": 4, "standby": "auto"}})
