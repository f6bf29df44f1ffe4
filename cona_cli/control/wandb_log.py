"""`train.wandb: {project, name, mode}`: the run's metrics in a Weights & Biases run, TensorBoard's tags.

The controller feeds it what it feeds TensorBoard (`cona_cli.control.metric_sinks`): every step and eval
row, every decision and switch event. Each row is one `log` call carrying its `step`, the x axis of every
tag (`define_metric`), so the steps a recovery repeats are kept, as TensorBoard keeps them, rather than
dropped by W&B as out of order. The resolved config is the W&B run's config; the W&B run id is kept in the
run folder, so `cona train --resume` continues the same W&B run. W&B writes its files under $WANDB_DIR,
else the run folder (`wandb/`). The `wandb` package is imported only when the key is set.
"""

from __future__ import annotations

import os
from typing import Any

from cona_cli.control.tensorboard_log import MISSING, event_scalars, row_scalars
from cona_core.config import ConfigError
from cona_core.rundir import RunDir

STEP = "step"  # the x axis of every tag


class WandbLog:
    """One W&B run for the run folder, continued by a `--resume`."""

    def __init__(self, options: dict[str, str], files: RunDir, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(MISSING.format(key="wandb")) from None
        saved = files.wandb_run_id.read_text().strip() if files.wandb_run_id.is_file() else None
        try:
            self.run = wandb.init(
                project=options.get("project"),
                name=options.get("name", files.path.name),
                mode=options.get("mode"),
                id=saved,
                resume="allow" if saved else None,
                dir=None if os.environ.get("WANDB_DIR") else str(files.path),
                config=config,
                settings=wandb.Settings(console="off", quiet=True),  # the controller's console stays its own
            )
        except Exception as e:  # no API key for online mode, a W&B server that cannot be reached, ...
            lines = str(e).strip().splitlines()
            raise ConfigError(f"train.wandb: W&B did not start ({lines[0] if lines else type(e).__name__})") from None
        files.wandb_run_id.write_text(self.run.id)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def _log(self, scalars: dict[str, float], row: dict[str, Any]) -> None:
        if scalars:
            self.run.log({STEP: int(row["step"]), **scalars})

    def metric(self, row: dict[str, Any]) -> None:
        """A step or eval row of metrics.jsonl."""
        self._log(row_scalars(row), row)

    def event(self, event: dict[str, Any]) -> None:
        """An events.jsonl event (`event_scalars`)."""
        self._log(event_scalars(event), event)

    def close(self) -> None:
        """Finish the run, and end this process's W&B service: only then is its log surely flushed."""
        import wandb

        self.run.finish()
        wandb.teardown()
