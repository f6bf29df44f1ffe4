"""The command line a Megatron/TorchTitan user expects: --set, train --dry-run, config show, --version,
docs/config.md in sync. Fast: nothing here starts a worker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cona_cli import config_docs
from cona_cli.app import app
from cona_cli.run_config import load_config
from cona_core import config
from tests.support import TINY, write_config

runner = CliRunner()


def _one_line_exit_2(result, *parts: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # a default run folder would appear here as runs/
    return write_config(tmp_path / "tiny.yaml", TINY)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if `cona train` goes on to prepare a run folder or start a controller."""
    from cona_cli.commands import train_command

    def refuse(*_a, **_k):
        raise AssertionError("--dry-run went on to launch")

    monkeypatch.setattr(train_command, "Controller", refuse)
    monkeypatch.setattr(train_command, "prepare_run_dir", refuse)


def test_version() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"cona {version('cona')}"


def test_set_values_are_yaml(tiny: Path) -> None:
    result = runner.invoke(
        app,
        ["config", "show", str(tiny), "--set", "train.lr=3e-4", "--set", "search.mbs=[1,2]", "--set", "policy=cona"],
    )
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert shown["train"]["lr"] == 3e-4 and shown["search"]["mbs"] == [1, 2] and shown["policy"] == "cona"
    assert shown["train"]["max_steps"] == TINY["train"]["max_steps"]  # the rest of the file stays


@pytest.mark.parametrize(
    "item, parts",
    [
        ("train.lrr=3", ("train.lrr: unknown key",)),
        ("train.lr=fast", ("train.lr: must be a number", "'fast'")),
        ("train.lr=-1", ("train.lr: must be > 0",)),
        ("search.mbs=[1,0]", ("search.mbs: must be > 0",)),
        ("search.mbs=[1,2", ("--set search.mbs:", "not a YAML value")),
        ("optimizer.name=sgd", ("optimizer: unknown section",)),
        ("trainlr3", ("--set trainlr3: expected key.path=value",)),
        ("train.lr.peak=1", ("train.lr: must be a number", "{'peak': 1}")),
        ("train..lr=1", ("--set train..lr=1: expected key.path=value",)),
    ],
)
@pytest.mark.parametrize("command", ["train", "search", "show"])
def test_bad_set_exits_2_naming_the_key(tiny: Path, no_launch: None, command: str, item: str, parts: tuple) -> None:
    args = {
        "train": ["train", str(tiny), "--dry-run"],
        "search": ["search", str(tiny), "--dry-run"],
        "show": ["config", "show", str(tiny)],
    }[command]
    _one_line_exit_2(runner.invoke(app, [*args, "--set", item]), *parts)
    assert not (tiny.parent / "runs").exists()


def test_set_refuses_a_key_a_flag_also_gives(tiny: Path, no_launch: None) -> None:
    result = runner.invoke(app, ["train", str(tiny), "--dry-run", "--max-steps", "5", "--set", "train.max_steps=9"])
    _one_line_exit_2(result, "--set train.max_steps: also given by a flag (--max-steps)")
    result = runner.invoke(app, ["train", str(tiny), "--set", "train.lr=1", "--resume", str(tiny.parent)])
    _one_line_exit_2(result, "--set: not with --resume")


def test_set_reaches_search(tiny: Path) -> None:
    import json

    result = runner.invoke(app, ["search", str(tiny), "--dry-run", "--json", "--set", "search.mbs=[1]", "--top", "50"])
    assert result.exit_code == 0, result.output
    (res,) = json.loads(result.stdout)["results"]
    assert res["candidates"] and {c["mbs"] for c in res["candidates"]} == {1}


