"""`train.tensorboard: true`: the run's metrics as TensorBoard event files under `RUN_DIR/tensorboard/`.

The controller sees every step and eval row the workers stream and writes every event, so one writer
in the controller covers all launches of a run (a `--resume` adds a new event file to the folder).
Uses the `tensorboard` package's numpy-only writer, imported only when the key is on. The tags of a row
or an event (`row_scalars`, `event_scalars`) are every metric sink's (`cona_cli.control.metric_sinks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cona_core.config import ConfigError

# metrics.jsonl field -> TensorBoard tag, by row kind
STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "iter_s": "train/iter_s",
    "grad_norm": "train/grad_norm",
    "gns": "gns/gns",
    "grad_sq": "gns/grad_sq",
    "trace": "gns/trace",
    "dp": "strategy/dp",
    "tp": "strategy/tp",
    "pp": "strategy/pp",
    "mbs": "strategy/mbs",
    "gbs": "strategy/gbs",
}
EVAL_TAGS = {"val_loss": "eval/val_loss", "val_ppl": "eval/val_ppl"}
EVENT_KINDS = ("decision", "switch")  # events.jsonl kinds whose numbers become `<kind>/<field>` at their step
_NOT_VALUES = ("step", "time", "wall_clock")
MISSING = "train.{key}: needs the {key} package (pip install 'cona[{key}]')"  # a sink's package not installed


def _scalars(pairs: Iterable[tuple[str, Any]]) -> dict[str, float]:
    # None (no estimate yet) and text are skipped; a bool counts as 0/1
    return {tag: float(value) for tag, value in pairs if isinstance(value, (int, float))}


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """A step or eval row of metrics.jsonl as {tag: value} (at the row's `step`)."""
    tags = {"step": STEP_TAGS, "eval": EVAL_TAGS}.get(row.get("kind"), {})
    return _scalars((tag, row.get(field)) for field, tag in tags.items())


def event_scalars(event: dict[str, Any]) -> dict[str, float]:
    """An events.jsonl event as {tag: value}: a decision's Φ values, ratio, GNS and times; a switch's cost
    (empty for other kinds, and for events without a step)."""
    if event.get("kind") not in EVENT_KINDS or "step" not in event:
        return {}
    return _scalars((f"{event['kind']}/{k}", v) for k, v in event.items() if k not in _NOT_VALUES)


class TensorBoardLog:
    """One event-file writer for the run folder's `tensorboard/` (scalars at the step they belong to)."""

    def __init__(self, path: Path) -> None:
        try:
            from tensorboard.summary import Writer
        except ImportError:
            raise ConfigError(MISSING.format(key="tensorboard")) from None
        path.mkdir(parents=True, exist_ok=True)
        self.writer = Writer(str(path))

    def _write(self, scalars: dict[str, float], row: dict[str, Any]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, int(row["step"]), wall_time=row.get("wall_clock"))

    def metric(self, row: dict[str, Any]) -> None:
        """A step or eval row of metrics.jsonl."""
        self._write(row_scalars(row), row)

    def event(self, event: dict[str, Any]) -> None:
        """An events.jsonl event (`event_scalars`)."""
        self._write(event_scalars(event), event)

    def close(self) -> None:
        self.writer.close()
