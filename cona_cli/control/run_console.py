"""What a run prints while it trains: on a terminal a progress bar, elsewhere (a Slurm job's output file,
`--log-format plain`) a plain status line every `every_s` seconds; in both, one line per decision to
switch, switch, checkpoint and restart, as they happen (a failure that ends the run is the recovery's
own one line).

The status: step, training loss, last validation perplexity, tokens per second, MFU (the model's FLOPs
per sample, forward and backward, times samples per second over the hardware profile's peak of every
rank: `search.hardware`), the strategy, and the time the stop rule leaves at the running speed.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cona_core.config import Config
from cona_core.strategy import Strategy

LOG_FORMATS = ("auto", "rich", "plain")


def _strategy(fields: dict[str, Any] | None) -> str:
    return str(Strategy.from_mapping(fields)) if fields else "?"


def event_line(event: dict[str, Any]) -> str | None:
    """The one line an event gets on the console (None: not shown)."""
    kind, step = event.get("kind"), event.get("step")
    if kind == "decision" and event.get("switch"):
        return (
            f"decide  step {step}: {_strategy(event.get('current'))} -> {_strategy(event.get('candidate'))} "
            f"(Φ ratio {event.get('ratio', float('nan')):.3f}, switch cost {event.get('switch_cost_s', 0.0):.1f} s)"
        )
    if kind == "profile_mismatch":
        ratio = event.get("ratio", float("nan"))
        return (
            f"warning step {step}: {_strategy(event.get('strategy'))} runs at {ratio:.3g}× the step time that "
            f"search.hardware {event.get('hardware')!r} can be fitted to: its predictions of the strategies not "
            "yet run are wrong; set search.hardware to a profile of this hardware"
        )
    if kind == "switch":
        how = "in place" if event.get("in_place") else "relaunch"
        return (
            f"switch  step {step}: {_strategy(event.get('from'))} -> {_strategy(event.get('to'))} "
            f"({how}, {event.get('seconds', 0.0):.2f} s)"
        )
    if kind == "checkpoint":
        return f"ckpt    step {step}: {event.get('reason')} checkpoint saved in {event.get('seconds', 0.0):.2f} s"
    if kind == "launch" and event.get("reason") in ("restart", "resume", "out_of_memory"):
        return f"launch  {event.get('launch')}: {event.get('reason')} from step {step}"
    return None


class RunConsole:
    """The console of one `cona train`: feed it every step row (`step`) and every event (`event`)."""

    def __init__(self, console: Console, cfg: Config, fmt: str = "auto", every_s: float = 10.0) -> None:
        self.console, self.cfg, self.every_s = console, cfg, every_s
        self.plain = fmt == "plain" or (fmt == "auto" and not console.is_terminal)
        self.flops_per_sample, self.peak = _mfu_terms(cfg)
        self.last_eval: dict[str, Any] = {}
        self._printed = -float("inf")
        self._progress: Progress | None = None

    def __enter__(self) -> RunConsole:
        if not self.plain:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.__enter__()
            self._progress.add_task("step", total=self.cfg.train.max_steps, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def event(self, event: dict[str, Any]) -> None:
        line = event_line(event)
        if line is not None:
            self.console.print(f"cona: {line}", markup=False, highlight=False)

    def eval(self, row: dict[str, Any]) -> None:
        self.last_eval = row

    def step(self, row: dict[str, Any], strategy: Strategy) -> None:
        info = self.status(row, strategy)
        if self._progress is not None:
            self._progress.update(
                self._progress.task_ids[0], completed=row["step"], description=f"step {row['step']}", info=info
            )
        elif time.monotonic() - self._printed >= self.every_s:
            self._printed = time.monotonic()
            self.console.print(f"cona: step {row['step']}  {info}", markup=False, highlight=False)

    def status(self, row: dict[str, Any], strategy: Strategy) -> str:
        """The status fields of a step row."""
        parts = [f"loss {row['loss']:.3f}"]
        if self.last_eval:
            parts.append(f"val ppl {self.last_eval['val_ppl']:.1f}")
        iter_s = float(row["iter_s"])
        parts.append(f"{row.get('tokens_per_s', 0.0):,.0f} tok/s")
        if self.peak:
            parts.append(f"MFU {100 * strategy.gbs / iter_s * self.flops_per_sample / self.peak:.1f}%")
        parts.append(str(strategy))
        left = self.time_left(row, iter_s)
        if left is not None:
            parts.append(f"{left:,.0f} s left")
        return "  ".join(parts)

    def time_left(self, row: dict[str, Any], iter_s: float) -> float | None:
        """Seconds the stop rules leave at the running speed (None: only a target perplexity stops it)."""
        t = self.cfg.train
        left = []
        if t.max_time is not None:
            left.append(t.max_time - float(row["time"]))
        if t.max_steps is not None:
            left.append((t.max_steps - row["step"]) * iter_s)
        if t.max_tokens is not None:
            samples = t.max_tokens / self.cfg.model.seq_len - row["consumed_samples"]
            left.append(samples / row["gbs"] * iter_s)
        return max(min(left), 0.0) if left else None


def _mfu_terms(cfg: Config) -> tuple[float, float]:
    """The model's training FLOPs per sample and the peak FLOP/s of all ranks (0 if unknown)."""
    from cona_cli.planner.hardware import load_hardware
    from cona_cli.planner.memory import compute_precision
    from cona_cli.planner.workload import Workload

    shape = Workload.from_config(cfg).shape
    flops = 3 * (shape.n_layers * shape.layer_fwd_flops(1) + shape.head_fwd_flops(1))
    try:
        hw = load_hardware(cfg.search.hardware)
    except ValueError:
        return float(flops), 0.0
    per_rank = hw.device_flops(compute_precision(cfg.search.precision, hw), cfg.cluster.procs_per_node)
    return float(flops), per_rank * cfg.cluster.world
