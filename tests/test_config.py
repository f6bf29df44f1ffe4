"""Bad configs and flags are refused before anything launches: exit 2, one line naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.run_config import load_config
from cona_core.config import ConfigError, config_from_dict
from tests.support import REPO, TINY, write_config

BAD = [
    ({"train": {"lr": -1}}, "train.lr: must be > 0"),
    ({"train": {"lr": "fast"}}, "train.lr: must be a number"),
    ({"train": {"learning_rate": 0.1}}, "train.learning_rate: unknown key"),
    ({"model": {"n_layers": 0}}, "model.n_layers: must be > 0"),
    ({"model": {"d_model": 2.5}}, "model.d_model: must be an integer"),
    ({"model": {"family": "rnn"}}, "model.family: must be one of gpt"),
    ({"model": {"dropout": 1.5}}, "model.dropout: must be in [0, 1)"),
    ({"data": {"tokenizer": "my tokenizer"}}, "data.tokenizer: must be one of"),
    ({"cluster": {"backend": "mpi"}}, "cluster.backend: must be one of"),
    ({"cluster": {"procs_per_node": -2}}, "cluster.procs_per_node: must be > 0"),
    ({"strategy": "dp3-tp1-pp1-mbs1-gbs12"}, "dp*tp*pp = 3 != world size 4"),
    ({"strategy": "dp1-tp3-pp1-mbs1-gbs12", "cluster": {"procs_per_node": 3}}, "n_heads 4 not divisible by tp 3"),
    ({"strategy": "dp1-tp1-pp3-mbs1-gbs12", "cluster": {"procs_per_node": 3}}, "n_layers 4 not divisible by pp 3"),
    ({"strategy": "dp4-tp1-pp1-mbs3-gbs16"}, "gbs 16 not divisible by dp*mbs = 12"),
    ({"strategy": "dp4-tp1-pp1-mbs2"}, "expected the form dp2-tp1-pp2-mbs2-gbs16"),
    (
        {"chain": [{"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16}, {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 32}]},
        "chain[0].steps: required",
    ),
    ({"policy": "greedy"}, "policy: must be one of"),
    ({"optimizer": {"name": "sgd"}}, "optimizer: unknown section"),
    ({"search": {"mbs": [0, 2]}}, "search.mbs: must be > 0"),
    ({"search": {"gbs_ladder": [8, -16]}}, "search.gbs_ladder: must be > 0"),
    ({"search": {"gbs_min": 8, "gbs_max": 3}}, "search.gbs_max: 3 is below search.gbs_min 8"),
    ({"search": {"gbs_static": 16, "gbs_max": 8}}, "search.gbs_max: 8 is below search.gbs_static 16"),
    ({"search": {"n_initial": 30, "budget": 10}}, "search.n_initial: 30 initial points exceed search.budget 10"),
    ({"model": {"d_model": 30}}, "model.d_model: 30 is not divisible by model.n_heads 4"),
    ({"model": {"d_model": 12}}, "model.d_model: the head size d_model / n_heads = 3 must be even"),
    ({"model": {"n_kv_heads": 3}}, "model.n_kv_heads: 3 does not divide model.n_heads 4"),
    ({"train": {"warmup_tokens": 5000, "decay_tokens": 1000}}, "train.warmup_tokens: 5000 is more than"),
    ({"train": {"target_ppl": 20, "eval_interval": None}}, "train.target_ppl: needs evaluations"),
]


def _merge(base: dict, patch: dict) -> dict:
    doc = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize("patch,message", BAD)
def test_bad_config_exits_2_with_one_line(tmp_path: Path, patch: dict, message: str) -> None:
    cfg = write_config(tmp_path / "bad.yaml", _merge(TINY, patch))
    result = CliRunner().invoke(app, ["train", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(cfg) in lines[0], result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written or launched


def test_bad_flags_and_files(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "ok.yaml", TINY)
    runner = CliRunner()
    cases = [
        (["train", str(tmp_path / "missing.yaml")], "missing.yaml: cannot read"),
        (["train", str(cfg), "--strategy", "dp4"], "--strategy: strategy 'dp4'"),
        (["train", str(cfg), "--max-steps", "0"], "--max-steps: must be >= 1"),
        (["train", str(cfg), "--chain", str(tmp_path / "nochain.yaml")], "nochain.yaml: cannot read"),
    ]
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    cases.append((["train", str(tmp_path / "broken.yaml")], "broken.yaml: invalid YAML at line"))
    twice = tmp_path / "twice.yaml"  # plain YAML would keep the second `train:` and drop the first silently
    twice.write_text(cfg.read_text() + "train:\n  lr: 1.0\n")
    line = len(cfg.read_text().splitlines()) + 1
    cases.append((["train", str(twice)], f"twice.yaml: invalid YAML at line {line}: key 'train' given twice"))
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_every_numeric_field_has_a_range() -> None:
    import dataclasses
    from typing import get_type_hints

    from cona_core import config

    for section in (
        config.ModelConfig,
        config.DataConfig,
        config.ClusterConfig,
        config.TrainConfig,
        config.SearchConfig,
    ):
        hints = get_type_hints(section)
        for f in dataclasses.fields(section):
            numeric = any(n in str(hints[f.name]) for n in ("int", "float")) and hints[f.name] is not bool
            if numeric and f.metadata.get("yaml", True):
                assert f.metadata.get("check") is not None, f"{section.__name__}.{f.name}"


def test_shipped_configs_are_valid() -> None:
    tiny = load_config(REPO / "configs" / "tiny.yaml")
    assert tiny.cluster.world == 4 and tiny.data.path is None
    wiki = load_config(REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    assert wiki.data.path is not None


def test_round_trip_through_worker_json() -> None:
    import json

    from cona_core.config import config_from_json

    cfg = config_from_dict(
        _merge(
            TINY,
            {
                "chain": [
                    {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16, "steps": 5},
                    {"dp": 2, "tp": 2, "pp": 1, "mbs": 2, "gbs": 32},
                ],
                "strategy": None,
            },
        ),
        "x",
    )
    again = config_from_json(json.dumps(cfg.to_raw()), "x")
    assert again == cfg
    with pytest.raises(ConfigError):
        config_from_dict({"model": TINY["model"], "train": {"seed": -1}})


def test_every_shipped_config_validates() -> None:
    """Each config under configs/ loads (chain files aside); those with a stop rule pass `train --dry-run`."""
    from cona_cli.control.run_setup import complete_schedule
    from cona_core.config import read_yaml

    runner = CliRunner()
    checked = 0
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if "model" not in (read_yaml(path) or {}):  # a chain file (`--chain FILE`)
            continue
        cfg = complete_schedule(load_config(path))
        t = cfg.train
        files = [cfg.data.path] + ([cfg.data.tokenizer] if cfg.data.tokenizer not in ("bpe", "byte") else [])
        absent = any(f is not None and not Path(f).expanduser().exists() for f in files)  # e.g. no shared/
        if any((t.max_steps, t.max_tokens, t.max_time, t.target_ppl)) and not absent:
            result = runner.invoke(app, ["train", str(path), "--dry-run"])
            assert result.exit_code == 0, (path.name, result.output)
            checked += 1
    assert checked >= 4


def test_dropout_with_tensor_parallelism_is_refused_and_never_searched() -> None:
    from cona_cli.planner.hardware import load_hardware
    from cona_cli.planner.space import enumerate_space

    model = {**TINY["model"], "dropout": 0.1}
    with pytest.raises(ConfigError, match="model.dropout: 0.1 with tp > 1 is not supported"):
        config_from_dict({**TINY, "model": model, "strategy": "dp2-tp2-pp1-mbs2-gbs16"}, "t")
    cfg = config_from_dict({**{k: v for k, v in TINY.items() if k != "strategy"}, "model": model}, "t")
    space = enumerate_space(cfg, load_hardware("cpu-local"), [16])
    assert space.feasible and all(s.tp == 1 for s in space.feasible)
