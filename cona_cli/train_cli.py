"""`cona train`: validate everything, prepare the corpus, then hand over to the controller."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cona_cli.cluster import ClusterError, SlurmError
from cona_cli.config import Config, ConfigError, config_from_dict, load_config, parse_chain, read_yaml
from cona_cli.controller import Controller
from cona_cli.policy import ChainPolicy, Policy, StaticPolicy
from cona_cli.runstate import lock
from cona_cli.sbatch import sbatch_script
from cona_cli.strategy import Strategy, StrategyError

err = Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"cona: {message}", err=True)
    return typer.Exit(code)


def resolve_config(config: Path, strategy: Optional[str], chain: Optional[Path], max_steps: Optional[int],
                   data: Optional[Path] = None) -> Config:
    """The config with CLI overrides applied and validated as a whole."""
    overrides: dict = {}
    if data is not None:
        overrides["data.path"] = str(data)
    if strategy is not None:
        try:
            overrides["strategy"] = str(Strategy.parse(strategy))
        except StrategyError as e:
            raise ConfigError(f"--strategy: {e}") from None
        overrides.update(policy="static", chain=None)
    if chain is not None:
        try:
            stages = parse_chain(read_yaml(chain))
        except ConfigError as e:
            raise ConfigError(f"{chain}: {e}") from None
        overrides["chain"] = [{**s.strategy.to_dict(), **({"steps": s.steps} if s.steps else {})} for s in stages]
        overrides.update(policy="chain", strategy=None)
    if max_steps is not None:
        if max_steps < 1:
            raise ConfigError("--max-steps: must be >= 1")
        overrides["train.max_steps"] = max_steps
    cfg = load_config(config, overrides)
    if not any((cfg.train.max_steps, cfg.train.max_tokens, cfg.train.max_time, cfg.train.target_ppl)) and \
            not (cfg.chain and cfg.chain[-1].steps):
        raise ConfigError(f"{config}: train: needs a stop rule (max_steps, max_tokens, max_time or target_ppl)")
    return cfg


def make_policy(cfg: Config) -> tuple[Config, Policy]:
    """The policy, and the config completed with what it decided (auto strategy, LR base batch)."""
    if cfg.policy == "chain":
        policy: Policy = ChainPolicy(cfg.chain)
    elif cfg.policy == "static" and not cfg.auto_strategy:
        policy = StaticPolicy(cfg.strategy)
    else:
        from cona_cli.costmodel import load_hardware  # the planner: numpy, scipy, skopt
        from cona_cli.online import ConaPolicy, fastest_strategy

        try:
            hw = load_hardware(cfg.search.hardware)
            if cfg.policy == "static":
                best = fastest_strategy(cfg, hw)
                cfg = dataclasses.replace(cfg, strategy=best, auto_strategy=False)
                policy = StaticPolicy(best)
            else:
                policy = ConaPolicy(cfg, hw)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{cfg.source}: {e}") from None
    if cfg.train.lr_base_gbs is None:  # the LR was tuned for the first batch size
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr_base_gbs=policy.first().strategy.gbs))
    return config_from_dict(cfg.to_raw(), cfg.source), policy


def prepare_run_dir(run_dir: Path, config: Path, cfg: Config) -> None:
    if (run_dir / "events.jsonl").exists():
        raise ConfigError(f"--run-dir: {run_dir} already holds a run; choose a new folder or --resume it")
    from launch.data import DataError, prepare_corpus  # imports torch: only once the config is valid

    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, run_dir / "config.yaml")
    (run_dir / "config.resolved.json").write_text(json.dumps(cfg.to_raw(), indent=1))
    data = cfg.data
    if cfg.cluster.launcher != "local" and data.cache_dir is None:  # the nodes read tokens from shared storage
        data = dataclasses.replace(data, cache_dir=str(run_dir.absolute() / "data"))
    try:
        corpus = prepare_corpus(data, seed=cfg.train.seed)
    except DataError as e:
        raise ConfigError(str(e)) from None
    (run_dir / "corpus.json").write_text(corpus.to_json())


def train_command(
    config: Optional[Path] = typer.Argument(None, help="YAML config (model, data, cluster, train, strategy/chain)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run folder (default runs/<config>-<time>)."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="Fixed strategy, e.g. dp2-tp1-pp2-mbs2-gbs16."),
    chain: Optional[Path] = typer.Option(None, "--chain", help="YAML chain file to replay."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after this many optimizer steps."),
    data: Optional[Path] = typer.Option(None, "--data", help="Folder with train.txt and valid.txt (data.path)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run folder from its newest "
                                          "checkpoint, with its own config (CONFIG and flags must agree)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the workers' output."),
    sbatch: Optional[Path] = typer.Option(None, "--sbatch", help="Write a Slurm batch script that runs this "
                                          "training (launcher slurm) to this file instead of training now."),
) -> None:
    """Train under a fixed strategy or a chain of strategies, switching by checkpoint + relaunch."""
    if strategy is not None and chain is not None:
        raise _fail("--strategy and --chain: give one of them")
    state = None
    try:
        if sbatch is not None:
            if config is None or resume is not None:
                raise ConfigError("--sbatch: give a CONFIG (and no --resume)")
            write_sbatch(sbatch, config, run_dir, strategy, chain, max_steps, data)
            return
        if resume is not None:
            from cona_cli.resume import prepare_resume

            if run_dir is not None and run_dir.resolve() != resume.resolve():
                raise ConfigError(f"--run-dir {run_dir} and --resume {resume}: name one run folder")
            run_dir = resume
            cfg, policy, state = prepare_resume(resume, config, strategy, chain, max_steps, data)
        elif config is None:
            raise ConfigError("CONFIG: missing (give a YAML config, or --resume RUN_DIR)")
        else:
            cfg, policy = make_policy(resolve_config(config, strategy, chain, max_steps, data))
            run_dir = run_dir or default_run_dir(config)
            prepare_run_dir(run_dir, config, cfg)
            lock(run_dir)
        controller = Controller(cfg, run_dir, policy, console=err, verbose=verbose, resume=state)
    except ConfigError as e:
        raise _fail(str(e)) from None
    except (ClusterError, SlurmError) as e:
        raise _fail(str(e), 1) from None
    raise typer.Exit(controller.run())


def default_run_dir(config: Path) -> Path:
    return Path("runs") / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_sbatch(path: Path, config: Path, run_dir: Optional[Path], strategy: Optional[str],
                 chain: Optional[Path], max_steps: Optional[int], data: Optional[Path]) -> None:
    """Validate the config and write the batch script (the run folder is made now, for Slurm's log)."""
    cfg = resolve_config(config, strategy, chain, max_steps, data)
    run_dir = (run_dir or default_run_dir(config)).absolute()
    argv = [str(config.absolute()), "--run-dir", str(run_dir)]
    for flag, value in (("--strategy", strategy), ("--chain", chain and chain.absolute()),
                        ("--max-steps", max_steps), ("--data", data and data.absolute())):
        if value is not None:
            argv += [flag, str(value)]
    text = sbatch_script(cfg, argv, run_dir, Path.cwd())
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    typer.echo(f"cona: wrote {path}; submit it with: sbatch {path}")
