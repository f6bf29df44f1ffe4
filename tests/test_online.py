"""The online policy on scripted telemetry: climbs when Φ says so, and undoes a move that did not pay."""

from __future__ import annotations

from dataclasses import replace

from cona_cli.config import config_from_dict
from cona_cli.control.cona_policy import ConaPolicy
from cona_cli.control.policies import Stage
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.search import Candidate
from cona_cli.strategy import Strategy, resizable
from tests.support import TINY


class Events:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, kind: str, **fields: object) -> dict:
        self.rows.append({"kind": kind, **fields})
        return self.rows[-1]


def _policy(**search: object) -> tuple[ConaPolicy, Events]:
    doc = {k: v for k, v in TINY.items() if k != "strategy"}
    doc["search"] = {
        "gbs_min": 8,
        "gbs_max": 32,
        "mbs": [2, 4, 8],
        "switch_cost_s": 1.0,
        "horizon_s": 600,
        "decision_every": 2,
        "min_steps": 2,
        **search,
    }
    policy = ConaPolicy(config_from_dict(doc, "test"), load_hardware("cpu-local"))
    policy.events = Events()
    return policy, policy.events


def _feed(
    policy: ConaPolicy,
    launch: int,
    first_step: int,
    n: int,
    iter_s: float,
    gns: float,
    clock: list[float] | None = None,
):
    """Steps of `iter_s` seconds; with a `clock` ([run time]), each row carries the run time it advances."""
    for step in range(first_step, first_step + n):
        row = {"kind": "step", "step": step, "launch": launch, "iter_s": iter_s, "gns": gns}
        if clock is not None:
            clock[0] += iter_s
            row["time"] = clock[0]
        stage = policy.on_metric(row)
        if stage is not None:
            return step, stage
        policy.wait_for_search()  # deterministic test: let each background search finish
    return None, None


def test_stays_while_gns_is_small_then_climbs_and_undoes_a_bad_move() -> None:
    policy, events = _policy()
    start = policy.first().strategy
    assert start.gbs == 8
    t8 = 0.05
    step, stage = _feed(policy, 1, 1, 20, t8, gns=0.01)  # no noise: bigger batches only cost time
    assert stage is None
    decisions = [e for e in events.rows if e["kind"] == "decision" and "ratio" in e]
    assert decisions and all(not e["switch"] and e["ratio"] < 1.01 for e in decisions)
    assert policy.expected_next().to_dict() == decisions[-1]["candidate"]  # what a standby would build ahead

    step, stage = _feed(policy, 1, 21, 20, t8, gns=1e5)  # noise dominates: throughput decides
    assert stage is not None and stage.strategy.gbs == 16 and stage.reason == "decision"
    chosen = events.rows[-1]
    assert chosen["switch"] and chosen["ratio"] > chosen["needed"] and chosen["candidate_kind"] == "next_gbs"
    assert policy.after_launch({"step": step}, stage) == stage
    assert policy.expected_next() is None  # until the new rung's first decision names a candidate

    # The new rung turns out 5x slower per step than the old one: going back is measured, not guessed.
    step, back = _feed(policy, 2, step + 1, 20, 5 * t8 * 2, gns=1e5)
    assert back is not None and back.strategy == start
    assert events.rows[-1]["candidate_kind"] == "previous_gbs"
    policy.after_launch({"step": step}, back)
    assert policy.current.strategy == start and policy.previous == []
    state = policy.state_dict()
    assert str(stage.strategy) in state["samples"]  # the bad rung's real speed is remembered


def test_a_falling_gns_alone_does_not_move_down() -> None:
    """Only Φ moves down: the GNS estimate falling after a climb (early noise, EMA lag) is no reason
    to leave a rung that still has the higher Φ at the current estimate."""
    policy, _ = _policy(gbs_max=16)  # two rungs: the only move left is down
    step, up = _feed(policy, 1, 1, 40, 0.05, gns=1e5)
    assert up is not None and up.strategy.gbs == 16
    policy.after_launch({"step": step}, up)
    falling = [_feed(policy, 2, step + 1 + i, 1, 0.05, gns=1e5 * 0.9**i)[1] for i in range(40)]
    assert falling == [None] * 40  # 40 falling estimates, each still far above both batch sizes
    assert policy.current.strategy == up.strategy


def test_lookahead_lets_one_switch_climb_two_rungs() -> None:
    for lookahead, gbs, kind in ((1, 16, "next_gbs"), (2, 32, "next_gbs+1")):
        policy, events = _policy(lookahead=lookahead, kappa=1.0)
        _, stage = _feed(policy, 1, 1, 40, 0.05, gns=1e5)  # noise dominates: the most samples/s wins
        assert stage is not None and stage.strategy.gbs == gbs, (lookahead, stage)
        chosen = events.rows[-1]
        assert chosen["candidate_kind"] == kind and chosen["kappa"] == 1.0


