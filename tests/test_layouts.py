"""Every world-4 layout matches single-process training; DCP checkpoints reshard across layouts."""

from __future__ import annotations

import json

import pytest

from tests.support import REPO, TINY, torchrun

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from cona_cli.config import config_from_dict
    from launch.data import prepare_corpus

    run_dir = tmp_path_factory.mktemp("layouts")
    cfg = config_from_dict(TINY, "tiny")
    (run_dir / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
    (run_dir / "corpus.json").write_text(prepare_corpus(cfg.data, seed=cfg.train.seed).to_json())
    out = run_dir / "results.json"
    torchrun(REPO / "tests" / "dist" / "layouts.py", 4, str(run_dir), str(out))
    return json.loads(out.read_text())


def test_every_layout_matches_single_process(results: dict) -> None:
    ref = results["reference"]
    assert len(results["layouts"]) == 6
    for name, losses in results["layouts"].items():
        assert abs(losses[0] - ref[0]) < 1e-4, (name, losses, ref)
        for got, want in zip(losses, ref):
            assert abs(got - want) < 1e-3, (name, losses, ref)
    assert ref[-1] < ref[0]  # it trains


def test_reshard_keeps_weights_moments_and_loss(results: dict) -> None:
    pairs = {(r["from"], r["to"]) for r in results["reshard"]}
    assert ("dp2-tp2-pp1-mbs2-gbs16", "dp4-tp1-pp1-mbs2-gbs16") in pairs
    assert ("dp2-tp2-pp1-mbs2-gbs16", "dp2-tp1-pp2-mbs1-gbs32") in pairs  # gbs and mbs change too
    for r in results["reshard"]:
        assert r["same_keys"] and r["keys"] > 30, r
        assert r["max_abs_diff"] <= 1e-5, r
        assert abs(r["loss_before"] - r["loss_after"]) <= 1e-5, r
        assert (r["step"], r["consumed"]) == (2, 32), r