def test_sbatch_script_carries_the_sets(tiny: Path) -> None:
    doc = {**TINY, "cluster": {"procs_per_node": 4, "launcher": "slurm"}}
    cfg = write_config(tiny.parent / "slurm.yaml", doc)
    script = tiny.parent / "job.sh"
    args = ["train", str(cfg), "--sbatch", str(script), "--run-dir", str(tiny.parent / "run"), "--set", "train.lr=3e-4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "--set train.lr=3e-4" in script.read_text()


def test_train_dry_run_prints_the_plan_and_writes_nothing(tiny: Path, no_launch: None) -> None:
    run_dir = tiny.parent / "run"
    result = runner.invoke(app, ["train", str(tiny), "--dry-run", "--run-dir", str(run_dir), "--set", "train.lr=3e-4"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for line in (
        "policy: static",
        "first strategy: dp4-tp1-pp1-mbs2-gbs16",
        "gbs ladder: 4, 8, 16, 32, 64",
        "static-auto strategy: dp4-",
        "world: 4 (1 node(s) x 4, launcher local)",
        "backend: auto (here: ",
        "lr 0.0003",
        "data: synthetic corpus",
    ):
        assert line in out, out
    assert not run_dir.exists() and not (tiny.parent / "runs").exists()


def test_train_dry_run_cona_policy(tiny: Path, no_launch: None) -> None:
    result = runner.invoke(app, ["train", str(tiny), "--dry-run", "--set", "strategy=null"])
    assert result.exit_code == 0, result.output
    assert "policy: cona" in result.stdout and "first strategy: dp" in result.stdout


def test_train_dry_run_checks_the_data(tiny: Path, no_launch: None) -> None:
    folder = tiny.parent / "corpus"
    folder.mkdir()
    (folder / "train.txt").write_text("hello world\n\nanother document\n")
    (folder / "valid.txt").write_text("a valid document\n" * 80)  # one evaluation's 1025 tokens and more
    result = runner.invoke(app, ["train", str(tiny), "--dry-run", "--data", str(folder)])
    assert result.exit_code == 0, result.output
    assert f"data: text at {folder}: 1 train file(s), 1 valid file(s)" in result.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["train.txt", "valid.txt"]  # no cache written beside it

    _one_line_exit_2(
        runner.invoke(app, ["train", str(tiny), "--dry-run", "--data", str(tiny.parent / "nowhere")]),
        "data.path:",
        "no such file or folder",
    )
    (folder / "valid.txt").write_text("")
    _one_line_exit_2(runner.invoke(app, ["train", str(tiny), "--dry-run", "--data", str(folder)]), "valid.txt: empty")
    tok = ["train", str(tiny), "--dry-run", "--set", "data.tokenizer=./missing/tokenizer.json"]
    _one_line_exit_2(runner.invoke(app, tok), "data.tokenizer: ./missing/tokenizer.json: no such file or folder")


def test_train_dry_run_refuses_what_train_refuses(tiny: Path, no_launch: None) -> None:
    bad = runner.invoke(app, ["train", str(tiny), "--dry-run", "--strategy", "dp3-tp1-pp1-mbs1-gbs12"])
    _one_line_exit_2(bad, "dp*tp*pp = 3 != world size 4")
    stopless = runner.invoke(app, ["train", str(tiny), "--dry-run", "--set", "train.max_steps=null"])
    _one_line_exit_2(stopless, "train: needs a stop rule")
    _one_line_exit_2(runner.invoke(app, ["train", "--dry-run"]), "--dry-run: give a CONFIG")


def test_cosine_without_decay_tokens(tiny: Path, no_launch: None) -> None:
    base = ["train", str(tiny), "--dry-run", "--set", "train.schedule=cosine"]
    _one_line_exit_2(runner.invoke(app, base), "train.decay_tokens: schedule cosine needs decay_tokens")
    result = runner.invoke(app, [*base, "--set", "train.max_tokens=64000"])
    assert result.exit_code == 0, result.output
    assert "schedule: cosine over 64000 tokens" in result.stdout
    shown = runner.invoke(app, ["config", "show", str(tiny), "--set", "train.max_tokens=64000"])
    assert yaml.safe_load(shown.stdout)["train"]["decay_tokens"] == 64000  # the default schedule decays too
    linear = runner.invoke(app, ["train", str(tiny), "--dry-run", "--set", "train.schedule=linear"])
    _one_line_exit_2(linear, "train.decay_tokens: schedule linear needs decay_tokens")
    short = [*base, "--set", "train.max_tokens=1000", "--set", "train.warmup_tokens=5000"]
    _one_line_exit_2(runner.invoke(app, short), "train.warmup_tokens: 5000 is more than train.decay_tokens 1000")
    # the schedule left at its default keeps a constant LR (said so in the plan), as before
    result = runner.invoke(app, ["train", str(tiny), "--dry-run"])
    assert result.exit_code == 0 and "constant LR (cosine without decay_tokens or max_tokens)" in result.stdout


def test_config_show_has_every_default(tiny: Path) -> None:
    result = runner.invoke(app, ["config", "show", str(tiny)])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    for name, cls in config_docs.sections().items():
        keys = [f.name for f in dataclasses.fields(cls) if f.metadata.get("yaml", True)]
        assert list(shown[name]) == keys, name
    assert shown["train"]["beta2"] == config.TrainConfig.beta2  # a default the file does not set
    again = config.config_from_dict(shown, str(tiny))
    assert again.to_raw() == load_config(tiny).to_raw()
    missing = runner.invoke(app, ["config", "show", str(tiny.parent / "none.yaml")])
    _one_line_exit_2(missing, "none.yaml: cannot read")


def test_docs_config_md_is_current() -> None:
    committed = config_docs.DOC.read_text() if config_docs.DOC.is_file() else ""
    assert committed == config_docs.render(), (
        f"docs/config.md is out of date with cona_core/config.py: regenerate it with `{config_docs.COMMAND}`"
    )


def test_docs_list_every_field_with_its_meaning(tmp_path: Path) -> None:
    result = runner.invoke(app, ["config", "docs", "--out", str(tmp_path / "config.md")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "config.md").read_text()
    assert text == config_docs.render()
    rows = {}
    section = None
    for line in text.splitlines():
        if line.startswith("## `"):
            section = line.strip("#` ")
        elif section and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[f"{section}.{cells[0].strip('`')}"] = cells
    unexplained = []
    for name, cls in config_docs.sections().items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("yaml", True):
                cells = rows[f"{name}.{f.name}"]
                if not cells[4]:
                    unexplained.append(f"{name}.{f.name}")
    assert not unexplained, (
        f"fields without a meaning (add a docstring after the field in cona_core/config.py): {unexplained}"
    )
    assert rows["train.lr"][1:4] == ["float", "`0.001`", "> 0"]
    assert rows["model.n_layers"][2] == "**required**"
    assert rows["model.family"][3] == "one of gpt, llama, bert"
    assert rows["search.mbs"][3] == "each > 0"
