"""`cona train --dry-run`: the plan of a run that passed every check `cona train` runs before its first
launch (`control.preflight`); nothing is launched and no run folder is written."""

from __future__ import annotations

import typer

from cona_cli.control.preflight import Checked
from cona_cli.planner.space import gbs_ladder
from cona_core.config import Config


def _backend(cfg: Config) -> str:
    if cfg.cluster.backend != "auto":
        return cfg.cluster.backend
    from cona_cli.cluster.nodes import may_use_gpus

    return f"auto (here: {'nccl' if may_use_gpus(cfg.cluster) else 'gloo'})"


def dry_run_plan(checked: Checked) -> None:
    """Print the plan of a run that passed `preflight`: its policy, first strategy, ladder, the static-auto
    pick, world, backend, schedule and stop rules."""
    cfg, policy = checked.cfg, checked.policy
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
        f"data: {checked.data}",
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
