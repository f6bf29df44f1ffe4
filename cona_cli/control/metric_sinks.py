"""Where the controller sends a run's numbers besides metrics.jsonl and events.jsonl: TensorBoard
(`train.tensorboard`) and Weights & Biases (`train.wandb`). Each is a `MetricSink`; the controller feeds
one `MetricSinks`, which passes every step and eval row and every event to all of them."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Protocol

from cona_cli.control.tensorboard_log import MISSING, TensorBoardLog
from cona_cli.control.wandb_log import WandbLog
from cona_core.config import Config, ConfigError, TrainConfig
from cona_core.rundir import RunDir


class MetricSink(Protocol):
    def metric(self, row: dict[str, Any]) -> None:
        """A step or eval row of metrics.jsonl, as the workers stream it."""

    def event(self, event: dict[str, Any]) -> None:
        """An event as events.jsonl gets it."""

    def close(self) -> None: ...


@dataclass
class MetricSinks:
    """The sinks a run's config asks for (none: every call does nothing)."""

    sinks: list[MetricSink] = field(default_factory=list)

    def metric(self, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.metric(row)

    def event(self, event: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.event(event)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def sink_packages(train: TrainConfig) -> list[str]:
    """The config keys of `train` that turn a sink on, each named as its package (and cona's extra)."""
    return [key for key, on in (("tensorboard", train.tensorboard), ("wandb", train.wandb is not None)) if on]


def check_installed(train: TrainConfig) -> None:
    """Before launch: ConfigError naming the key and the extra to install when a sink's package is missing."""
    for key in sink_packages(train):
        if importlib.util.find_spec(key) is None:
            raise ConfigError(MISSING.format(key=key))


def open_sinks(cfg: Config, files: RunDir) -> MetricSinks:
    """The run's sinks, opened (a W&B run started or continued)."""
    opened: list[MetricSink] = []
    if cfg.train.tensorboard:
        opened.append(TensorBoardLog(files.tensorboard))
    if cfg.train.wandb is not None:
        opened.append(WandbLog(cfg.train.wandb, files, cfg.to_raw()))
    return MetricSinks(opened)
