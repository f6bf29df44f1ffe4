"""`cona train --dry-run`: everything `cona train` checks before it launches, then the plan; nothing is
launched and no run folder is written."""

from __future__ import annotations

from pathlib import Path

import typer

from cona_cli.config import Config, ConfigError
from cona_cli.control.run_setup import make_policy
from cona_cli.planner.space import gbs_ladder


def check_data(cfg: Config) -> str:
    """The data's format and files, each opened and read (one byte; nothing is tokenized); ConfigError
    (one line) when something is missing or unreadable."""
    data = cfg.data
    if data.tokenizer not in ("bpe", "byte") and not Path(data.tokenizer).expanduser().exists():
        raise ConfigError(f"data.tokenizer: {data.tokenizer}: no such file or folder")
    if data.path is None:
        return f"synthetic corpus ({data.synthetic_tokens} tokens), tokenizer {data.tokenizer}"
    from launch.data.sources import DataError, resolve  # numpy only

    try:
        src = resolve(data)
    except DataError as e:
        raise ConfigError(str(e)) from None
    for f in src.key_files or (src.root,):
        try:
            if f.is_file():
                with f.open("rb") as fh:
                    fh.read(1)
            else:
                next(iter(f.iterdir()), None)
        except OSError as e:
            raise ConfigError(f"data.path: {f}: cannot read ({e.strerror})") from None
    valid = f"{len(src.valid)} valid file(s)" if src.valid else f"valid split {data.valid_fraction:g} of the documents"
    return f"{src.format} at {data.path}: {len(src.train)} train file(s), {valid}, tokenizer {data.tokenizer}"


def _backend(cfg: Config) -> str:
    if cfg.cluster.backend != "auto":
        return cfg.cluster.backend
    from cona_cli.cluster.nodes import may_use_gpus

    return f"auto (here: {'nccl' if may_use_gpus(cfg.cluster) else 'gloo'})"


def dry_run_plan(cfg: Config) -> None:
    """Validate data and feasibility (the policy's first strategy, the static-auto pick) and print the plan."""
    data = check_data(cfg)
    cfg, policy = make_policy(cfg)
    from cona_cli.control.cona_policy import fastest_strategy  # the planner: numpy, skopt
    from cona_cli.planner.hardware import load_hardware

    try:
        auto = str(fastest_strategy(cfg, load_hardware(cfg.search.hardware)))
    except ValueError as e:  # ConfigError (an unknown profile) included
        auto = f"none ({str(e).splitlines()[0]})"
    c, t = cfg.cluster, cfg.train
    stops = [f"{k} {v}" for k, v in (("max_steps", t.max_steps), ("max_tokens", t.max_tokens)) if v]
    stops += [f"{k} {v}" for k, v in (("max_time", t.max_time), ("target_ppl", t.target_ppl)) if v]
    schedule = f"{t.schedule} over {t.decay_tokens} tokens" if t.decay_tokens else f"{t.schedule} (no decay_tokens)"
    if t.schedule != "constant" and not t.decay_tokens:
        schedule = f"constant LR ({t.schedule} without decay_tokens or max_tokens)"
    lines = [
        f"config: {cfg.source} (valid)",
        f"data: {data}",
        f"policy: {cfg.policy}",
        f"first strategy: {policy.first().strategy}",
        f"gbs ladder: {', '.join(map(str, gbs_ladder(cfg)))}",
        f"static-auto strategy: {auto} (fastest predicted at gbs {cfg.search.gbs_static or gbs_ladder(cfg)[0]})",
        f"world: {c.world} ({c.nodes} node(s) x {c.procs_per_node}, launcher {c.launcher})",
        f"backend: {_backend(cfg)}",
        f"schedule: {schedule}, lr {t.lr:g}; stop: {', '.join(stops) or 'the chain'}",
    ]
    if cfg.policy == "cona":
        from cona_cli.planner.ceiling import planned_ceiling

        found = planned_ceiling(cfg, load_hardware(cfg.search.hardware))
        lines.append(f"chaining: {found.verdict() if found else 'no feasible strategy at gbs_static'}")
    lines.append("dry run: nothing launched, no run folder written")
    for line in lines:
        typer.echo(line)
