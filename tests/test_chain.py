"""The hindsight chain of fixed runs and a chain along a path picked elsewhere, against hand computation."""

from __future__ import annotations

import math

import pytest

from cona_cli.report.chain import chain_along, fastest_chain


def curve(*points: tuple[float, float]) -> list[tuple[float, float]]:
    return [(t, math.log(ppl)) for t, ppl in points]


# Two slices of log-ppl from 200 to 50 (levels=2): 200 → 100 and 100 → 50.
A = curve((0, 200), (10, 100), (20, 50))  # 10 s and 10 s
B = curve((0, 200), (12, 100), (18, 50))  # 12 s and 6 s


def test_the_chain_crosses_each_slice_with_the_run_fastest_there() -> None:
    time, path = fastest_chain({"a": A, "b": B}, 50, levels=2)
    assert time == pytest.approx(10 + 6)
    assert [name for name, _ in path] == ["a", "b"]
    assert path[1][1] == pytest.approx(100)  # b from ppl 100 on


def test_a_chain_needs_every_slice_crossed() -> None:
    assert fastest_chain({"a": A, "b": B}, 40, levels=2) == (None, [])


def test_a_path_picked_elsewhere_is_timed_on_these_runs() -> None:
    # the path b then a (from ppl 100), on A and B: b's 12 s to ppl 100, then a's 10 s to 50
    assert chain_along({"a": A, "b": B}, 50, [("b", 200.0), ("a", 100.0)], levels=2) == pytest.approx(22)
    # at a finer grid the same path gives the same time: each run is linear between its evaluations
    assert chain_along({"a": A, "b": B}, 50, [("b", 200.0), ("a", 100.0)]) == pytest.approx(22)
    # a path that starts below these runs' top runs its first run from the top
    assert chain_along({"a": A, "b": B}, 50, [("a", 150.0)], levels=2) == pytest.approx(20)


def test_a_path_through_a_run_these_seeds_lack_has_no_time() -> None:
    assert chain_along({"a": A}, 50, [("a", 200.0), ("b", 100.0)], levels=2) is None
