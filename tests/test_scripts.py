"""scripts/ cannot rot: every script imports against the current code and answers --help; the ones
that can be made tiny run for real (the multi-process ones marked e2e)."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import yaml

from cona_cli.run_config import load_config
from cona_core.config import config_from_dict
from tests.support import REPO, TINY, write_config

SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


def script(name: str) -> Path:
    path = REPO / "scripts" / name
    assert path in SCRIPTS, f"{name} is not in scripts/"
    return path


def run_script(name: str, *args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script(name)), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def number(pattern: str, text: str) -> float:
    """The number the regex's first group captures in text (fails the test, showing text, if absent)."""
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output:\n{text}"
    return float(m.group(1))


def test_the_scripts_folder_is_found() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


def import_script(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module `cona_script_<stem>`, imported without running main()."""
    name = f"cona_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it executes
    monkeypatch.setattr(sys, "argv", [str(path)])  # a script that parsed argv at import would see no args
    monkeypatch.setattr(sys, "path", list(sys.path))  # some scripts put the repository on sys.path
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_as_a_module_without_running(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing resolves every name the script takes from cona_cli, launch and tests; main() does not run."""
    module = import_script(path, monkeypatch)
    assert callable(module.main) and module.main.__module__ == f"cona_script_{path.stem}"


@pytest.fixture(scope="module")
def help_runs() -> Iterator[dict[str, tuple[Path, Future]]]:
    """`SCRIPT --help` of every script, two at a time (most import torch: seconds each), each from its own
    empty folder: script name -> (folder, future of the finished process). The folders are this fixture's
    own, not pytest's basetemp (which concurrent pytest sessions on the machine prune)."""
    with tempfile.TemporaryDirectory(prefix="cona-script-help-") as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        runs = {}
        for path in SCRIPTS:
            cwd = Path(tmp) / path.stem
            cwd.mkdir()
            runs[path.name] = (cwd, pool.submit(run_script, path.name, "--help", cwd=cwd, timeout=120))
        yield runs


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_help_prints_usage_and_runs_nothing(path: Path, help_runs: dict[str, tuple[Path, Future]]) -> None:
    """From a foreign folder: exit 0, usage and the module docstring's first line, no file written."""
    cwd, future = help_runs[path.name]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {path.name}"), proc.stdout[:500]
    first_line = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
    assert " ".join(first_line.split()) in " ".join(proc.stdout.split()), proc.stdout
    assert not list(cwd.iterdir()), list(cwd.iterdir())


# -- smoke runs ------------------------------------------------------------------------------


def test_probe_cpu_overheads_prints_the_profile_figures() -> None:
    proc = run_script("probe_cpu_overheads.py", "--reps", "3", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"forward\+backward by layers: 1: \d+ us, 2: \d+ us, 4: \d+ us, 8: \d+ us", proc.stdout)
    number(r"layer_overhead_us: (-?\d+)", proc.stdout)  # a slope: noise may make it negative at 3 reps
    number(r"microbatch_overhead_us: (-?\d+)", proc.stdout)
    assert number(r"optimizer \(clip \+ AdamW \+ zero_grad, 4 layers\): ([\d.]+) ms", proc.stdout) > 0


def test_bench_search_finds_a_best_strategy_for_every_case() -> None:
    proc = run_script("bench_search.py", cwd=Path("/"))  # the config path is the repository's, not the cwd's
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 6, proc.stdout  # 3 cases x (configured threshold, BO forced)
    for line, (case, how) in zip(lines, [(c, h) for c in ("1.3B", "6.7B", "175B") for h in ("configured", "BO")]):
        assert case in line and how in line, line
        assert re.search(r"best dp\d+-tp\d+-pp\d+-mbs\d+-gbs\d+ [\d.]+ s/iter$", line), line


def ttp_run(run_dir: Path, evals: list[tuple[float, float]], gbs: int, finished: bool = True) -> None:
    """A run folder as bench_ttp reads it: eval rows (time, val_ppl), two step rows, start and exit events."""
    run_dir.mkdir(parents=True)
    strategy = {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": gbs}
    metrics = [
        {"kind": "step", "step": s, "time": 0.1 * s, "loss": 5.0, "iter_s": 0.1, "consumed_samples": s * gbs}
        | strategy
        | {"launch": 1, "wall_clock": 1e9 + s}
        for s in (1, 2)
    ]
    metrics += [
        {"kind": "eval", "step": 10 * i, "time": t, "val_loss": math.log(p), "val_ppl": p, "launch": 1}
        | {"consumed_samples": 10 * i * gbs, "wall_clock": 1e9 + t}
        for i, (t, p) in enumerate(evals)
    ]
    events = [{"kind": "start", "time": 0.0, "wall_clock": 1e9, "policy": "static", "world": 4}]
    if finished:
        events.append({"kind": "exit", "time": 30.0, "wall_clock": 1e9 + 30, "code": 0, "reason": "max_time"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def tabulate(cfg: Path, out: Path, *args: str) -> str:
    """bench_ttp.py --tabulate on the run folders of seed 1 on under `out`: its output (it must succeed)."""
    proc = run_script(
        "bench_ttp.py", "--config", str(cfg), "--out", str(out), "--first-seed", "1", *args, "--tabulate", timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bench_ttp_tabulates_run_folders(tmp_path: Path) -> None:
    """--tabulate on hand-written run folders of seed 1 (ladder 8, 16, 32, 64; static-auto at 32): times to
    target interpolated in log-ppl between evaluations, speed-ups, unfinished runs left out."""
    cfg = write_config(tmp_path / "tiny.yaml", {**TINY, "search": {"gbs_min": 8, "gbs_max": 64, "gbs_static": 32}})
    out = tmp_path / "ttp"
    ttp_run(out / "s1" / "cona", [(0, 200), (10, 100), (20, 50), (30, 25)], 16)
    ttp_run(out / "s1" / "static-auto", [(0, 200), (10, 150), (20, 80), (30, 50)], 32)
    ttp_run(out / "s1" / "static-16", [(0, 200), (10, 100), (20, 75), (30, 50)], 16)
    ttp_run(out / "s1" / "static-8", [(0, 200), (10, 120), (20, 110), (30, 105)], 8)
    ttp_run(out / "s1" / "static-64", [(0, 200), (10, 50)], 64, finished=False)
    ttp_run(out / "s1" / "cona-variant", [(0, 200), (10, 150), (20, 100), (30, 50)], 16)  # a --cona-set run
    table = {"source": "measured", "seed": 1, "noise": None, "relaunch_s": 5.0, "checkpoint_s": 0.1}
    busy = {"table": {"dp4-tp1-pp1-mbs4-gbs16": 0.3}, "busy": {"dp4-tp1-pp1-mbs4-gbs16": 2.5}, "cache": "/c/t.json"}
    (out / "s1" / "static-16" / "clock.json").write_text(json.dumps(table | busy))
    (out / "s1" / "static-auto" / "clock.json").write_text(json.dumps(table | {"table": {"x": 0.2}}))
    text = tabulate(cfg, out, "--targets", "100,50")
    auto_100 = 10 + 10 * math.log(150 / 100) / math.log(150 / 80)  # between (10 s, ppl 150) and (20 s, ppl 80)
    assert "| cona | 10 [10–10] (1/1) | 20 [20–20] (1/1) |" in text, text
    assert f"| static-auto | {auto_100:.3g} [{auto_100:.3g}–{auto_100:.3g}] (1/1) | 30 [30–30] (1/1) |" in text, text
    assert "| static-8 | - (0/1) | - (0/1) |" in text, text
    assert "static-64" not in text  # no exit event: not finished, not tabulated
    up = auto_100 / 10
    assert f"| cona vs static-auto | {up:.3g} [{up:.3g}–{up:.3g}]× | 1.5 [1.5–1.5]× |" in text, text
    assert "| cona vs best static | 1 [1–1]× | 1.5 [1.5–1.5]× |" in text, text  # static-16: 10 s and 30 s
    assert "  cona s1: 1 / 1.5" in text, text
    assert "| cona-variant | 20 [20–20] (1/1) | 30 [30–30] (1/1) |" in text, text  # found without --cona-set
    assert "  cona-variant s1: 0.5 / 1" in text, text
    assert "static-auto 320 [320–320]" in text and "static-16 160 [160–160]" in text, text  # samples/s
    assert "| hindsight chain |" in text, text
    assert "  cona s1: 16; 0 reversals in 30 s: within the bound" in text, text
    assert (
        "WARNING: clock: 1 table entry was calibrated while other work loaded the host, so their steps may be "
        "charged slow: dp4-tp1-pp1-mbs4-gbs16 (load 2.5 per CPU); delete them from /c/t.json" in text
    ), text
    # static-16 is the faster down to ppl 100 (by 10 s), static-auto from there on (ppl 80 by 20 s)
    chain = re.search(r"s1: static-16 \(from 200\) → static-auto \(from ([0-9.]+)\)\n", text)
    assert chain is not None and 100 <= float(chain.group(1)) <= 101, text


def test_bench_ttp_tabulates_static_folders_made_another_way_under_their_recipe(tmp_path: Path) -> None:
    """A `static-NAME-NOTE` folder (a static run made another way) competes for the best static, and for its
    recipe's: `static-16-sqrt-wu` for the sqrt recipe's, `static-16-wu` for the config's own."""
    cfg = write_config(tmp_path / "tiny.yaml", {**TINY, "search": {"gbs_min": 8, "gbs_max": 64, "gbs_static": 32}})
    out = tmp_path / "ttp"
    ttp_run(out / "s1" / "cona", [(0, 200), (20, 100)], 16)
    ttp_run(out / "s1" / "static-auto", [(0, 200), (40, 100)], 32)
    ttp_run(out / "s1" / "static-16-wu", [(0, 200), (10, 100)], 16)
    ttp_run(out / "s1" / "static-16-sqrt-wu", [(0, 200), (16, 100)], 16)
    text = tabulate(cfg, out, "--targets", "100")
    assert "| static-16-wu | 10 [10–10] (1/1) |" in text, text
    assert "| cona vs best static | 0.5 [0.5–0.5]× |" in text, text
    assert "| cona vs best static adascale | 0.5 [0.5–0.5]× |" in text, text
    assert "| cona vs best static sqrt | 0.8 [0.8–0.8]× |" in text, text


def test_bench_ttp_measures_the_chains_noise_with_a_second_seed(tmp_path: Path) -> None:
    """With two seeds: the chain along the other seed's path and the noise floor (each static's fastest seed
    over the chain of its seeds), by hand. The evaluations sit at ppl 200, 100 and 50, so each run crosses
    the slices from 200 to 100 and from 100 to 50 at one speed each."""
    cfg = write_config(tmp_path / "tiny.yaml", {**TINY, "search": {"gbs_min": 8, "gbs_max": 64, "gbs_static": 32}})
    out = tmp_path / "ttp"
    spans = {  # (seconds 200 → 100, 100 → 50) per seed and run
        1: {"static-16": (10, 10), "static-auto": (12, 6)},  # chain 10 + 6: static-16, then static-auto
        2: {"static-16": (14, 6), "static-auto": (9, 10)},  # chain 9 + 6: static-auto, then static-16
    }
    for seed, runs in spans.items():
        for name, (first, second) in runs.items():
            ttp_run(out / f"s{seed}" / name, [(0, 200), (first, 100), (first + second, 50)], 16)
        ttp_run(out / f"s{seed}" / "cona", [(0, 200), (10, 100), (18, 50)], 16)
    text = tabulate(cfg, out, "--seeds", "2", "--targets", "50")
    assert "| hindsight chain | 15.5 [15–16] (2/2) |" in text, text
    # seed 1 along seed 2's path: static-auto's 12 s, static-16's 10 s; seed 2 along seed 1's: 14 + 10
    assert "| chain from another seed | 23 [22–24] (2/2) |" in text, text
    assert "| cona vs chain from another seed | 1.28 [1.22–1.33]× |" in text, text  # 22 / 18 and 24 / 18
    # static-16: fastest seed 20 s, its seeds' chain 10 + 6; static-auto: 18 s against 9 + 6
    assert "the chain's noise floor" in text and "ppl 50 1.22 [1.2–1.25]" in text, text  # median 1.225


def test_bench_ttp_ramps_to_the_best_static_batch_where_it_is_larger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's ramp from the lowest rung in steps of it, over the samples given, ends at gbs_static (32) unless
    the best static run's batch is larger."""
    bench = import_script(script("bench_ttp.py"), monkeypatch)
    ramp = {"policy": "ramp", "train": {"lr": 1e-3}, "search": {"gbs_static": 32, "gbs_min": 8}}
    up = bench.ramp_variant(ramp, 8, 3000, 64)
    assert up["train"] == {"lr": 1e-3, "rampup_batch_size": [8, 8, 3000]}
    assert up["search"] == {"gbs_static": 64, "gbs_min": 8}
    assert bench.ramp_variant(ramp, 8, 3000, 16)["search"]["gbs_static"] == 32
    assert ramp["search"]["gbs_static"] == 32  # the variant it came from is left as it was


def test_bench_ttp_cona_set_adds_a_cona_run_with_its_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cona-set cona-x:search.min_steps=20` (twice for two keys) is a policy-cona run with both overrides;
    the shared document is left as it was; a bad name or value is refused in one line naming the run."""
    bench = import_script(script("bench_ttp.py"), monkeypatch)
    doc = bench.bench_doc(REPO / "configs" / "wikitext2-gpt-tiny.yaml", bench.DEFAULT_DATA, 60.0)
    runs = bench.cona_variants(doc, ["cona-x:search.min_steps=20", "cona-x:search.confidence=0.95"])
    assert list(runs) == ["cona-x"] and runs["cona-x"]["policy"] == "cona"
    assert runs["cona-x"]["search"] == {**doc["search"], "min_steps": 20, "confidence": 0.95}
    assert "min_steps" not in doc["search"] and "policy" not in doc
    bad_values = [("x:search.confidence=0.9", "expected cona-NAME"), ("cona-again:search.confidence=0.9", "-again")]
    for bad, says in bad_values + [("cona-x:search.confidence=2", "confidence")]:
        with pytest.raises(SystemExit, match=says):
            bench.cona_variants(doc, [bad])


def test_bench_ttp_only_refuses_a_name_that_is_not_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--only` keeps the runs it names, in the benchmark's order; a misspelt name is refused, not dropped."""
    bench = import_script(script("bench_ttp.py"), monkeypatch)
    doc = bench.bench_doc(REPO / "configs" / "wikitext2-commheavy.yaml", bench.DEFAULT_DATA, 60.0)
    runs = bench.variants(doc, [8, 16, 32, 64, 128], 32, relaunch=False)
    assert list(bench.only(runs, "static-128-sqrt,cona")) == ["cona", "static-128-sqrt"]
    assert bench.only(runs, "") is runs
    with pytest.raises(SystemExit, match="--only: no run named 'static-128sqrt'"):
        bench.only(runs, "cona,static-128sqrt")


def test_bench_ttp_refuses_a_ramp_without_its_statics(tmp_path: Path) -> None:
    """The ramp's length comes from the seed's static runs: `--only ramp` alone says so and runs nothing."""
    out = run_script("bench_ttp.py", "--config", "configs/tiny.yaml", "--only", "ramp", "--out", str(tmp_path))
    assert out.returncode != 0 and "ramp: needs the static runs of its seed" in out.stderr
    assert not list(tmp_path.glob("s*/ramp"))


def test_bench_ttp_runs_every_config_for_its_whole_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny.yaml stops at max_steps 600 or target_ppl 20: a benchmark run drops both and keeps max_time."""
    bench = import_script(script("bench_ttp.py"), monkeypatch)
    doc = bench.bench_doc(REPO / "configs" / "tiny.yaml", bench.DEFAULT_DATA, 90.0)
    assert doc["train"]["max_time"] == 90.0
    assert "max_steps" not in doc["train"] and "target_ppl" not in doc["train"]
    assert doc["train"]["decay_tokens"] == 3_000_000 and "policy" not in doc


def test_bench_ttp_plans_for_the_hardware_profile_whose_clock_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--clock-table a6000-2x8`: every run plans for that profile (the cona row would otherwise plan for the
    CPU under an A6000's clock), on gloo on a host without GPUs; a `measured` table changes neither."""
    bench = import_script(script("bench_ttp.py"), monkeypatch)
    monkeypatch.setattr(bench, "visible_gpus", lambda: [])
    config = REPO / "configs" / "wikitext2-gpt-tiny.yaml"
    gpu = bench.bench_doc(config, bench.DEFAULT_DATA, 60.0, "virtual", "a6000-2x8")
    assert gpu["train"]["clock_table"] == "a6000-2x8" and gpu["search"]["hardware"] == "a6000-2x8"
    assert gpu["cluster"]["backend"] == "gloo"
    assert config_from_dict(gpu, "bench").search.hardware == "a6000-2x8"  # a valid config
    here = bench.bench_doc(config, bench.DEFAULT_DATA, 60.0, "virtual", "measured")
    own = yaml.safe_load(config.read_text())
    assert here["search"] == own["search"] and here.get("cluster") == own.get("cluster")


def test_bench_ttp_table_from_a_saved_table_is_what_the_runs_are_charged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--table-from FILE`: the measured table that every run of the config reads on this host starts as FILE
    (its entries, charged as they are); an entry this host times otherwise, or a file that is not a
    measured table, is refused in one line naming it."""
    from cona_cli.control.clock_table import clock_spec
    from cona_core.rundir import RunDir
    from cona_core.strategy import Strategy

    monkeypatch.setenv("CONA_CACHE", str(tmp_path / "cache"))
    bench = import_script(script("bench_ttp.py"), monkeypatch)
    entry = {"seconds": 0.25, "spread": 0.05, "start_s": 2.5, "eval_s": 0.5, "load": 0.0}
    saved = tmp_path / "table.json"
    saved.write_text(json.dumps({"dp4-tp1-pp1-mbs2-gbs8": entry}))
    config = REPO / "configs" / "wikitext2-gpt-tiny.yaml"
    doc = bench.bench_doc(config, bench.DEFAULT_DATA, 60.0, "virtual")
    bench.seed_table(doc, saved, tmp_path / "out")
    run = write_config(tmp_path / "run.yaml", {**doc, "policy": "cona"})  # a run of the benchmark, as it loads
    spec = clock_spec(load_config(run), RunDir(tmp_path / "r"), [])
    assert spec.seconds(Strategy.parse("dp4-tp1-pp1-mbs2-gbs8")) == 0.25
    bench.seed_table(doc, saved, tmp_path / "out")  # the same entries again: nothing to refuse
    saved.write_text(json.dumps({"dp4-tp1-pp1-mbs2-gbs8": {**entry, "seconds": 0.3}}))
    with pytest.raises(SystemExit, match="already times dp4-tp1-pp1-mbs2-gbs8 otherwise than"):
        bench.seed_table(doc, saved, tmp_path / "out")
    with pytest.raises(SystemExit, match="not a measured table"):
        bench.seed_table(doc, config, tmp_path / "out")
    with pytest.raises(SystemExit, match="only with --clock virtual"):
        bench.seed_table(bench.bench_doc(config, bench.DEFAULT_DATA, 60.0), saved, tmp_path / "out")


def test_reality_check_takes_each_cell_from_most_world_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    check = import_script(script("reality_check.py"), monkeypatch)
    seeds = [{"cona": [1.0, 1.2], "static-16": [0.9, None]}, {"cona": [1.1, None]}, {"cona": [1.3, 1.4]}]
    table = check.median_speedups(seeds)
    assert table["cona"] == pytest.approx([1.1, 1.3]) and table["static-16"] == [None, None]


def test_fit_kappa_local_rates_compare_the_loss_rate_at_equal_loss_with_phis(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fixed batches whose training loss falls linearly in time, gbs 32's at 1.0x gbs 16's rate, G 16:
    Φ rates 32 at (32/0.16)/(16/0.1) · (16 + 16)/(32 + 16) = 0.833 of 16, so measured over Φ is 1.2."""
    from cona_cli.report.runlog import RunLog, StepRow
    from cona_core.strategy import Strategy

    fit = import_script(script("fit_kappa.py"), monkeypatch)

    def run(gbs: int, mbs: int, iter_s: float, rate: float) -> RunLog:
        s = Strategy(4, 1, 1, mbs, gbs)
        n = int(60 / iter_s)
        steps = tuple(StepRow(i, i * iter_s, s, iter_s, i * gbs, 7.0 - rate * i * iter_s, 1, 16.0) for i in range(n))
        return RunLog(Path(f"static-{gbs}"), steps, (), (), 64, None, ())

    levels = np.arange(6.8, 6.0, -0.1)
    rates = fit.local_rates(run(16, 4, 0.1, 0.02), run(32, 8, 0.16, 0.02), levels)
    assert len(rates) == len(levels) - 1
    for _level, measured, phi, g in rates:
        assert measured == pytest.approx(1.0, rel=0.05)  # crossings fall on step times
        assert phi == pytest.approx(0.8333, rel=1e-3) and g == 16.0
    out = run_script("fit_kappa.py", "runs/none", "--band", "0")
    assert out.returncode == 2 and "--band must be a positive number of nats" in out.stderr


@pytest.mark.e2e
def test_chaos_one_short_chain_run_survives_its_kills() -> None:
    """Seed 0 draws two kills on the switch path of a 20-step chain run (dp2, then pp2 from step 6, then dp2
    at gbs 32): a rank dies inside the switch checkpoint's save at step 6, and a standby's rank right after
    it read its hand-over. Its final validation loss is the unkilled run's (a chain's steps do not depend on
    timing)."""
    proc = run_script(
        "chaos.py",
        "1",
        "--steps",
        "20",
        "--seed",
        "0",
        "--policy",
        "chain",
        "--kills",
        "switch-save,handover",
        "--references",
        "1",
        "--loss-tol",
        "1e-3",
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^run 1/1 \(chain, periodic on\): completed, kills: switch-save 1, handover 1;", out, re.M), out
    assert "runs completed:          1/1" in out, out
    assert number(r"kills survived: +(\d+) \(", out) == 2
    assert number(r"launch failures recorded: (\d+)", out) == 2  # each kill failed its launch once, no more
    assert "| chain | on | 1 | 1 | 2 | 0 |" in out, out  # no failure beyond the kills
    assert number(r"checkpoints corrupted: +(\d+)", out) == 0
    assert number(r"largest loss of progress: (\d+) steps", out) <= 6  # the checkpoint interval (5), or the switch
    assert re.search(r"final validation losses \(distinct\): \[\d+\.\d+\]", out), out
    assert "within the unkilled runs' spread (+-0.001): 1/1 (unkilled: chain [" in out, out
    base = Path(re.search(r"wall time: +\d+ s  \((.+)\)", out).group(1))
    assert not base.exists()  # without --keep the run folders are removed


@pytest.mark.e2e
def test_bench_switch_one_round(tmp_path: Path) -> None:
    proc = run_script(
        "bench_switch.py", "--rounds", "1", "--stages", "2", "--stage-steps", "6", "--out", str(tmp_path), timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "1 rounds x 1 switches per condition (6 steps per stage)" in out, out
    for cond in ("standby", "cold"):
        assert number(rf"{cond} +decision to first step: ([\d.]+) s", out) > 0
        switches = [
            e
            for e in map(json.loads, (tmp_path / f"{cond}-0" / "events.jsonl").read_text().splitlines())
            if e["kind"] == "switch"
        ]
        assert len(switches) == 1 and switches[0]["standby"] == (cond == "standby"), switches
    assert number(r"running job slowed by the standby .*: ([\d.]+) x", out) > 0


@pytest.mark.e2e
def test_bench_checkpoint_one_round_of_two_ranks(tmp_path: Path) -> None:
    """Both kinds of checkpoint of a 2-rank tiny run, the shipped interval's overhead, the 1.3B scale line."""
    from cona_cli.planner.workload import Workload
    from cona_cli.run_config import load_config

    cfg = write_config(tmp_path / "tiny2.yaml", {**TINY, "cluster": {"procs_per_node": 2}})
    strategy = "dp2-tp1-pp1-mbs2-gbs8"
    proc = run_script("bench_checkpoint.py", "--config", str(cfg), "--strategy", strategy, "--rounds", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert number(r"checkpoint +([\d.]+) MB", out) > 0
    sync, waits = number(r"synchronous save +([\d.]+) s", out), number(r"training waits +([\d.]+) s", out)
    assert sync > 0 and waits > 0
    # At the shipped 600 s a save of well under 12 s (2 % of 600) costs its share of 600 s.
    assert number(r"synchronous +overhead +([\d.]+) % at the shipped interval \(600 s\)", out) == pytest.approx(
        100 * sync / (600 + sync), abs=0.002
    )
    params = Workload.from_config(load_config(REPO / "configs" / "gpt3-1.3b-a6000.yaml")).shape.total_params
    assert f"{12 * params / 1e9:.1f} GB per checkpoint, 2 nodes x 8 GPUs" in out, out
    sync_13b = 12 * params / 2 / 2e9  # each node's half at 2 GB/s
    assert number(r"synchronous +waits +([\d.]+) s per checkpoint", out) == pytest.approx(sync_13b, abs=0.01)


@pytest.mark.e2e
def test_bench_layouts_times_every_layout_of_two_ranks(tmp_path: Path) -> None:
    """bench_layouts.py with bench_layouts_ranks.py under torchrun, tiny: 2 ranks, gbs 8, mbs 2, one step each."""
    doc = {**TINY, "model": {**TINY["model"], "n_layers": 2}, "cluster": {"procs_per_node": 2}}
    cfg = write_config(tmp_path / "tiny2.yaml", {**doc, "strategy": "dp2-tp1-pp1-mbs2-gbs8"})
    out = tmp_path / "times.json"
    proc = run_script(
        "bench_layouts.py",
        *("--config", str(cfg), "--gbs", "8", "--steps", "1", "--rounds", "1", "--min-seconds", "0"),
        *("--mbs", "2", "--out", str(out)),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["dp"], r["tp"], r["pp"]) for r in rows) == [(1, 1, 2), (1, 2, 1), (2, 1, 1)], rows
    assert all(r["mbs"] == 2 and r["gbs"] == 8 and r["iter_s"] > 0 and r["n"] >= 1 for r in rows), rows
    text = proc.stdout
    assert f"wrote {out} ({len(rows)} rows)" in text, text
    assert number(r"torchrun start-up \(launch to first step\): ([\d.]+) s", text) > 0
    assert number(r"DCP save [\d.]+ s, load \(resharded dp2->tp2\) [\d.]+ s, ([\d.]+) MB", text) > 0
    assert number(r"\(1,1,1\) step: cona .* ratio ([\d.]+)", text) > 0


def test_gns_vocab_share_prints_estimates_with_and_without_the_vocab_params() -> None:
    proc = run_script(
        "gns_vocab_share.py",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        "--steps",
        "4",
        "--every",
        "2",
        "--batches",
        "2",
        "--gbs",
        "4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in rows] == ["2", "4"], proc.stdout
    for line in rows:
        whole, without = line.split("| whole model: ")[1].split(" | without vocab params: ")
        assert [w for w in whole.split()[::2]] == ["P2", "P", "1"] == [w for w in without.split()[::2]], line


def test_gns_precond_batch_reads_both_arms_from_one_fork() -> None:
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), "--gbs", "4", "--other", "8", "--fork-at", "3"]
    proc = run_script("gns_precond_batch.py", *args, "--arm-steps", "4", "--every", "2", "--batches", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"fork after 3 steps at gbs 4: B_P [\d.]+, raw ", proc.stdout), proc.stdout
    arms = re.findall(r"^arm gbs +(\d+), \+(\d+) steps: loss [\d.]+  B_P ", proc.stdout, re.M)
    assert arms == [("4", "2"), ("4", "4"), ("8", "2"), ("8", "4")], proc.stdout


def test_gns_curvature_noise_scale_from_two_batches_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """A = diag(2, 1), batches of 4 with gradients (1, 0) and (3, 2): mean (2, 1), deviations ±(1, 1), each
    with vᵀAv 3; tr(AΣ) = 4/(2 − 1)·(3 + 3) = 24 and GᵀAG = 9 − 24/(2·4) = 6."""
    curv = import_script(script("gns_curvature.py"), monkeypatch)
    deviations = [(-1.0, -1.0), (1.0, 1.0)]
    trace, signal = curv.curvature_noise_scale(lambda v: 2 * v[0] ** 2 + v[1] ** 2, (2.0, 1.0), deviations, 4)
    assert (trace, signal) == pytest.approx((24.0, 6.0))


def test_gns_curvature_hessian_form_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """L = a³ + ab + b²/2 at (a, b) = (1, 2): H = [[6a, 1], [1, 1]] = [[6, 1], [1, 1]], so v = (1, 2) gives
    vᵀHv = 6 + 2·2 + 4 = 14, and v = (1, 0) gives 6."""
    import torch

    curv = import_script(script("gns_curvature.py"), monkeypatch)
    a, b = torch.tensor(1.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    form = curv.hessian_form(a**3 + a * b + b**2 / 2, [a, b])
    assert form([torch.tensor(1.0), torch.tensor(2.0)]) == pytest.approx(14.0)
    assert form([torch.tensor(1.0), torch.tensor(0.0)]) == pytest.approx(6.0)


def test_gns_curvature_prints_the_hessian_weighted_noise_scale_beside_the_two_batch_ones() -> None:
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), "--gbs", "4", "--steps", "2", "--every", "2"]
    proc = run_script("gns_curvature.py", *args, "--batches", "2", "--hessian-samples", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = r"^step (\d+) loss [\d.]+ .*\| B_P² \S+  B_P \S+  B_1 \S+  B_H \S+.*  B_H\(SGD\) "
    rows = re.findall(row, proc.stdout, re.M)
    assert rows == ["2"], proc.stdout


def test_gns_lag_window_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients (1, 0), (0, 1), (1, 1), each step with tr 2 and |G|² 1: the lag-1 products 0 and 1 average
    0.5 and the one lag-2 product is 1, so B_P² 2, B_lag(1) 4, B_lag(2) 2. The next window keeps the last two
    gradients: (1, 0) then (−1, 0) give lag-1 products 1 and −1 (mean 0) and lag-2 products 0 and −1, so
    both lagged scales read ∞."""
    import torch

    lag = import_script(script("gns_lag.py"), monkeypatch)
    window = lag.LagWindow([1, 2])
    for g in ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0)):
        window.add(2.0, 1.0, {"w": torch.tensor(g)})
    assert window.scales() == pytest.approx({"B_P²": 2.0, "B_lag(1)": 4.0, "B_lag(2)": 2.0})
    window.clear()
    for g in ((1.0, 0.0), (-1.0, 0.0)):
        window.add(2.0, 1.0, {"w": torch.tensor(g)})
    assert window.scales() == {"B_P²": 2.0, "B_lag(1)": math.inf, "B_lag(2)": math.inf}


def test_gns_lag_prints_the_lagged_noise_scales_beside_the_two_batch_one() -> None:
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), "--gbs", "2", "--steps", "8", "--every", "4"]
    proc = run_script("gns_lag.py", *args, "--lags", "1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(
        r"^steps (\d+)-(\d+) loss [\d.]+ .*\| B_P² \S+  B_lag\(1\) \S+  B_lag\(2\) \S+$", proc.stdout, re.M
    )
    assert rows == [("1", "4"), ("5", "8")], proc.stdout
    refused = run_script("gns_lag.py", "--gbs", "3")
    assert refused.returncode == 2 and "--gbs must be even" in refused.stderr


def test_paired_trials_prints_the_efficiency_ratio_of_each_trial_length_and_the_long_pair() -> None:
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), "--arms", "4,8", "--mbs", "2", "--at", "40"]
    proc = run_script(
        "paired_trials.py", *args, "--samples", "16", "--windows", "2", "--horizon", "2", "--threads", "1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("40 ")]
    assert [r[1] for r in rows[:1]] == ["16"], proc.stdout
    assert 0 < float(rows[0][5]) < 5, proc.stdout  # the median efficiency ratio
    long = rows[-1]
    assert long[1] == "L0" and len(long) == 5 and all(0 < float(e) < 5 for e in long[3:]), proc.stdout


def test_bench_prepare_prints_peak_memory_and_the_rate_against_the_raw_tokenizer(tmp_path: Path) -> None:
    words = [f"w{i % 97}x{i % 13}" for i in range(20_000)]
    text = "\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)) + "\n"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text(text * 10)
    (tmp_path / "data" / "valid.txt").write_text(text)
    proc = run_script(
        "bench_prepare.py", "--data", str(tmp_path / "data"), "--mb", "3", "--raw-mb", "1", "--vocab", "512",
        "--keep", str(tmp_path / "work"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert number(r"peak RSS of the preparing process: (\d+) MiB", proc.stdout) > 50
    assert number(r"preparation / raw tokenizer rate: ([\d.]+)", proc.stdout) > 0  # a figure, not a bound
    tokens = number(r"prepared: ([\d,]+) train", proc.stdout.replace(",", ""))
    assert tokens > 100_000 and (tmp_path / "work" / "corpus" / "train.txt").stat().st_size >= 3_000_000


def test_bench_simulate_prints_the_run_and_table_times() -> None:
    proc = run_script("bench_simulate.py", "--steps", "300", "--seeds", "1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"one run of policy cona: 300 steps, \d+ switches in [\d.]+ s", proc.stdout), proc.stdout
    assert number(r"the whole table \(gpt3-1.3b-a6000.yaml, 1 seeds\): ([\d.]+) s", proc.stdout) > 0


def test_next_rung_error_predicts_a_table_the_model_itself_wrote(tmp_path: Path) -> None:
    """A table of the uncalibrated model's own times: the rung above one measured rung carries the
    uncalibrated error; calibrated on the rungs below, every prediction is within 5 % of the table."""
    from cona_cli.planner.calibration import UNCALIBRATED_REL_STD, Calibrator
    from cona_cli.planner.costmodel import as_array
    from cona_cli.planner.hardware import load_hardware
    from cona_cli.planner.workload import Workload
    from cona_cli.run_config import load_config
    from cona_core.strategy import Strategy

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    model = Calibrator(Workload.from_config(cfg), load_hardware(cfg.search.hardware))
    rungs = [Strategy(4, 1, 1, min(g // 4, 8), g) for g in (8, 16, 32, 64)]
    table = {str(s): {"seconds": float(model.predict(as_array([s]))[0][0])} for s in rungs}
    (tmp_path / "table.json").write_text(json.dumps(table))
    out = run_script("next_rung_error.py", "--config", "configs/tiny.yaml", "--table", str(tmp_path / "table.json"))
    assert out.returncode == 0, out.stderr
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [16, 32, 64]
    assert rows[0][2].strip() == f"±{UNCALIBRATED_REL_STD:.0%}"
    assert all(abs(float(r[4]) - 1.0) <= 0.05 for r in rows), out.stdout
    bad = run_script("next_rung_error.py", "--config", "configs/tiny.yaml", "--table", str(tmp_path / "none.json"))
    assert bad.returncode != 0 and "none.json" in bad.stderr


def test_calibrate_table_takes_each_timings_median_over_the_rounds_and_the_busiest_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cona_core.strategy import Strategy

    cal = import_script(script("calibrate_table.py"), monkeypatch)
    rounds = [
        {"seconds": 0.30, "spread": 0.05, "start_s": 3.0, "eval_s": 0.6, "load": 0.0},
        {"seconds": 0.50, "spread": 0.20, "start_s": 2.0, "eval_s": 0.5, "load": 1.4},  # a slow spell
        {"seconds": 0.32, "spread": 0.06, "start_s": 2.5, "eval_s": 0.7, "load": 0.1},
    ]
    entry = cal.median_entry(rounds)
    assert entry == {"seconds": 0.32, "spread": 0.06, "start_s": 2.5, "eval_s": 0.6, "load": 1.4}
    s = [Strategy.parse(f"dp4-tp1-pp1-mbs2-gbs{g}") for g in (8, 16, 24)]
    assert cal.rotated(s, 1) == [s[1], s[2], s[0]] and cal.rotated(s, 3) == s


@pytest.mark.e2e
def test_calibrate_table_one_round_writes_the_entry_runs_are_charged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One real calibration launch of tiny's gbs 8: the entry lands in this host's cache, where a virtual-clock
    run of the config reads it, and in --out; the synthetic corpus refuses --data."""
    from cona_cli.control.clock_table import clock_spec
    from cona_core.rundir import RunDir
    from cona_core.strategy import Strategy

    monkeypatch.setenv("CONA_CACHE", str(tmp_path / "cache"))
    s = "dp4-tp1-pp1-mbs2-gbs8"
    out = tmp_path / "table.json"
    proc = run_script("calibrate_table.py", "--config", "configs/tiny.yaml", "--rounds", "1", "--strategies", s,
                      "--out", str(out), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entry = json.loads(out.read_text())[s]
    assert 0 < entry["seconds"] < 5 and entry["start_s"] > 0 and entry["eval_s"] > 0
    assert f"| {s} | {entry['seconds']:.4g} | {entry['seconds']:.4g} | 1.000 |" in proc.stdout
    doc = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    run = write_config(tmp_path / "run.yaml", {**doc, "train": {**doc["train"], "clock": "virtual"}})
    spec = clock_spec(load_config(run), RunDir(tmp_path / "r"), [])
    assert spec.seconds(Strategy.parse(s)) == entry["seconds"]
    refused = run_script("calibrate_table.py", "--config", "configs/tiny.yaml", "--data", str(tmp_path))
    assert refused.returncode == 1 and "trains on the synthetic corpus" in refused.stderr
