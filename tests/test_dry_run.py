"""`cona train --dry-run` runs every check of a first launch (`control.preflight`) and launches nothing;
`--set` reaches any depth with YAML values; a tokenizer named by its hub name comes from the local
Hugging Face cache. Fast: nothing here starts a worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.cluster.nodes import gpu_device_nodes
from cona_cli.control.run_setup import prepare_run_dir, resolve_config
from cona_cli.overrides import parse_sets
from cona_core.config import ConfigError
from cona_core.rundir import RunDir
from tests.support import REPO, TINY, write_config

runner = CliRunner()
TEXT = "the quick brown fox jumps over the lazy dog while a calm river runs past the old mill\n"


def _refused(args: list[str], *parts: str) -> str:
    """The one line `cona` refused `args` with (exit 2), checked to hold `parts`."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    for part in parts:
        assert part in line, line
    return line


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # a default run folder would appear here as runs/
    return write_config(tmp_path / "tiny.yaml", TINY)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A text corpus whose validation file holds a few evaluations of the tiny config (1025 tokens each)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.txt").write_text(TEXT * 100)
    (folder / "valid.txt").write_text(TEXT * 200)
    return folder


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if `cona train` goes on to prepare a run folder or start a controller."""
    from cona_cli.commands import train_command

    def refuse(*_a, **_k):
        raise AssertionError("a refused run went on to launch")

    monkeypatch.setattr(train_command, "Controller", refuse)
    monkeypatch.setattr(train_command, "prepare_run_dir", refuse)


def _hub_tokenizer(hf_home: Path, name: str) -> Path:
    """A small byte-level BPE saved as the hub cache holds `name` (refs/main naming its snapshot)."""
    repo = hf_home / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    tok.save(str(snapshot / "tokenizer.json"))
    return snapshot / "tokenizer.json"


@pytest.mark.skipif(gpu_device_nodes(), reason="this host has GPUs")
def test_nccl_on_a_cpu_host_is_refused_by_the_dry_run_as_by_the_launch(tiny: Path, no_launch: None) -> None:
    args = ["train", str(tiny), "--set", "cluster.backend=nccl"]
    dry = _refused([*args, "--dry-run"], "cluster.backend: nccl but this machine has no GPU")
    assert _refused(args) == dry  # the launch refuses it in the same words, before it prepares anything


def test_a_file_that_is_no_tokenizer_is_refused(tiny: Path, corpus: Path, no_launch: None) -> None:
    args = ["train", str(tiny), "--dry-run", "--data", str(corpus), "--set", f"data.tokenizer={REPO / 'README.md'}"]
    _refused(args, "data.tokenizer:", "README.md", "cannot load it as a tokenizer.json")


def test_slurm_outside_an_allocation_is_refused(tiny: Path, no_launch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    args = ["train", str(tiny), "--dry-run", "--set", "cluster.launcher=slurm"]
    _refused(args, "cluster.launcher: slurm: not inside a Slurm allocation")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost,node2")
    _refused(args, "the allocation has 2 nodes", "cluster.nodes is 1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "launcher slurm" in result.stdout


def test_a_good_config_passes_and_nothing_is_written(tiny: Path, corpus: Path, no_launch: None) -> None:
    run_dir = tiny.parent / "run"
    result = runner.invoke(app, ["train", str(tiny), "--dry-run", "--data", str(corpus), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert f"data: text at {corpus}: 1 train file(s), 1 valid file(s), tokenizer byte" in result.stdout
    assert "dry run: nothing launched" in result.stdout
    assert not run_dir.exists() and sorted(p.name for p in corpus.iterdir()) == ["train.txt", "valid.txt"]


def test_too_few_validation_tokens_for_one_evaluation(tiny: Path, corpus: Path, no_launch: None) -> None:
    (corpus / "valid.txt").write_text(TEXT * 5)  # one document (no blank line): 429 bytes and its EOS
    args = ["train", str(tiny), "--dry-run", "--data", str(corpus)]
    _refused(args, "train.eval_tokens: one evaluation reads 1025 validation tokens", f"{corpus} has 430;")
    passes = runner.invoke(app, [*args, "--set", "train.eval_tokens=320"])  # 10 windows of 33: 321 tokens
    assert passes.exit_code == 0, passes.output
    synthetic = ["train", str(tiny), "--dry-run", "--set", "data.synthetic_tokens=100"]
    _refused(synthetic, "the synthetic corpus has", "data.synthetic_tokens")


def test_a_run_folder_that_cannot_be_made_is_refused(tiny: Path, no_launch: None) -> None:
    args = ["train", str(tiny), "--dry-run", "--run-dir", str(tiny / "run")]
    _refused(args, "--run-dir:", f"{tiny} is not a folder")


def test_set_reaches_any_depth(tiny: Path) -> None:
    cfg = resolve_config(tiny, None, None, None, None, parse_sets(["cluster.env.NCCL_DEBUG=INFO"]))
    assert cfg.cluster.env == {"NCCL_DEBUG": "INFO"}
    shown = runner.invoke(app, ["config", "show", str(tiny), "--set", "cluster.env.NCCL_DEBUG=INFO"])
    assert shown.exit_code == 0, shown.output
    assert yaml.safe_load(shown.stdout)["cluster"]["env"] == {"NCCL_DEBUG": "INFO"}


def test_set_values_are_yaml_mappings_too(tiny: Path) -> None:
    assert parse_sets(["train.clock_table={8: 0.1, 16: 2e-1}"]) == {"train.clock_table": {8: 0.1, 16: 0.2}}
    cfg = resolve_config(tiny, None, None, None, None, parse_sets(["cluster.env={A: x, B: '1'}"]))
    assert cfg.cluster.env == {"A": "x", "B": "1"}
    with pytest.raises(ConfigError, match="--set cluster.env.A: overlaps --set cluster.env"):
        parse_sets(["cluster.env={B: '1'}", "cluster.env.A=x"])
    with pytest.raises(ConfigError, match=r"--set data: also given by a flag \(--data\)"):
        resolve_config(tiny, None, None, None, tiny.parent, parse_sets(["data={tokenizer: byte}"]))


def test_a_hub_name_resolves_from_the_local_cache(
    tiny: Path, corpus: Path, no_launch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_home = tiny.parent / "hf"
    cached = _hub_tokenizer(hf_home, "acme/tiny-tok")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    args = ["train", str(tiny), "--dry-run", "--data", str(corpus), "--set", "data.tokenizer=acme/tiny-tok"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"tokenizer acme/tiny-tok ({cached})" in result.stdout
    # the launch's corpus is tokenized with it; the run's config keeps the name
    cfg = resolve_config(tiny, None, None, None, corpus, parse_sets(["data.tokenizer=acme/tiny-tok"]))
    monkeypatch.setenv("CONA_CACHE", str(tiny.parent / "cache"))
    run = RunDir(tiny.parent / "run")
    prepare_run_dir(run.path, tiny, cfg)
    assert json.loads(run.corpus.read_text())["vocab_size"] == Tokenizer.from_file(str(cached)).get_vocab_size()
    assert json.loads(run.resolved_config.read_text())["data"]["tokenizer"] == "acme/tiny-tok"


def test_a_hub_name_missing_from_the_cache_is_refused(
    tiny: Path, corpus: Path, no_launch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tiny.parent / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    args = ["train", str(tiny), "--dry-run", "--data", str(corpus), "--set", "data.tokenizer=acme/absent"]
    searched = tiny.parent / "hf" / "hub" / "models--acme--absent" / "snapshots"
    _refused(args, "data.tokenizer: acme/absent:", str(searched))
