"""bf16 against fp32 under every world-4 layout (FSDP2 mixed precision, autocast elsewhere), activation
recompute under TP + PP, one host sync per step, and the step's memory fields (one torchrun job)."""

from __future__ import annotations

import json

import pytest

from tests.support import REPO, TINY, torchrun

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from cona_core.config import config_from_dict
    from launch.data.corpus import prepare_corpus

    run_dir = tmp_path_factory.mktemp("precision")
    cfg = config_from_dict(TINY, "tiny")
    (run_dir / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    (run_dir / "corpus.json").write_text(prepare_corpus(cfg.data, seed=cfg.train.seed).to_json())
    out = run_dir / "results.json"
    torchrun(REPO / "tests" / "dist" / "precision.py", 4, str(run_dir), str(out))
    return json.loads(out.read_text())


def test_bf16_tracks_fp32_under_every_layout(results: dict) -> None:
    ref = results["reference"]
    assert len(results["bf16"]) == 8
    for name, r in results["bf16"].items():
        diffs = [abs(got - want) / want for got, want in zip(r["losses"], ref)]
        assert max(diffs) < 2e-3, (name, r["losses"], ref)
        assert any(d > 0 for d in diffs), (name, "bf16 changed nothing: is it fp32?")


def test_recompute_changes_nothing(results: dict) -> None:
    assert results["recompute"]["losses"] == results["bf16"]["dp1-tp2-pp2-mbs4-gbs16"]["losses"]


def test_one_host_sync_per_step_and_memory_fields(results: dict) -> None:
    for name, r in [*results["bf16"].items(), ("recompute", results["recompute"])]:
        assert r["host_reads"] == 1, (name, r["host_reads"])
        assert r["memory"]["peak_rss_bytes"] > 10 * 2**20, (name, r["memory"])
