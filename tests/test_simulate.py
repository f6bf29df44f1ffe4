"""`cona simulate`: Kaplan's law, the simulated world driving the real policies, the optimum sequence
and the command's output and refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cona_cli.app import app
from cona_cli.control.cona_policy import ConaPolicy
from cona_cli.planner.hardware import load_hardware
from cona_cli.simulate.law import KaplanDynamics, KaplanLaw
from cona_cli.simulate.replay import NotReplayable, Replay, replay
from cona_cli.simulate.world import Curve, Simulation, WorldSpec
from cona_core.config import config_from_dict
from cona_core.strategy import resizable
from tests.support import REPO, TINY, RecordedEvents, write_config

runner = CliRunner()


def test_kaplan_law_values() -> None:
    law = KaplanLaw(n_params=1.2e9, seq_len=2048)
    floor = (8.8e13 / 1.2e9) ** 0.076
    assert law.loss_floor() == pytest.approx(floor)
    assert law.loss(2.1e3) == pytest.approx(floor + 1.0)  # S_min = S_c
    assert math.isinf(law.loss(0))
    assert law.critical_batch(3.0) == pytest.approx(2e8 / 3.0 ** (1 / 0.21) / 2048)
    b_crit = law.critical_batch(3.0)
    assert law.progress(round(b_crit), 3.0) == pytest.approx(0.5, rel=0.01)  # at B = B_crit half a step
    assert law.critical_batch(2.5) > law.critical_batch(3.0)  # the critical batch grows as the loss falls


def test_curve_time_to_interpolates_between_steps() -> None:
    curve = Curve(times=[0.0, 1.0, 2.0, 3.0], losses=[math.inf, 5.0, 4.0, 3.0])
    assert curve.time_to(5.0) == 1.0
    assert curve.time_to(3.5) == pytest.approx(2.5)
    assert curve.time_to(2.0) is None


def test_curve_time_evaluated_is_linear_in_loss_between_evaluations() -> None:
    curve = Curve(evals=[(0.0, math.inf), (1.0, 6.0), (3.0, 4.0)])
    assert curve.time_evaluated(6.5) == 1.0  # the first finite evaluation is below it already
    assert curve.time_evaluated(5.5) == pytest.approx(1.5)
    assert curve.time_evaluated(3.0) is None


def _tiny_doc(gbs_max: int) -> dict:
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["train"] = {**doc["train"], "max_steps": None, "max_time": 3600}  # the policy pays back within it
    doc["search"] = {"gbs_min": 8, "gbs_max": gbs_max, "mbs": [2, 4, 8]}
    return doc


def _tiny_sim(noise: float = 0.0) -> Simulation:
    doc = _tiny_doc(64)
    cfg = config_from_dict(doc, "tiny")
    shape = ConaPolicy(cfg, load_hardware("cpu-local")).workload.shape
    law = KaplanDynamics(KaplanLaw(shape.n_layers * shape.layer_params, cfg.model.seq_len), 8)
    return Simulation(cfg, WorldSpec(law, load_hardware("cpu-local"), noise=noise, max_time=3600.0))


def test_a_launch_pays_its_measured_first_steps() -> None:
    """A strategy whose runs' first steps took 0.7 s beyond steady ones: its static run starts that much
    later, and a relaunch into it costs that instead of one step."""
    plain = _tiny_sim()
    s8, s16 = plain.best_at(8), plain.best_at(16)
    spec = plain.spec
    slow = Simulation(plain.cfg, WorldSpec(spec.dynamics, spec.truth, noise=0.0, warmup_s={s8: 0.7}, max_time=3600.0))
    stop = slow.spec.dynamics.floor() + 3.0
    assert slow.static(s8, stop, seed=0).times[1] == pytest.approx(plain.static(s8, stop, seed=0).times[1] + 0.7)
    assert slow.switch_cost(s16, s8, in_place=False) == pytest.approx(
        plain.switch_cost(s16, s8, False) - plain.true_time[s8] + 0.7
    )


def test_the_optimum_is_at_least_as_fast_as_every_rung_and_switches_up() -> None:
    sim = _tiny_sim()
    floor = sim.spec.dynamics.floor()
    targets = [floor + 3.0, floor + 1.5, floor + 0.8]
    optimum = sim.optimum(min(targets))
    for g in sim.ladder:
        static = sim.static(sim.best_at(g), min(targets), seed=0)
        for loss in targets:
            t_opt, t_static = optimum.time_to(loss), static.time_to(loss)
            assert t_opt is not None
            assert t_static is None or t_opt <= t_static * (1 + 1e-9), (g, loss)
    gbs = [a.gbs for _, a, _ in optimum.switches] + [optimum.switches[-1][2].gbs]
    assert gbs == sorted(gbs) and len(set(gbs)) > 1  # climbs as the critical batch grows


def test_the_costed_optimum_lies_between_the_free_one_and_every_static_and_pays_for_its_switches() -> None:
    sim = _tiny_sim()
    stop = sim.spec.dynamics.floor() + 0.8
    free = sim.optimum(stop).time_to(stop)
    zero = dataclasses.replace(sim.spec, relaunch_s=0.0, storage_gbs=1e12)  # switches cost one step at most
    at_no_cost = Simulation(sim.cfg, zero).optimum_with_costs(stop, in_place=True).time_to(stop)
    assert at_no_cost == pytest.approx(free, rel=0.01)  # the programme finds the greedy sequence
    costed = Simulation(sim.cfg, dataclasses.replace(sim.spec, relaunch_s=1.0)).optimum_with_costs(stop, False)
    t = costed.time_to(stop)
    statics = [sim.static(sim.best_at(g), stop, seed=0).time_to(stop) for g in sim.ladder]
    assert free < t < min(s for s in statics if s is not None)  # a relaunch of ~1 s: one switch still pays
    assert 0 < len(costed.switches) < len(sim.optimum(stop).switches)  # fewer than the free optimum's
    assert costed.losses[-1] <= stop + 1e-9
    dear = Simulation(sim.cfg, dataclasses.replace(sim.spec, relaunch_s=1e6)).optimum_with_costs(stop, False)
    assert dear.switches == []  # a switch dearer than any gain: one rung throughout


def test_the_real_policy_runs_in_the_world_and_a_seed_reproduces() -> None:
    sim = _tiny_sim(noise=0.05)
    stop = sim.spec.dynamics.floor() + 0.8
    cfg, hw = sim.cfg, load_hardware("cpu-local")
    first = sim.run(ConaPolicy(cfg, hw), stop, seed=3)
    again = sim.run(ConaPolicy(cfg, hw), stop, seed=3)
    assert first.times == again.times and first.switches == again.switches
    assert first.losses[-1] <= stop and first.switches  # reached the target, having climbed
    assert all(b.gbs > a.gbs for _, a, b in first.switches[:1])


def _cli(tmp_path: Path, *args: str) -> object:
    return runner.invoke(app, ["simulate", str(write_config(tmp_path / "tiny.yaml", _tiny_doc(32))), *args])


def test_cona_simulate_prints_the_preflight_and_the_table(tmp_path: Path) -> None:
    result = _cli(tmp_path, "--targets", "3000,1500", "--seeds", "2", "--max-time", "3600")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "samples/s per rung:" in out and "16 beats 8 at GNS >" in out
    for row in (
        "| cona |",
        "| static-auto (",
        "| static-8 (",
        "| static-32 (",
        "| optimum sequence (free switches) |",
        "| optimum sequence (switch costs charged) |",
        "| costed optimum vs cona |",
    ):
        assert row in out, out
    assert "| cona vs best static |" in out and "cona's switches (seed 0):" in out


def test_cona_simulate_json(tmp_path: Path) -> None:
    result = _cli(tmp_path, "--targets", "3000", "--seeds", "2", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["targets"] == [3000.0] and out["seeds"] == 2
    assert set(out["times_s"]) >= {"cona", "optimum sequence (free switches)"}
    for name, per_seed in out["times_s"].items():  # one row per seed (the optimum has no noise: one)
        assert len(per_seed) == (1 if name.startswith("optimum") else 2) and all(len(r) == 1 for r in per_seed)


@pytest.mark.parametrize(
    "args,message",
    [
        ((), "--targets: give perplexities (the config has no train.target_ppl)"),
        (("--targets", "big"), "--targets: 'big' is not a comma-separated list of numbers"),
        (("--targets", "0.5"), "perplexities must be > 1"),
        (("--targets", "100", "--true-kappa", "0"), "--true-kappa: must be > 0"),
        (("--targets", "100", "--truth", "no-such-profile"), "no-such-profile"),
        (
            (
                "--targets",
                "1.01",
            ),
            "--targets: ppl 1.01 is below the law's floor for this model",
        ),
    ],
)
def test_cona_simulate_refuses_bad_input_in_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    result = _cli(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_the_paper_configs_simulate() -> None:
    cfg_path = REPO / "configs" / "gpt3-1.3b-a6000.yaml"
    result = runner.invoke(app, ["simulate", str(cfg_path), "--seeds", "1", "--json"])
    assert result.exit_code == 0, result.output
    times = json.loads(result.stdout)["times_s"]
    assert all(t is not None for t in times["optimum sequence (free switches)"][0])


def test_cona_simulate_plot_writes_a_png_or_refuses_an_unwritable_path(tmp_path: Path) -> None:
    out = tmp_path / "figs" / "sim.png"
    result = _cli(tmp_path, "--targets", "3000", "--seeds", "1", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    (tmp_path / "file").write_text("")
    refused = _cli(tmp_path, "--targets", "3000", "--seeds", "1", "--plot", str(tmp_path / "file" / "sim.png"))
    assert refused.exit_code != 0 and "--plot: cannot write" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_the_ceiling_bounds_any_rung_over_every_noise_scale() -> None:
    from cona_cli.planner.ceiling import ceiling

    rates = {8: 60.0, 16: 104.0, 32: 180.0}  # samples/s; the static pick at 16
    top = ceiling(rates, 16)
    assert (top.rung, top.ratio) == (32, pytest.approx(180 / 104)) and top.pays  # at a large GNS
    low = ceiling(rates, 32)
    assert low.rung == 8 and low.ratio == pytest.approx((60 / 8) / (180 / 32))  # steps/s, at GNS 0
    flat = ceiling({8: 100.0, 16: 102.0}, 8)
    assert not flat.pays and "at most 1.02× over the offline planner's pick (gbs 8) here" in flat.verdict()
    assert "stay static" in flat.verdict()


def test_train_says_at_start_when_chaining_cannot_pay(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cona_cli.commands.train_command import _warn_if_chaining_cannot_pay

    one_rung = {**_tiny_doc(8), "policy": "cona"}
    cfg = config_from_dict(one_rung, "tiny")
    _warn_if_chaining_cannot_pay(cfg)
    assert "cona: note: chaining can gain at most 1× over" in capsys.readouterr().err
    _warn_if_chaining_cannot_pay(config_from_dict({**_tiny_doc(64), "policy": "cona"}, "tiny"))
    assert capsys.readouterr().err == ""  # a ladder that can pay: nothing said
    dry = runner.invoke(app, ["train", str(write_config(tmp_path / "one.yaml", one_rung)), "--dry-run"])
    assert dry.exit_code == 0 and "chaining: chaining can gain at most 1× over" in dry.stdout, dry.output


@pytest.mark.parametrize("factor", [0.7, 2.5])
def test_cona_probes_a_resizable_rung_the_model_mispredicts_once(
    factor: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A world where the resizable gbs-16 strategy runs `factor` x the model's time: cona tries it once on
    its hopeful end (the model's time alone would not have paid); a 0.7x one is kept, a 2.5x one (0.75x gbs
    8's samples per second; the model has it at 1.88x) left once its own steps are measured."""
    import cona_cli.simulate.world as world

    monkeypatch.setattr(world, "DecisionLog", RecordedEvents)
    doc = _tiny_doc(16)
    cfg = config_from_dict(doc, "tiny")
    hw = load_hardware("cpu-local")
    shape = ConaPolicy(cfg, hw).workload.shape
    law = KaplanDynamics(KaplanLaw(shape.n_layers * shape.layer_params, cfg.model.seq_len), 8, true_kappa=4.0)
    plain = Simulation(cfg, WorldSpec(law, hw, noise=0.0, max_time=3600.0))
    start = ConaPolicy(cfg, hw).first().strategy
    sixteen = next(s for s in plain.space if s.gbs == 16 and resizable(start, s) and s.mbs == 2 * start.mbs)
    measured = {s: [t] for s, t in plain.true_time.items() if s.gbs == 8}
    measured[sixteen] = [plain.true_time[sixteen] * factor]
    sim = Simulation(cfg, WorldSpec(law, hw, noise=0.0, measured=measured, max_time=60.0))  # a minute is enough
    policy = ConaPolicy(cfg, hw)
    curve = sim.run(policy, sim.spec.dynamics.floor() + 0.8, seed=0)
    # taken on its hopeful end: at the model's time it would not pay (the confident rule would not try it)
    probes = [r for r in policy.events.decisions() if r["switch"] and not r["measured"] and r["ratio"] < 1.0]
    assert len(probes) == 1 and probes[0]["candidate"] == sixteen.to_dict(), curve.switches
    first, after = curve.switches[0], curve.switches[1:2]
    assert first[2] == sixteen
    if factor < 1:
        assert after == [] or after[0][0] - first[0] > 10 * plain.true_time[sixteen]  # kept beyond the dwell
    else:
        # left once gbs 16's measured steps say so: the dwell and a few decisions, not the noise scale
        assert after[0][2].gbs == 8 and after[0][0] - first[0] < 40 * factor * plain.true_time[sixteen]


