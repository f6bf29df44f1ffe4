"""Shared fixtures: corpora cached per test session, and a prepared tiny run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cona_cli.config import config_from_dict
from tests.support import TINY


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Corpora are cached per test session, never in the user's home."""
    monkeypatch.setenv("CONA_CACHE", str(tmp_path_factory.getbasetemp() / "cona-cache"))


@pytest.fixture
def tiny_run_dir(tmp_path: Path) -> Path:
    """A run folder with the resolved tiny config and its prepared corpus, as the controller leaves it."""
    from launch.data.corpus import prepare_corpus

    cfg = config_from_dict(TINY, "tiny")
    (tmp_path / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    (tmp_path / "corpus.json").write_text(prepare_corpus(cfg.data, seed=cfg.train.seed).to_json())
    return tmp_path
