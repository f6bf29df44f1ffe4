"""launch/worker.py stays in small pieces: no function longer than 40 lines, and the step's all-reduce is
StepControl's (launch.step_control), not the worker's own."""

from __future__ import annotations

import ast

from tests.support import REPO

WORKER = REPO / "launch" / "worker.py"
MAX_LINES = 40


def test_no_function_of_the_worker_is_longer_than_40_lines() -> None:
    tree = ast.parse(WORKER.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = {f.name: f.end_lineno - f.lineno + 1 for f in functions if f.end_lineno - f.lineno + 1 > MAX_LINES}
    assert functions and not long, long


def test_the_worker_calls_no_collective_of_its_own() -> None:
    calls = [n for n in ast.walk(ast.parse(WORKER.read_text())) if isinstance(n, ast.Call)]
    assert not [ast.unparse(c.func) for c in calls if ast.unparse(c.func).startswith("dist.all_reduce")]
