"""Every world-4 layout matches single-process training (FSDP under TP and PP too), for GPT; for Llama
and BERT the layouts that run their own code (TP plans, pipeline splits, tied weights under FSDP). DCP
checkpoints reshard across layouts, also into a layout built ahead (a standby's); an in-place resize
continues as a relaunch from a checkpoint would; tied embeddings stay equal on both pipeline ends; a
checkpoint one rank cannot read fails on every rank."""

from __future__ import annotations

import json

import pytest

from tests.support import REPO, TINY, torchrun

pytestmark = pytest.mark.e2e

# Per-family changes to the tiny model: llama with grouped-query attention (K/V heads divisible by tp 4).
MODEL = {"gpt": {}, "llama": {"n_heads": 8, "n_kv_heads": 4}, "bert": {}}


@pytest.fixture(scope="module")
def every_family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One torchrun over every family's run folder: family -> its results."""
    from cona_core.config import config_from_dict
    from cona_core.shape import SPECIAL_TOKENS
    from launch.data.corpus import prepare_corpus

    dirs = []
    for family in sorted(MODEL):
        run_dir = tmp_path_factory.mktemp(f"layouts-{family}")
        cfg = config_from_dict({**TINY, "model": {**TINY["model"], "family": family, **MODEL[family]}}, "tiny")
        (run_dir / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
        corpus = prepare_corpus(cfg.data, seed=cfg.train.seed, special_tokens=SPECIAL_TOKENS[family])
        (run_dir / "corpus.json").write_text(corpus.to_json())
        dirs.append(str(run_dir))
    out = tmp_path_factory.mktemp("layouts") / "results.json"
    torchrun(REPO / "tests" / "dist" / "layouts.py", 4, str(out), *dirs, timeout=900)
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=sorted(MODEL))
def results(request: pytest.FixtureRequest, every_family: dict) -> dict:
    return {"family": request.param, **every_family[request.param]}


@pytest.fixture(scope="module")
def gpt(every_family: dict) -> dict:
    """The GPT family's results: what the other families share with it is checked once."""
    return {"family": "gpt", **every_family["gpt"]}


def test_every_layout_matches_single_process(results: dict) -> None:
    ref = results["reference"]
    counts = (6, 2) if results["family"] == "gpt" else (3, 1)  # the other families: where their code differs
    assert (len(results["layouts"]), len(results["fsdp"])) == counts
    for name, losses in {**results["layouts"], **{f"fsdp {k}": v for k, v in results["fsdp"].items()}}.items():
        assert abs(losses[0] - ref[0]) < 1e-4, (name, losses, ref)
        assert len(losses) == 2, (name, losses)
        for got, want in zip(losses, ref):
            assert abs(got - want) < 1e-3, (name, losses, ref)
    mean = results["reference_mean"]  # per target: a masked LM's step losses also vary with how many are masked
    assert mean[-1] < mean[0]  # it trains
    if results["family"] != "llama":  # tied: rank 0's first and last stage copies, under each pp > 1 layout
        assert results["tied_equal"] and all(results["tied_equal"]), results["tied_equal"]


def test_reshard_keeps_weights_moments_and_loss(results: dict) -> None:
    pairs = {(r["from"], r["to"]) for r in results["reshard"]}
    if results["family"] == "gpt":
        assert ("dp2-tp2-pp1-mbs2-gbs16", "dp4-tp1-pp1-mbs2-gbs16") in pairs and len(pairs) == 4
    assert ("dp2-tp2-pp1-mbs2-gbs16", "dp2-tp1-pp2-mbs1-gbs32") in pairs  # gbs and mbs change too
    for r in results["reshard"]:
        assert r["same_keys"] and r["keys"] > 30, r
        assert r["max_abs_diff"] <= 1e-5, r
        assert abs(r["loss_before"] - r["loss_after"]) <= 1e-5, r
        assert (r["step"], r["consumed"]) == (1, 16), r
    prepared = [r["prepared"] for r in results["reshard"]]  # the standby's layout built ahead: the second pair
    assert prepared == ([False, True, False, False] if results["family"] == "gpt" else [True, False])


def test_a_checkpoint_one_rank_cannot_read_fails_every_rank(gpt: dict) -> None:
    errors = gpt["load_failure"]
    assert len(errors) == 4 and len(set(errors)) == 1, errors
    last = f"ckpt_{len(gpt['reshard']) - 1}"  # the last reshard pair's checkpoint
    assert "cannot load (ValueError: shard garbled on this rank)" in errors[0] and last in errors[0]


def test_an_in_place_resize_continues_as_a_relaunch_would(gpt: dict) -> None:
    """Same losses, gradient norms, GNS measurements and validation loss after a resize under DDP, TP and
    dp = 1 as after a relaunch into the new batch from the checkpoint taken at the resize (GPT only)."""
    assert len(gpt["resize"]) == 3
    for r in gpt["resize"]:
        old, new = r["ran"]
        assert old.endswith("gbs8") and new.endswith("gbs16"), r  # the resize takes effect after its step
        assert r["consumed"] == [8 + 8 + 16 + 16 + 16] * 2, r
        assert [g[2] is None for g in r["in_place"]] == [True, True, False], r  # held after the resize, then measured
        for got, want in zip(r["in_place"], r["relaunch"]):
            for g, w in zip(got, want):
                assert (g is None and w is None) or abs(g - w) <= 1e-5 * max(1.0, abs(w)), r
        assert abs(r["eval"][0] - r["eval"][1]) <= 1e-5, r


def test_a_model_that_fits_only_sharded_is_built_sharded_with_the_same_values(gpt: dict) -> None:
    """Materialised after FSDP shards it: each rank's peak grows by its quarter and one whole parameter,
    well below the whole model in fp32 (which the old build allocated first), with the same init."""
    r = gpt["sharded_start"]
    assert r["equal"], r
    assert r["whole_bytes"] > 300 * 2**20, r
    # a quarter (0.25), one whole parameter (0.08) and the host allocator's slack (0.1-0.3 measured)
    assert max(r["growth"]) < 0.75 * r["whole_bytes"], r


def test_fsdp_skips_the_middle_micro_batches_reduce_scatters_once_its_ranks_agree_and_matches(gpt: dict) -> None:
    r, ref = gpt["fsdp_unsharded"], gpt["reference"]
    assert r["accumulating"] == [False, False, True], r
    first, second, third = r["reduce_scatters"]
    assert first == second > 0 and third == first // 2, r  # 2 of the 4 micro-batches reduce-scatter
    for got, want in zip(r["losses"], ref, strict=False):
        assert abs(got - want) < 1e-3, (r["losses"], ref)
    assert len(r["losses"]) == 3
    full = gpt["fsdp_unsharded_one_full"]  # one rank without room: none skips, all stay in step
    assert full["accumulating"] == [False] * 3 and full["reduce_scatters"] == [first] * 3, full
    assert full["losses"][:2] == r["losses"][:2] and abs(full["losses"][2] - r["losses"][2]) < 1e-4


def test_a_restored_snapshot_replays_its_steps_exactly(gpt: dict) -> None:
    """The in-memory snapshot (paired trials) under DDP+TP, PP and FSDP: after two steps and another
    (at the doubled batch where pp = 1), restoring it repeats the same two steps bit for bit (GPT only)."""
    assert sorted(gpt["snapshot"]) == ["ddp-tp", "fsdp", "pp"]
    for layout, r in gpt["snapshot"].items():
        assert len(r["first"]) == 2 and r["first"][0] != r["first"][1], (layout, r)
        assert r["replay"] == r["first"], (layout, r)
