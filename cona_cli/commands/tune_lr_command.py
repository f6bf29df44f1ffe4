"""`cona tune-lr`: the base learning rate the surrogate assumes, found by a sweep at the base batch.

Φ and the adascale recipe take `train.lr` to be the best LR for `train.lr_base_gbs` (the ladder's lowest
rung by default) and derive every other batch's LR and efficiency from it. Where it is below that best
one, larger batches gain from their higher LR more than Φ counts, and a chain that follows Φ stays at
small batches too long (docs/benchmarks.md, the LR attribution). This command trains the base batch
once per LR of a grid, each a real `cona train` run under `policy: static` at the planner's fastest
strategy for that batch, with the config's own schedule, to a token budget, and prints the validation
loss each reached and the LR to put in the config: the one with the lowest.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from cona_cli.commands.errors import fail
from cona_cli.control.run_setup import resolve_config
from cona_cli.overrides import parse_sets
from cona_cli.planner.space import gbs_ladder
from cona_cli.report.runlog import NotARunError, read_run
from cona_core.config import Config, ConfigError

GRID = (0.5, 1.0, 2.0, 4.0)  # multiples of the config's lr swept by default


@dataclass(frozen=True)
class Trial:
    lr: float
    val_loss: float | None  # the last evaluation's; None if the run failed or diverged
    samples: int | None
    seconds: float | None


def parse_lrs(text: str) -> list[float]:
    """`"1e-3,2e-3"` -> [0.001, 0.002]; ConfigError for anything but two or more distinct positive numbers."""
    try:
        lrs = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--lrs {text}: expected comma-separated numbers, e.g. 5e-4,1e-3,2e-3") from None
    if len(lrs) < 2 or any(not (x > 0 and math.isfinite(x)) for x in lrs):
        raise ConfigError(f"--lrs {text}: give at least two distinct positive learning rates")
    return lrs


def sweep_sets(cfg: Config, lr: float, tokens: int) -> dict[str, object]:
    """The overrides of one trial: the base batch under `policy: static`, stopped by the token budget only."""
    base = cfg.train.lr_base_gbs or gbs_ladder(cfg)[0]
    return {
        "policy": "static",
        "strategy": "auto",
        "chain": None,
        "search.gbs_static": base,
        "train.lr": lr,
        "train.lr_base_gbs": base,
        "train.max_tokens": tokens,
        "train.max_time": None,
        "train.max_steps": None,
        "train.target_ppl": None,
    }


def run_trial(config: Path, lr: float, sets: dict[str, object], run_dir: Path, verbose: bool) -> Trial:
    """Train one trial (`sets` its overrides, `lr` among them) with `cona train` in a child process and
    read what it reached."""
    args = [f"{k}={'null' if v is None else v}" for k, v in sets.items()]
    cmd = [sys.executable, "-m", "cona_cli", "train", str(config), "--run-dir", str(run_dir)]
    cmd += [a for kv in args for a in ("--set", kv)]
    out = None if verbose else subprocess.DEVNULL
    rc = subprocess.run(cmd, stdout=out, check=False).returncode
    try:
        evals = read_run(run_dir).evals
    except NotARunError:
        evals = ()
    last = evals[-1] if evals else None
    if rc != 0 or last is None or last.val_loss is None or not math.isfinite(last.val_loss):
        return Trial(lr, None, None, None)
    return Trial(lr, last.val_loss, last.consumed_samples, last.time)


def best_trial(trials: list[Trial]) -> Trial | None:
    done = [t for t in trials if t.val_loss is not None]
    return min(done, key=lambda t: t.val_loss) if done else None  # type: ignore[arg-type, return-value]


def tune_lr_command(
    config: Path = typer.Argument(..., help="YAML config to tune train.lr for."),
    lrs: str | None = typer.Option(
        None, "--lrs", help="Comma-separated learning rates (default: 0.5x, 1x, 2x and 4x the config's train.lr)."
    ),
    tokens: int | None = typer.Option(
        None, "--tokens", min=1, help="Tokens per trial (default: train.decay_tokens, else train.max_tokens)."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Folder of the trials' run folders (default runs/tune-lr-<config>)."
    ),
    data: Path | None = typer.Option(None, "--data", help="Replaces data.path."),
    sets: list[str] | None = typer.Option(
        None, "--set", metavar="SECTION.KEY=VALUE", help="Override one config value."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream each trial's output."),
) -> None:
    """Sweep the learning rate at the base batch and print the one to put in the config."""
    try:
        given = parse_sets(sets)
        for key in ("train.lr", "train.max_tokens"):
            if key in given:
                raise ConfigError(f"--set {key}: the sweep sets it (use --lrs and --tokens)")
        cfg = resolve_config(config, None, None, None, data, given)
        grid = parse_lrs(lrs) if lrs is not None else [cfg.train.lr * m for m in GRID]
        budget = tokens or cfg.train.decay_tokens or cfg.train.max_tokens
        if budget is None:
            raise ConfigError(f"--tokens: {config} has neither train.decay_tokens nor train.max_tokens; give --tokens")
        folder = out or Path("runs") / f"tune-lr-{config.stem}"
        for lr in grid:
            if (folder / f"lr-{lr:g}").exists():
                raise ConfigError(f"--out: {folder / f'lr-{lr:g}'} exists; choose a new --out")
        trial_sets = [{**given, **sweep_sets(cfg, lr, budget)} for lr in grid]
        for s in trial_sets:  # every trial's config is valid before the first one trains
            resolve_config(config, None, None, None, data, s)
    except ConfigError as e:
        raise fail("cona tune-lr", str(e)) from None
    base = trial_sets[0]["train.lr_base_gbs"]
    typer.echo(f"cona tune-lr: {len(grid)} trials at gbs {base}, {budget} tokens each, into {folder}")
    trials = []
    for lr, s in zip(grid, trial_sets):
        trial = run_trial(
            config, lr, {**({"data.path": str(data)} if data else {}), **s}, folder / f"lr-{lr:g}", verbose
        )
        trials.append(trial)
        reached = "failed or diverged" if trial.val_loss is None else f"val loss {trial.val_loss:.4f}"
        typer.echo(f"  lr {lr:g}: {reached}")
    best = best_trial(trials)
    typer.echo("")
    typer.echo("| lr | val loss | val ppl | samples | seconds |")
    typer.echo("|---|---|---|---|---|")
    for t in trials:
        mark = " (best)" if t is best else ""
        if t.val_loss is None:
            typer.echo(f"| {t.lr:g}{mark} | failed or diverged | - | - | - |")
        else:
            typer.echo(
                f"| {t.lr:g}{mark} | {t.val_loss:.4f} | {math.exp(t.val_loss):.4g} | {t.samples} | {t.seconds:.0f} |"
            )
    if best is None:
        raise fail("cona tune-lr", f"every trial failed; see the run folders under {folder}", code=1)
    if best.lr in (grid[0], grid[-1]):
        typer.echo(f"the best LR is at the edge of the grid: extend --lrs beyond {best.lr:g} to be sure of it")
    typer.echo(f"train.lr: {best.lr:g}  # best of {len(grid)} at gbs {base} (put this in {config})")