def test_a_replay_finds_the_first_decision_that_differs() -> None:
    same = {"step": 10, "switch": False, "candidate": {"gbs": 16}, "ratio": 1.02, "ratio_judged": 0.9, "time": 3.0}
    moved = {**same, "step": 15}
    assert Replay([same, moved], [{**same, "time": 9.0}, moved]).first_difference is None  # run time is not compared
    assert Replay([same, moved], [same, {**moved, "ratio_judged": 1.01}]).first_difference == 1
    assert Replay([same, moved], [same]).first_difference == 1


def test_replay_refuses_what_one_uninterrupted_cona_run_did_not_record(tmp_path: Path) -> None:
    with pytest.raises(NotReplayable, match="not a run directory"):
        replay(tmp_path)
    (tmp_path / "config.resolved.json").write_text(json.dumps({**TINY, "policy": "static"}))
    with pytest.raises(NotReplayable, match="policy static"):
        replay(tmp_path)
    (tmp_path / "config.resolved.json").write_text(json.dumps({**_tiny_doc(64), "policy": "cona"}))
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "resume", "step": 4, "time": 1.0}) + "\n")
    with pytest.raises(NotReplayable, match="resumed or restarted"):
        replay(tmp_path)
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "standby", "launch": 2, "time": 1.0}) + "\n")
    with pytest.raises(NotReplayable, match="standby events name no step"):
        replay(tmp_path)
