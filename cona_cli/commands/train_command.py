"""`cona train`: validate everything, prepare the corpus, then hand over to the controller."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from cona_cli.cluster.nodes import ClusterError
from cona_cli.cluster.sbatch import sbatch_script
from cona_cli.cluster.slurm import SlurmError
from cona_cli.commands.dry_run import dry_run_plan
from cona_cli.commands.errors import fail
from cona_cli.control.controller import Controller
from cona_cli.control.preflight import preflight
from cona_cli.control.resume import prepare_resume
from cona_cli.control.run_console import LOG_FORMATS
from cona_cli.control.run_setup import default_run_dir, prepare_run_dir, resolve_config
from cona_cli.control.runstate import lock
from cona_cli.overrides import parse_sets
from cona_core.config import Config, ConfigError

err = Console(stderr=True, soft_wrap=True)


def train_command(
    config: Path | None = typer.Argument(None, help="YAML config (model, data, cluster, train, strategy/chain)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run folder (default runs/<config>-<time>)."),
    strategy: str | None = typer.Option(None, "--strategy", help="Fixed strategy, e.g. dp2-tp1-pp2-mbs2-gbs16."),
    chain: Path | None = typer.Option(None, "--chain", help="YAML chain file to replay."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Stop after this many optimizer steps."),
    data: Path | None = typer.Option(
        None, "--data", help="Replaces data.path: a folder, a file, a glob or a Megatron prefix."
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        help="Continue this run folder from its newest checkpoint, with its own config (CONFIG and flags must agree).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the workers' output."),
    sbatch: Path | None = typer.Option(
        None,
        "--sbatch",
        help="Write a Slurm batch script that runs this "
        "training (launcher slurm) to this file instead of training now.",
    ),
    sets: list[str] | None = typer.Option(
        None, "--set", metavar="SECTION.KEY=VALUE", help="Override one config value (YAML), e.g. train.lr=3e-4."
    ),
    log_format: str = typer.Option(
        "auto",
        "--log-format",
        help="Console: rich (a progress bar), plain (a status line every 10 s, for log files), or auto (rich on a "
        "terminal, else plain). Decisions, switches, checkpoints and restarts get a line in both.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate config, data and feasibility and print the plan; launch nothing."
    ),
) -> None:
    """Train under a fixed strategy or a chain of strategies, switching by checkpoint + relaunch."""
    if strategy is not None and chain is not None:
        raise fail("cona", "--strategy and --chain: give one of them")
    state = None
    if log_format not in LOG_FORMATS:
        raise fail("cona", f"--log-format: must be one of {', '.join(LOG_FORMATS)}")
    try:
        given = parse_sets(sets)
        if given and resume is not None:
            raise ConfigError("--set: not with --resume (a resumed run keeps its own config)")
        if dry_run:
            if config is None or resume is not None or sbatch is not None:
                raise ConfigError("--dry-run: give a CONFIG (and no --resume or --sbatch)")
            cfg = resolve_config(config, strategy, chain, max_steps, data, given)
            dry_run_plan(preflight(cfg, run_dir or default_run_dir(config)))
            return
        if sbatch is not None:
            if config is None or resume is not None:
                raise ConfigError("--sbatch: give a CONFIG, not --resume (the script resumes its run folder itself)")
            write_sbatch(sbatch, config, run_dir, strategy, chain, max_steps, data, sets or [])
            return
        if resume is not None:
            if run_dir is not None and run_dir.resolve() != resume.resolve():
                raise ConfigError(f"--run-dir {run_dir} and --resume {resume}: name one run folder")
            run_dir = resume
            cfg, policy, state = prepare_resume(resume, config, strategy, chain, max_steps, data)
        elif config is None:
            raise ConfigError("CONFIG: missing (give a YAML config, or --resume RUN_DIR)")
        else:
            run_dir = run_dir or default_run_dir(config)
            checked = preflight(resolve_config(config, strategy, chain, max_steps, data, given), run_dir)
            cfg, policy = checked.cfg, checked.policy
            _warn_if_chaining_cannot_pay(cfg)
            prepare_run_dir(run_dir, config, cfg)
            lock(run_dir)
        controller = Controller(cfg, run_dir, policy, console=err, verbose=verbose, resume=state, log_format=log_format)
    except ConfigError as e:
        raise fail("cona", str(e)) from None
    except (ClusterError, SlurmError) as e:
        raise fail("cona", str(e), 1) from None
    raise typer.Exit(controller.run())


def _warn_if_chaining_cannot_pay(cfg: Config) -> None:
    """For `policy: cona`, say at start when no rung can gain over the static pick (it still runs)."""
    if cfg.policy != "cona":
        return
    from cona_cli.planner.ceiling import planned_ceiling
    from cona_cli.planner.hardware import load_hardware

    found = planned_ceiling(cfg, load_hardware(cfg.search.hardware))
    if found is not None and not found.pays:
        typer.echo(f"cona: note: {found.verdict()} (policy: static)", err=True)


def write_sbatch(
    path: Path,
    config: Path,
    run_dir: Path | None,
    strategy: str | None,
    chain: Path | None,
    max_steps: int | None,
    data: Path | None,
    sets: list[str] | None = None,
) -> None:
    """Validate the config and write the batch script (the run folder is made now, for Slurm's log)."""
    cfg = resolve_config(config, strategy, chain, max_steps, data, parse_sets(sets))
    run_dir = (run_dir or default_run_dir(config)).absolute()
    argv = [str(config.absolute()), "--run-dir", str(run_dir)]
    for flag, value in (
        ("--strategy", strategy),
        ("--chain", chain and chain.absolute()),
        ("--max-steps", max_steps),
        ("--data", data and data.absolute()),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for item in sets or []:
        argv += ["--set", item]
    text = sbatch_script(cfg, argv, run_dir, Path.cwd())
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    typer.echo(f"cona: wrote {path}; submit it with: sbatch {path}")
