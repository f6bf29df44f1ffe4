"""What `cona train` and `cona train --resume` both do before a controller starts: resolve the config
with the command line's overrides, choose the policy, and prepare a new run folder."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from cona_cli.control.policies import ChainPolicy, Policy, StaticPolicy
from cona_cli.control.ramp_policy import RampPolicy
from cona_cli.overrides import overlaps
from cona_cli.planner.space import gbs_ladder
from cona_cli.run_config import load_config
from cona_core.config import Config, ConfigError, config_from_dict, parse_chain, read_yaml
from cona_core.rundir import RunDir
from cona_core.shape import SPECIAL_TOKENS
from cona_core.strategy import Strategy, StrategyError


def resolve_config(
    config: Path,
    strategy: str | None,
    chain: Path | None,
    max_steps: int | None,
    data: Path | None = None,
    sets: dict[str, Any] | None = None,
) -> Config:
    """The config with CLI overrides applied and validated as a whole. `sets` (from `--set`, already parsed)
    go over the file like the named flags; a key both set and given by a flag is refused."""
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
    for key in sets or {}:
        flag = next((k for k in overrides if overlaps(k, key)), None)
        if flag is not None:
            raise ConfigError(f"--set {key}: also given by a flag ({_FLAG_OF.get(flag, '--strategy or --chain')})")
    cfg = complete_schedule(load_config(config, {**overrides, **(sets or {})}))
    explicit = "train.schedule" in (sets or {}) or "schedule" in (_section(read_yaml(config), "train"))
    t = cfg.train
    if explicit and t.schedule != "constant" and t.decay_tokens is None:
        raise ConfigError(
            f"{config}: train.decay_tokens: schedule {t.schedule} needs decay_tokens (or a max_tokens stop rule, "
            "its default); set it, or schedule: constant"
        )
    if not any((cfg.train.max_steps, cfg.train.max_tokens, cfg.train.max_time, cfg.train.target_ppl)) and not (
        cfg.chain and cfg.chain[-1].steps
    ):
        raise ConfigError(f"{config}: train: needs a stop rule (max_steps, max_tokens, max_time or target_ppl)")
    return cfg


_FLAG_OF = {"data.path": "--data", "train.max_steps": "--max-steps"}


def _section(raw: Any, name: str) -> dict:
    section = raw.get(name) if isinstance(raw, dict) else None
    return section if isinstance(section, dict) else {}


def complete_schedule(cfg: Config) -> Config:
    """A decaying schedule without decay_tokens decays over max_tokens when that stop rule exists."""
    t = cfg.train
    if t.schedule == "constant" or t.decay_tokens is not None or t.max_tokens is None:
        return cfg
    try:
        raw = cfg.to_raw()
        return config_from_dict({**raw, "train": {**raw["train"], "decay_tokens": t.max_tokens}}, cfg.source)
    except ConfigError as e:
        raise ConfigError(f"{cfg.source}: {e} (train.decay_tokens defaults to train.max_tokens)") from None


def make_policy(cfg: Config) -> tuple[Config, Policy]:
    """The policy, and the config completed with what it decided (auto strategy, LR base batch)."""
    if cfg.policy == "chain":
        policy: Policy = ChainPolicy(cfg.chain)
    elif cfg.policy == "static" and not cfg.auto_strategy:
        policy = StaticPolicy(cfg.strategy)
    elif cfg.policy == "ramp" and not cfg.auto_strategy:
        policy = RampPolicy(cfg, cfg.strategy)
    else:
        from cona_cli.control.cona_policy import ConaPolicy, fastest_strategy  # the planner: numpy, skopt
        from cona_cli.planner.hardware import load_hardware

        try:
            hw = load_hardware(cfg.search.hardware)
            if cfg.policy in ("static", "ramp"):
                best = fastest_strategy(cfg, hw)
                cfg = dataclasses.replace(cfg, strategy=best, auto_strategy=False)
                policy = StaticPolicy(best) if cfg.policy == "static" else RampPolicy(cfg, best)
            else:
                policy = ConaPolicy(cfg, hw)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{cfg.source}: {e}") from None
    if cfg.train.lr_base_gbs is None:  # the same LR at the same batch under every policy: the lowest rung's
        base = min(gbs_ladder(cfg)[0], policy.first().strategy.gbs)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr_base_gbs=base))
    return config_from_dict(cfg.to_raw(), cfg.source), policy


def check_run_dir(run_dir: Path) -> None:
    """A run folder a new run can use: none holds a run there, and this process can make it (the nearest
    existing folder on its path is writable). ConfigError (one line) otherwise."""
    if RunDir(run_dir).holds_run():
        raise ConfigError(f"--run-dir: {run_dir} already holds a run; choose a new folder or --resume it")
    path = run_dir.absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--run-dir: {run_dir}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir: {run_dir}: cannot write in {existing}")


def eval_tokens_needed(cfg: Config) -> int:
    """The validation tokens one evaluation reads: its first max(1, eval_tokens // seq_len) windows of
    seq_len + 1 (`launch.data.sampling.eval_batches`)."""
    seq_len = cfg.model.seq_len
    return max(1, cfg.train.eval_tokens // seq_len) * seq_len + 1


def check_eval_tokens(cfg: Config, n_valid: int, at_most: bool = False) -> None:
    """ConfigError when the validation split's `n_valid` tokens (`at_most`: an upper bound of them) are
    fewer than one evaluation reads."""
    need = eval_tokens_needed(cfg)
    if n_valid < need:
        data, more = (
            (f"data.path {cfg.data.path}", "data.valid_path, data.valid_fraction")
            if cfg.data.path
            else ("the synthetic corpus", "data.synthetic_tokens")
        )
        raise ConfigError(
            f"train.eval_tokens: one evaluation reads {need} validation tokens but {data} has "
            f"{'at most ' if at_most else ''}{n_valid}; lower train.eval_tokens or give more validation data ({more})"
        )


def prepare_run_dir(run_dir: Path, config: Path, cfg: Config) -> None:
    """Copy the config, write the resolved one and prepare the corpus (may take minutes: BPE training), which
    must hold one evaluation's validation tokens."""
    check_run_dir(run_dir)
    run = RunDir(run_dir)
    from launch.data.corpus import prepare_corpus  # tokenizers: only once the config is valid
    from launch.data.sources import DataError
    from launch.data.tokenize import tokenizer_location

    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, run.config_copy)
    run.resolved_config.write_text(json.dumps(cfg.to_raw(), indent=1))
    data = cfg.data
    if cfg.cluster.launcher != "local" and data.cache_dir is None:  # the nodes read tokens from shared storage
        data = dataclasses.replace(data, cache_dir=str(run.data.absolute()))
    try:
        if data.tokenizer not in ("bpe", "byte"):  # a hub name: its tokenizer.json in the local cache
            data = dataclasses.replace(data, tokenizer=str(tokenizer_location(data.tokenizer)))
        corpus = prepare_corpus(data, seed=cfg.train.seed, special_tokens=SPECIAL_TOKENS[cfg.model.family])
    except DataError as e:
        raise ConfigError(str(e)) from None
    check_eval_tokens(cfg, corpus.n_valid_tokens)
    check_init_from(cfg, corpus.vocab_size)
    run.corpus.write_text(corpus.to_json())


def check_init_from(cfg: Config, vocab: int) -> None:
    """`model.init_from`'s folder holds every weight of the model, fitting a tokenizer of `vocab` ids
    (reads the folder's index, no weights; imports torch)."""
    if cfg.model.init_from is None:
        return
    from launch.pretrained import PretrainedError, check_pretrained

    try:
        check_pretrained(cfg.model, vocab)
    except PretrainedError as e:
        raise ConfigError(str(e)) from None


def default_run_dir(config: Path) -> Path:
    return Path("runs") / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
