"""Shared fixtures: corpora cached per test session, and a prepared tiny run folder."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from cona_core.config import config_from_dict
from tests.support import TINY

# One intra-op thread per process, torch in the test processes and every rank they start (the controller keeps
# a set OMP_NUM_THREADS): two pytest workers share the machine's cores, and OpenMP threads stall on a loaded
# machine (a one-rank trial with two threads took 159 s for 2 s of steps beside another test's job, 21 s with one).
os.environ["OMP_NUM_THREADS"] = "1"


# Modules by their time in the suite on a 2-core host (`pytest --durations`), heaviest first: `make test`
# hands whole modules to two workers in collection order (--dist loadscope --no-loadscope-reorder), and
# with the long ones first both workers end together instead of one finishing a long module alone.
HEAVIEST_FIRST = [
    "test_layouts",
    "test_multinode",
    "test_scripts",
    "test_fault_tolerance",
    "test_train_e2e",
    "test_export",
    "test_gns",
    "test_data_formats",
    "test_standby",
    "test_checkpoint_policy",
    "test_simulate",
    "test_gpu_paths",
    "test_precision",
    "test_readme",
    "test_data",
    "test_tune_lr",
    "test_requeue",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items[:] = sorted(items, key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).stem, len(rank)))


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


# Scripts that start torchrun jobs themselves (their --help does not).
JOB_SCRIPTS = {
    "chaos.py",
    "bench_switch.py",
    "bench_checkpoint.py",
    "bench_layouts.py",
    "bench_layouts_ranks.py",
    "bench_gns_overhead.py",
    "bench_lr_attribution.py",
    "gpu_checks.py",
}
JOB_MODULES = {"launch.forkrun", "torch.distributed.run", "launch.worker", "launch.standby"}


def starts_a_job(argv: object) -> bool:
    """Whether a command line starts a torchrun job itself: torchrun or cona's agent (`-m MODULE`), a rank's
    module, or a script that runs them (not its --help)."""
    words = [str(a) for a in argv] if isinstance(argv, list | tuple) else str(argv).split()
    if "--help" in words:
        return False
    modules = {b for a, b in itertools.pairwise(words) if a == "-m"}
    scripts = {Path(w).name for w in words if Path(w).parent.name == "scripts"}
    return bool(modules & JOB_MODULES or scripts & JOB_SCRIPTS) or Path(words[0]).name == "torchrun"


@pytest.fixture(autouse=True)
def _no_job_outside_e2e(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test-fast` (-m "not e2e") starts no training job: a test not marked e2e fails when it starts
    torchrun itself, and `cona train` refuses to start a job in it or in any process it runs
    (`CONA_TEST_NO_JOBS`, read where jobs start: `cona_cli.cluster.launchers`)."""
    if request.node.get_closest_marker("e2e") is not None:
        return
    monkeypatch.setenv("CONA_TEST_NO_JOBS", "1")
    original = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        if starts_a_job(args):
            pytest.fail(f"a test not marked e2e starts a torchrun job: {args}", pytrace=False)
        original(self, args, *rest, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