def test_before_any_evidence_kappa_auto_is_one_and_logs_the_whole_range_as_its_interval() -> None:
    policy, events = _policy(kappa="auto")
    _feed(policy, 1, 1, 6, 0.05, gns=4.0)
    decisions = [e for e in events.rows if e["kind"] == "decision"]
    assert decisions and all(e["kappa"] == 1.0 and e["kappa_interval"] == [0.25, 32.0] for e in decisions)


def test_step_times_taken_while_a_standby_imports_are_not_the_strategys() -> None:
    policy, _ = _policy()
    start = policy.first().strategy
    policy.standby_importing = True  # the controller just started a standby beside the job
    _feed(policy, 1, 1, 10, 0.5, gns=0.01)
    assert policy.samples.get(start, []) == []
    policy.standby_importing = False
    _feed(policy, 1, 11, 10, 0.05, gns=0.01)
    assert policy.samples[start] == [0.05] * 10


def test_back_on_a_rung_it_decides_only_on_fresh_steps() -> None:
    """A strategy visited before keeps its times, but a decision after the switch back waits for
    min_steps timed steps of the new launch (its earlier times may be hours old, or taken beside a standby)."""
    policy, events = _policy(min_steps=4, decision_every=1)
    _feed(policy, 1, 1, 10, 0.05, gns=0.01)
    policy.standby_importing = True  # launch 2 starts beside a standby: its steps are not timed
    before = len([e for e in events.rows if e["kind"] == "decision"])
    _feed(policy, 2, 11, 8, 0.05, gns=0.01)
    assert len([e for e in events.rows if e["kind"] == "decision"]) == before  # old samples alone: no decision
    policy.standby_importing = False
    _feed(policy, 2, 19, 3, 0.05, gns=0.01)  # 3 timed steps: still none
    assert len([e for e in events.rows if e["kind"] == "decision"]) == before
    _feed(policy, 2, 22, 1, 0.05, gns=0.01)  # the 4th
    assert len([e for e in events.rows if e["kind"] == "decision"]) == before + 1


def test_an_unmeasured_rung_is_never_faster_than_the_measured_trend_of_its_layout() -> None:
    """gbs 8 and 16 measured at 0.15 and 0.25 s put gbs 32 (same dp, tp, pp) on a line at 0.45 s: a
    model prediction of 0.39 s is raised to it, a slower one stands, a layout without a trend keeps its own."""
    policy, _ = _policy()
    s8, s16 = Strategy(4, 1, 1, 2, 8), Strategy(4, 1, 1, 4, 16)
    policy.samples = {s8: [0.15] * 10, s16: [0.25] * 10}
    s32 = Strategy(4, 1, 1, 8, 32)
    assert abs(policy._optimistic_time(Candidate(s32, 0.39, 0.01, 0.0, 0.0), 0.25) - 0.45) < 1e-9
    assert policy._optimistic_time(Candidate(s32, 0.60, 0.0, 0.0, 0.0), 0.25) == 0.60
    other = Strategy(2, 2, 1, 8, 32)  # no measured trend of its own
    assert policy._optimistic_time(Candidate(other, 0.39, 0.0, 0.0, 0.0), 0.25) == 0.39


def test_a_batch_only_switch_is_costed_as_a_resize_not_a_relaunch() -> None:
    """A relaunch that cannot pay back (100 s in a 120 s horizon) still leaves the resize into the next
    rung's batch under the same layout, costed 0 until measured, then at the measured resizes; after a
    resize the policy decides only on fresh steps of the new batch. Without in-place resizes it stays."""
    costly = {"switch_cost_s": 100.0, "warm_switch_cost_s": 100.0, "horizon_s": 120, "kappa": 1.0}
    policy, events = _policy(**costly)
    start = policy.first().strategy
    bigger = replace(start, mbs=start.mbs * 2, gbs=start.gbs * 2)
    assert resizable(start, bigger) and policy.switch_cost(bigger) == 0.0
    assert policy.switch_cost(Strategy(1, 1, 4, 2, 16)) == 100.0  # a new layout: a relaunch
    step, stage = _feed(policy, 1, 1, 40, 0.05, gns=1e5)  # noise dominates: the most samples/s wins
    assert stage is not None and resizable(start, stage.strategy) and stage.strategy.gbs == 16, stage
    assert events.rows[-1]["switch_cost_s"] == 0.0
    policy.resized(stage, 0.02)
    assert policy.current == stage and policy.previous == [start]
    assert policy.switch_cost(replace(stage.strategy, gbs=32, mbs=stage.strategy.mbs * 2)) == 0.02
    decisions = len([e for e in events.rows if e["kind"] == "decision"])
    _feed(policy, 1, step + 1, 3, 0.08, gns=1e5)  # 2 warm-up steps and 1 timed one of the new batch: no decision
    assert len([e for e in events.rows if e["kind"] == "decision"]) == decisions
    assert policy.state_dict()["resize_costs"] == [0.02]

    relaunching, _ = _policy(**costly, in_place=False)
    assert relaunching.switch_cost(bigger) == 100.0
    assert _feed(relaunching, 1, 1, 40, 0.05, gns=1e5) == (None, None)


