"""A standby builds the strategy the controller expects while it waits, and every rank builds the same
one exactly once (its collectives must stay in step), even a rank that never saw the prepare file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cona_core.rundir import RunDir, handover_seal
from cona_core.strategy import Strategy
from launch.standby import wait_for_handover

DP2 = Strategy.parse("dp2-tp1-pp1-mbs2-gbs16")
TP2 = Strategy.parse("dp1-tp2-pp1-mbs2-gbs16")


def _run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path)
    run.launches.mkdir(parents=True)
    return run


TOKEN = "this controller's token"


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONA_TELEMETRY_TOKEN", TOKEN)  # what the controller that started the standby gave it


def _write(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc))


def _handover(run: RunDir, launch: int, doc: dict, token: str = TOKEN) -> None:
    """A hand-over as the controller writes it: for `launch`, sealed with its telemetry token."""
    _write(run.handover(launch), {**doc, "launch": launch, "seal": handover_seal(token, launch)})


class Builds(list):
    """A `prepare` that records what it was asked to build and returns a token for it."""

    def __call__(self, strategy: Strategy) -> str:
        self.append(strategy)
        return f"layout {strategy}"


def test_the_prepared_strategy_is_built_once_and_comes_with_the_handover(tmp_path: Path) -> None:
    run, builds = _run(tmp_path), Builds()
    _write(run.prepare(2), {"strategy": str(DP2)})
    _handover(run, 2, {"strategy": str(TP2), "resume": None, "stop_step": None, "prepared": str(DP2)})
    handover = wait_for_handover(run, 2, builds)
    assert builds == [DP2]
    assert handover.layout == f"layout {DP2}" and handover.doc["strategy"] == str(TP2)


def test_a_rank_that_missed_the_prepare_file_builds_what_the_handover_names(tmp_path: Path) -> None:
    run, builds = _run(tmp_path), Builds()
    _handover(run, 2, {"strategy": str(DP2), "resume": None, "stop_step": None, "prepared": str(DP2)})
    assert wait_for_handover(run, 2, builds).layout == f"layout {DP2}"
    assert builds == [DP2]


def test_nothing_is_built_without_an_expectation_on_gpu_or_when_cancelled(tmp_path: Path) -> None:
    run, builds = _run(tmp_path), Builds()
    _handover(run, 2, {"strategy": str(DP2), "resume": None, "stop_step": None, "prepared": None})
    assert wait_for_handover(run, 2, builds).layout is None
    _write(run.prepare(3), {"strategy": str(DP2)})
    _handover(run, 3, {"strategy": str(DP2), "resume": None, "stop_step": None, "prepared": str(DP2)})
    assert wait_for_handover(run, 3, None).layout is None  # GPU ranks get no `prepare`
    _write(run.handover(4), {"cancel": True})
    _write(run.prepare(4), {"strategy": str(DP2)})
    assert wait_for_handover(run, 4, builds) is None
    assert builds == []


def test_a_standby_takes_over_only_its_own_launch_from_its_own_controller(tmp_path: Path) -> None:
    """A hand-over naming another launch, or sealed by another controller of the run (a resumed one, whose
    telemetry token this orphaned standby does not have), is not taken over: the standby leaves."""
    run, builds = _run(tmp_path), Builds()
    doc = {"strategy": str(DP2), "resume": None, "stop_step": None, "prepared": str(DP2)}
    _write(run.handover(2), {**doc, "launch": 3, "seal": handover_seal(TOKEN, 3)})
    assert wait_for_handover(run, 2, builds) is None
    _handover(run, 2, doc, token="a later controller's token")
    assert wait_for_handover(run, 2, builds) is None
    _write(run.handover(2), doc)  # unsealed
    assert wait_for_handover(run, 2, builds) is None
    assert builds == []
    _handover(run, 2, doc)
    assert wait_for_handover(run, 2, builds) is not None and builds == [DP2]
