"""`train.tensorboard: true`: the run's metrics as TensorBoard event files under `RUN_DIR/tensorboard/`.

The controller sees every step and eval row the workers stream and writes every event, so one writer
in the controller covers all launches of a run (a `--resume` adds a new event file to the folder).
Uses the `tensorboard` package's numpy-only writer, imported only when the key is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cona_cli.config import ConfigError

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


class TensorBoardLog:
    """One event-file writer for the run folder's `tensorboard/` (scalars at the step they belong to)."""

    def __init__(self, path: Path) -> None:
        try:
            from tensorboard.summary import Writer
        except ImportError:
            raise ConfigError("train.tensorboard: needs the tensorboard package (pip install tensorboard)") from None
        path.mkdir(parents=True, exist_ok=True)
        self.writer = Writer(str(path))

    def _add(self, tag: str, value: Any, row: dict[str, Any]) -> None:
        if isinstance(value, (int, float)):  # None (no estimate yet) is skipped; a bool counts as 0/1
            self.writer.add_scalar(tag, float(value), int(row["step"]), wall_time=row.get("wall_clock"))

    def metric(self, row: dict[str, Any]) -> None:
        """A step or eval row of metrics.jsonl."""
        tags = {"step": STEP_TAGS, "eval": EVAL_TAGS}.get(row.get("kind"), {})
        for field, tag in tags.items():
            self._add(tag, row.get(field), row)

    def event(self, event: dict[str, Any]) -> None:
        """An events.jsonl event: a decision's Φ values, ratio, GNS and times; a switch's cost."""
        if event.get("kind") in EVENT_KINDS and "step" in event:
            for field, value in event.items():
                if field not in _NOT_VALUES:
                    self._add(f"{event['kind']}/{field}", value, event)

    def close(self) -> None:
        self.writer.close()