def _climb_then_measure_slow(policy: ConaPolicy, t8: float, clock: list[float]) -> tuple[int, Strategy]:
    """gbs 8 climbs to 16 in place, whose first steps run slow (a slow spell of the host): it goes back."""
    step, up = _feed(policy, 1, 1, 40, t8, gns=1e5, clock=clock)  # noise dominates: samples/s decide
    assert up is not None and up.strategy.gbs == 16
    policy.resized(up, 0.3)
    step, back = _feed(policy, 1, step + 1, 20, 3 * t8, gns=1e5, clock=clock)  # fewer samples/s than gbs 8
    assert back is not None and back.strategy.gbs == 8
    policy.resized(back, 0.3)
    return step, up.strategy


def test_a_rung_measured_in_a_slow_spell_is_measured_again_after_remeasure_s() -> None:
    """Seed 1242 of the README's run: gbs 16 measured slow in its first steps sent the run back to 8
    and, at that stale median, kept it there for 170 s. With `search.remeasure_s` its times are
    forgotten, it competes at its prediction again, is re-tried (a resize) and, at its real speed, stays."""
    t8 = 0.05
    policy, events = _policy(remeasure_s=10.0)
    clock = [0.0]
    step, s16 = _climb_then_measure_slow(policy, t8, clock)
    assert s16 in policy.samples
    step, again = _feed(policy, 1, step + 1, 400, t8, gns=1e5, clock=clock)  # 20 s at gbs 8
    assert again is not None and again.strategy == s16, again
    chosen = events.rows[-1]
    assert chosen["candidate_kind"] == "next_gbs" and chosen["candidate_t"] < 2 * t8  # predicted, not 3 * t8
    assert s16 not in policy.samples and policy.forgotten[s16] == 3 * t8  # its slow times were forgotten
    policy.resized(again, 0.3)
    step, moved = _feed(policy, 1, step + 1, 100, 1.5 * t8, gns=1e5, clock=clock)  # its real speed
    assert moved is None or moved.strategy.gbs == 32  # not back to 8: on, if anywhere
    assert policy.samples[s16][-1] == 1.5 * t8 and s16 not in policy.forgotten

    stale, _ = _policy(remeasure_s=0.0)  # the previous behaviour: the slow median stands
    clock = [0.0]
    step, _ = _climb_then_measure_slow(stale, t8, clock)
    assert _feed(stale, 1, step + 1, 400, t8, gns=1e5, clock=clock) == (None, None)


def test_after_remeasure_s_the_rung_climbed_from_competes_at_its_prediction() -> None:
    """Going down is measured too: once the lower rung's times are forgotten, its best layout competes
    at its (optimistic) prediction, and moving there pops it from the rungs climbed from."""
    t8 = 0.05
    policy, events = _policy(remeasure_s=5.0, gbs_max=16)  # no rung above 16
    clock = [0.0]
    step, up = _feed(policy, 1, 1, 40, t8, gns=1e5, clock=clock)
    assert up is not None and up.strategy.gbs == 16
    policy.resized(up, 0.3)
    assert _feed(policy, 1, step + 1, 100, 1.5 * t8, gns=1e5, clock=clock) == (None, None)  # 7.5 s at gbs 16
    assert policy.previous[-1] not in policy.samples and policy.previous[-1] in policy.forgotten
    _, down = _feed(policy, 1, step + 101, 40, 1.5 * t8, gns=0.01, clock=clock)  # no noise: the shorter step wins
    chosen = events.rows[-1]
    assert down is not None and down.strategy.gbs == 8 and chosen["candidate_kind"] == "previous_gbs"
    assert chosen["candidate_t"] != t8  # a prediction, not the forgotten median
    policy.resized(down, 0.3)
    assert policy.previous == [] and policy.current == down


def test_forgetting_a_rung_leaves_the_predictions_of_the_other_rungs_alone() -> None:
    """Forgotten times no longer price their own strategy, but still calibrate the model for the others:
    without them gbs 64 would be predicted from gbs 32 alone, with the uncalibrated model's wide std,
    and its optimistic time sent runs up to 64 and 128 on a 5 % margin (an earlier version of this rule)."""
    s8, s16, s32 = Strategy(4, 1, 1, 2, 8), Strategy(4, 1, 1, 4, 16), Strategy(4, 1, 1, 8, 32)
    results = []
    for forget in (False, True):
        policy, _ = _policy(remeasure_s=5.0, gbs_max=64)
        policy.samples = {s8: [0.15] * 10, s16: [0.25] * 10, s32: [0.45] * 10}
        policy.timed_at = {s8: 1.0, s16: 2.0, s32: 100.0}
        policy.current, policy.previous = Stage(s32, None, "decision"), [s8, s16]
        if forget:
            policy._forget_stale(100.0)
            assert set(policy.forgotten) == {s8, s16} and list(policy.samples) == [s32]
        policy._maybe_search()
        policy.wait_for_search()
        results.append(policy._results)
    kept, forgot = results
    assert forgot[64].best.time_s == kept[64].best.time_s and forgot[64].best.time_std == kept[64].best.time_std
    assert 16 not in kept and forgot[16].best.time_s != 0.25  # the rung climbed from: searched once forgotten
