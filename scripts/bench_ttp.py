"""Benchmark: time to target perplexity of cona against static strategies and Megatron's batch ramp.

Runs one config (default: WikiText-2, tiny GPT, 4 gloo ranks), each for the same wall-time budget:
  cona              policy cona (online chaining), the config's LR recipe (`train.lr_scaling`)
  static-auto       the shortest predicted iteration time at search.gbs_static (what offline planners pick)
  static-<gbs>      the shortest predicted iteration time at every other rung of the ladder
  static-...-<rule> the same statics under the other recipe (sqrt when the config's is adascale, else
                    adascale): the best static is taken over both, so a recipe cannot do cona's winning
  ramp              Megatron's --rampup-batch-size from the lowest rung, in steps of it, to gbs_static or the
                    best static run's batch if larger, over the first third of the samples that run processed
                    (run last)
Seeds run one after another; inside a seed the runs go in a rotated order (the ramp after the statics),
so host drift spreads evenly over the conditions. After the first seed, `--drop-worst K` drops the K
static rungs that reached the fewest targets, then the last of them slowest (said so in the output).
Prints, per target, the median and range over seeds of each run's time to the target (interpolated
between evaluations), and of cona's speed-up against static-auto, the best static of the same seed
(the best fixed strategy in hindsight, over both recipes), the best static of each recipe and the
ramp, then each seed's speed-ups. The "hindsight chain" row is the fastest chain of that seed's static
runs (the paper's optimum sequence, with free switches): the ceiling of what chaining them could gain,
and biased upward, as it picks the fastest of noisy curves slice by slice. With two seeds or more two
readings measure that bias (`cona_cli/report/chain.py`): "the chain's noise floor" (each static's
fastest seed against the chain of its own seeds' runs: 1 without noise) and the "chain from another
seed" row (the path the chain took in another seed, timed on this seed's statics: no selection, no ceiling).

    python scripts/bench_ttp.py [--config configs/wikitext2-gpt-tiny.yaml] [--data DIR] [--seeds 3] [--first-seed N]
        [--max-time 240] [--targets 600,400,300] [--drop-worst 0] [--out runs/ttp] [--only cona,static-auto]
        [--relaunch] [--cona-set cona-NAME:section.key=value] [--again static-16] [--tabulate]
        [--clock virtual [--clock-table measured|PROFILE] [--table-from docs/clock-tables/NAME.json]]

`--clock virtual` runs every condition on the virtual clock (`train.clock`): real training, each step
charged its time from the table (`--clock-table`: measured on this host by default, or a hardware
profile's modelled times, which every run then also plans for: `search.hardware`, and `cluster.backend:
gloo` on a host without GPUs), so identical runs agree and runs may share the machine with other work, except
while a `measured` table calibrates a strategy it has not timed: an entry calibrated on a busy host is
named in a warning after the table (delete it from the cache and rerun on an idle host). `--table-from
FILE` starts the measured table from one saved on another host (docs/clock-tables/ keeps the tables the
recorded benchmarks ran on): its strategies are charged its times, so a table recorded in docs/benchmarks.md
can be rerun, or added to, on any host; strategies it lacks are calibrated here.

`--relaunch` adds `cona-relaunch` with `search.in_place: false` (every switch relaunches); `--cona-set
cona-NAME:SECTION.KEY=VALUE` adds a cona run with that override (an A/B of a policy setting, interleaved
with the rest; repeat it for more keys or more runs); `--again NAME`
runs NAME a second time in each seed as `NAME-again` (same config, interleaved) and prints their per-seed
ratio: how far two identical runs of one seed land apart on this host, the floor under any per-seed
comparison; `--tabulate` runs nothing and tabulates the run folders under --out (e.g. for other targets),
every `cona-NAME` folder among them (a variant's run) and every `static-NAME` one (a static run made another
way: `static-32-NOTE` competes for the best static, `static-32-sqrt-NOTE` for the sqrt recipe's) included
unless `--only` names the runs.
`--data DIR` replaces the config's data.path; a config without one (the synthetic corpus) refuses it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.cluster.nodes import visible_gpus  # noqa: E402
from cona_cli.control.clock_table import seed_measured_cache  # noqa: E402
from cona_cli.overrides import parse_sets  # noqa: E402
from cona_cli.planner.hardware import HARDWARE_DIR  # noqa: E402
from cona_cli.planner.space import gbs_ladder  # noqa: E402
from cona_cli.report.batch_path import BOUND, describe  # noqa: E402
from cona_cli.report.chain import ChainPath, Curve, chain_along, fastest_chain  # noqa: E402
from cona_cli.report.crossing import crossing  # noqa: E402
from cona_cli.report.runlog import read_run  # noqa: E402
from cona_cli.run_config import load_config  # noqa: E402
from cona_core.clock import ClockSpec, busy_warning  # noqa: E402
from cona_core.config import ConfigError, apply_overrides, config_from_dict  # noqa: E402
from cona_core.rundir import RunDir  # noqa: E402

AGAIN = "-again"  # suffix of the identical reruns made by --again
RAMP = "ramp"  # Megatron's batch-size ramp (see ramp_variant)
HINDSIGHT = "hindsight chain"  # the statics' fastest chain in hindsight (see hindsight_chain)
ACROSS = "chain from another seed"  # that chain's path, timed on another seed's statics
CONA = [sys.executable, "-c", "from cona_cli.app import main; main()"]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "wikitext-2-raw"


def other_recipe(doc: dict) -> str:
    """The LR recipe the statics also run under: sqrt beside the default adascale, else adascale."""
    return "adascale" if doc.get("train", {}).get("lr_scaling", "adascale") != "adascale" else "sqrt"


def variants(doc: dict, ladder: list[int], gbs_static: int, relaunch: bool) -> dict[str, dict]:
    """cona (and relaunching if `relaunch`), static-auto and the planner's static pick at every other rung,
    each static also under the other recipe, and the ramp (its samples are set once the statics ran)."""
    search = doc.get("search", {})
    other = other_recipe(doc)

    def static(gbs: int, recipe: str | None = None) -> dict:
        train = doc["train"] if recipe is None else {**doc["train"], "lr_scaling": recipe}
        return {**doc, "train": train, "policy": "static", "strategy": "auto", "search": {**search, "gbs_static": gbs}}

    runs = {"cona": {**doc, "policy": "cona"}}
    if relaunch:
        runs["cona-relaunch"] = {**doc, "policy": "cona", "search": {**search, "in_place": False}}
    for recipe, suffix in ((None, ""), (other, f"-{other}")):
        runs[f"static-auto{suffix}"] = static(gbs_static, recipe)
        runs.update({f"static-{g}{suffix}": static(g, recipe) for g in ladder if g != gbs_static})
    runs[RAMP] = {**doc, "policy": "ramp", "strategy": "auto", "search": {**search, "gbs_static": gbs_static}}
    return runs


def only(runs: dict[str, dict], names: str) -> dict[str, dict]:
    """The runs `--only` names (all of them for ""); a name that is not a run is refused."""
    if not names:
        return runs
    wanted = names.split(",")
    unknown = [n for n in wanted if n not in runs]
    if unknown:
        raise SystemExit(f"--only: no run named {', '.join(map(repr, unknown))} (runs: {', '.join(runs)})")
    return {k: v for k, v in runs.items() if k in wanted}


def cona_variants(doc: dict, items: list[str]) -> dict[str, dict]:
    """The extra cona runs of `--cona-set NAME:SECTION.KEY=VALUE` (one override per item; items naming the same
    run add up), each checked as a config before anything runs."""
    sets: dict[str, list[str]] = {}
    for item in items:
        name, colon, setting = item.partition(":")
        if not colon or not name.startswith("cona-") or name == "cona-relaunch" or name.endswith(AGAIN) or not setting:
            raise SystemExit(f"--cona-set {item}: expected cona-NAME:section.key=value (not cona-relaunch or *{AGAIN})")
        sets.setdefault(name, []).append(setting)
    runs = {}
    for name, settings in sets.items():
        run = copy.deepcopy(doc) | {"policy": "cona"}
        try:
            apply_overrides(run, parse_sets(settings))
            config_from_dict(run)
        except ConfigError as e:
            raise SystemExit(f"--cona-set {name}: {e}") from None
        runs[name] = run
    return runs


def ramp_variant(variant: dict, start: int, samples: int, best_gbs: int) -> dict:
    """The ramp run with Megatron's [START, INCREMENT, SAMPLES]: from `start` in steps of `start` to gbs_static,
    or to the best static run's batch `best_gbs` where that is larger (a ramp to a batch that loses is no peer)."""
    train = {**variant["train"], "rampup_batch_size": [start, start, max(samples, 1)]}
    final = max(variant["search"]["gbs_static"], best_gbs)
    return {**variant, "train": train, "search": {**variant["search"], "gbs_static": final}}


def total_samples(run_dir: Path) -> int:
    steps = read_run(run_dir).steps
    return int(steps[-1].consumed_samples) if steps else 0


def is_static(name: str) -> bool:
    """A static run that competes for the best static (not a rerun made by --again)."""
    return name.startswith("static") and not name.endswith(AGAIN)


def run_once(name: str, variant: dict, seed: int, out: Path, max_time: float) -> Path:
    doc = {**variant, "train": {**variant["train"], "seed": seed}}
    cfg_path = out / f"{name}-s{seed}.yaml"
    cfg_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = out / f"s{seed}" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"== seed {seed}: {name} ({max_time:.0f} s)", flush=True)
    subprocess.run(
        [*CONA, "train", str(cfg_path), "--run-dir", str(run_dir)], check=True, cwd=REPO, stdout=subprocess.DEVNULL
    )
    return run_dir


def busy_table_entries(runs: list[Path]) -> tuple[dict[str, float], str | None]:
    """The virtual-clock table entries `runs` were charged from that were calibrated on a busy host (each
    run's final table, `clock.json`), and the cache they are in."""
    busy: dict[str, float] = {}
    cache = None
    for run in runs:
        path = RunDir(run).clock
        if path.is_file():
            spec = ClockSpec.from_json(path.read_text())
            busy |= spec.busy
            cache = cache or spec.cache
    return busy, cache


def curve(run_dir: Path) -> list[tuple[float, float]]:
    """A run's evaluations as (time, log-ppl)."""
    return [(e.time, math.log(e.val_ppl)) for e in read_run(run_dir).evals if math.isfinite(e.val_ppl)]


def times(run_dir: Path, targets: list[float]) -> list[float | None]:
    evals = curve(run_dir)
    return [crossing(evals, math.log(t)) for t in targets]


def samples_per_s(run_dir: Path) -> float | None:
    """A run's median training throughput: global batch / step time over its timed steps."""
    rates = [r.strategy.gbs / r.iter_s for r in read_run(run_dir).steps if r.iter_s]
    return statistics.median(rates) if rates else None


def static_curves(run_dirs: list[Path]) -> dict[str, Curve]:
    """Each run's evaluations by run name (runs without any left out)."""
    return {d.name: c for d in run_dirs if (c := curve(d))}


def hindsight_chain(curves: dict[str, Curve], targets: list[float]) -> tuple[list[float | None], list[ChainPath]]:
    """The fastest chain of these (static) runs in hindsight (`cona_cli.report.chain`): the time to each
    target and the path to it (empty where not reached)."""
    chains = [fastest_chain(curves, t) for t in targets]
    return [t for t, _ in chains], [path for _, path in chains]


def chain_from_other_seeds(
    curves: dict[int, dict[str, Curve]], paths: dict[int, list[ChainPath]], targets: list[float]
) -> dict[int, list[float | None]]:
    """Per seed, the time to each target of its static runs along the hindsight chain's path of each other
    seed (the median over those seeds): the chain without the selection of its own seed's noise."""
    out: dict[int, list[float | None]] = {}
    for seed, named in curves.items():
        row: list[float | None] = []
        for j, target in enumerate(targets):
            along = [chain_along(named, target, p[j]) for s, p in paths.items() if s != seed and p[j]]
            row.append(statistics.median(along) if along and None not in along else None)
        out[seed] = row
    return out


def chain_noise_floor(curves: dict[int, dict[str, Curve]], targets: list[float]) -> list[list[float]]:
    """Per target, for every static run in two seeds or more: the fastest of its seeds' times / the time of
    the hindsight chain of those runs alone (1.0 without noise)."""
    by_name: dict[str, dict[str, Curve]] = {}
    for seed, named in sorted(curves.items()):
        for name, c in named.items():
            by_name.setdefault(name, {})[f"{name}@s{seed}"] = c
    floor: list[list[float]] = [[] for _ in targets]
    for seeds in [runs for runs in by_name.values() if len(runs) > 1]:
        for j, target in enumerate(targets):
            chained, _ = fastest_chain(seeds, target)
            alone = [t for c in seeds.values() if (t := crossing(c, math.log(target))) is not None]
            if chained is not None and alone:
                floor[j].append(min(alone) / chained)
    return floor


def finished(run_dir: Path) -> bool:
    """The run ended on its own (exit code 0), not interrupted or failed."""
    if not (run_dir / "events.jsonl").is_file():
        return False
    end = read_run(run_dir).last("exit")
    return end is not None and end.data.get("code") == 0


def budget(run_dirs: list[Path]) -> str:
    """The runs' time budget as their resolved configs record it ("budgets as run" if they differ or
    do not say)."""
    seen = set()
    for d in run_dirs:
        cfg = d / "config.resolved.json"
        seen.add(json.loads(cfg.read_text())["train"].get("max_time") if cfg.is_file() else None)
    return f"{seen.pop():.0f} s each" if len(seen) == 1 and None not in seen else "budgets as run"


def progress(reached: list[float | None]) -> tuple[int, float]:
    """A sort key, best first: more targets reached, then the sooner the last of them."""
    hit = [t for t in reached if t is not None]
    return (len(reached) - len(hit), hit[-1] if hit else 0.0)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]"


def baseline(
    results: dict[str, dict[int, list[float | None]]], label: str, seed: int, j: int, primary: str = "adascale"
) -> float | None:
    """The time to target j in `seed` of what `label` names: a run, "best static" (over both recipes) or
    "best static <rule>" (the statics of that recipe; `primary` is the config's own, unsuffixed)."""
    if not label.startswith("best static"):
        return results.get(label, {}).get(seed, [None] * (j + 1))[j]
    rule = label.removeprefix("best static").strip()
    statics = [
        r[seed][j]
        for n, r in results.items()
        if is_static(n) and seed in r and (not rule or (recipe_of(n) or primary) == rule)
    ]
    return min((t for t in statics if t is not None), default=None)


def recipe_of(name: str) -> str:
    """The recipe named in a static run's name ("" for the config's own): `static-32-sqrt`, or a folder
    of another run of it, `static-32-sqrt-NOTE`."""
    return next((part for part in name.split("-")[2:] if part in ("adascale", "sqrt")), "")


def speedups(
    results: dict[str, dict[int, list[float | None]]], run: str, label: str, n_targets: int, primary: str = "adascale"
) -> dict[int, list[float | None]]:
    """Per seed and target, `run`'s speed-up (baseline time / its time) against `label` (see `baseline`);
    None where either did not reach it."""
    out: dict[int, list[float | None]] = {}
    for seed, run_times in results[run].items():
        row: list[float | None] = []
        for j in range(n_targets):
            base = baseline(results, label, seed, j, primary)
            row.append(base / run_times[j] if base is not None and run_times[j] is not None else None)
        out[seed] = row
    return out


def bench_doc(config: Path, data: Path, max_time: float, clock: str = "wall", table: str | None = None) -> dict:
    """The config every run starts from: `data` as its corpus, `max_time` its only stop rule (seconds of
    `clock`, with `table` the virtual clock's: a hardware profile's is also what every run plans for, on
    gloo where this host has no GPU), no policy."""
    doc = yaml.safe_load(config.read_text())
    if doc.get("data", {}).get("path"):
        doc["data"] = {**doc["data"], "path": str(data.resolve())}
    elif data != DEFAULT_DATA:
        raise SystemExit(f"--data: {config} trains on the synthetic corpus (no data.path) and cannot take it")
    doc["train"] = {**doc["train"], "max_time": max_time, "clock": clock}
    if table is not None:
        if clock != "virtual":
            raise SystemExit("--clock-table: only with --clock virtual")
        doc["train"]["clock_table"] = table
        if (HARDWARE_DIR / f"{table}.yaml").is_file():  # that machine's clock: plan for it, run on this one
            doc["search"] = {**doc.get("search", {}), "hardware": table}
            if not visible_gpus():
                doc["cluster"] = {**doc.get("cluster", {}), "backend": "gloo"}
    for stop in ("target_ppl", "max_steps"):  # run the whole budget: every target gets a time
        doc["train"].pop(stop, None)
    for key in ("strategy", "chain", "policy"):
        doc.pop(key, None)
    return doc


def seed_table(doc: dict, saved: Path, out: Path) -> None:
    """`--table-from`: this host's measured table of the runs' config starts from `saved`."""
    if doc["train"]["clock"] != "virtual" or doc["train"].get("clock_table", "measured") != "measured":
        raise SystemExit("--table-from: only with --clock virtual and the measured table")
    out.mkdir(parents=True, exist_ok=True)
    base = out / "table-base.yaml"  # the runs' config, as `cona train` loads it
    base.write_text(yaml.safe_dump(doc))
    try:
        path, n = seed_measured_cache(load_config(base), saved)
    except ConfigError as e:
        raise SystemExit(f"--table-from: {e}") from None
    print(f"cona table: {n} strategies from {saved}, charged as measured there ({path})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="replaces the config's data.path")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, help="default: the config's train.seed")
    ap.add_argument("--max-time", type=float, default=240.0, help="seconds of run time (of --clock)")
    ap.add_argument(
        "--clock",
        choices=("wall", "virtual"),
        default="wall",
        help="virtual: every run's time from a step-time table, whatever the host's load (train.clock)",
    )
    ap.add_argument("--clock-table", help="the virtual clock's table: measured (default), a profile or a YAML path")
    ap.add_argument("--table-from", type=Path, help="start the measured table from this saved one (any host's)")
    ap.add_argument("--targets", default="600,400,300")
    ap.add_argument("--drop-worst", type=int, default=0, help="static rungs dropped after the first seed")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "ttp")
    ap.add_argument("--only", default="", help="comma-separated subset of the runs")
    ap.add_argument("--relaunch", action="store_true", help="cona also with search.in_place: false")
    ap.add_argument(
        "--cona-set",
        action="append",
        default=[],
        metavar="cona-NAME:SECTION.KEY=VALUE",
        help="also run cona as cona-NAME with this config override (repeat: more keys, more runs)",
    )
    ap.add_argument("--again", default="", help="comma-separated runs to run twice per seed (NAME-again)")
    ap.add_argument("--tabulate", action="store_true", help="run nothing: tabulate the run folders under --out")
    ap.add_argument("--reuse", action="store_true", help="keep run folders that finished; run only the others")
    args = ap.parse_args()

    doc = bench_doc(args.config, args.data, args.max_time, args.clock, args.clock_table)
    cfg = load_config(args.config)
    if args.table_from is not None:
        seed_table(doc, args.table_from, args.out)
    ladder = gbs_ladder(cfg)
    runs = variants(doc, ladder, cfg.search.gbs_static or ladder[len(ladder) // 2], args.relaunch)
    conas = cona_variants(doc, args.cona_set)  # always run: --only may name them too
    runs = only(runs | conas, args.only) | conas
    for name in [n for n in args.again.split(",") if n]:
        if name not in runs:
            raise SystemExit(f"--again: no run named {name!r} (runs: {', '.join(runs)})")
        runs[name + AGAIN] = runs[name]
    every = dict(runs)  # what --drop-worst leaves out still names its batch for the ramp
    targets = [float(t) for t in args.targets.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    base_seed = args.first_seed if args.first_seed is not None else int(doc["train"].get("seed", 1234))
    if args.tabulate and not args.only:  # every cona and static run the folders hold, whatever it ran with
        seeds = [args.out / f"s{base_seed + i}" for i in range(args.seeds)]
        found = sorted({p.name for d in seeds for p in [*d.glob("cona-*"), *d.glob("static-*")]})
        runs |= {name: doc for name in found if name not in runs}  # tabulating reads the folders, not the doc
    results: dict[str, dict[int, list[float | None]]] = {name: {} for name in runs}  # run -> seed -> per target
    for i in range(args.seeds):
        seed = base_seed + i
        if args.tabulate:
            for name in runs:
                if finished(args.out / f"s{seed}" / name):
                    results[name][seed] = times(args.out / f"s{seed}" / name, targets)
            continue
        names = [n for n in runs if n != RAMP]
        turn = i % len(names) if names else 0
        names = names[turn:] + names[:turn]  # rotate: drift spreads over conditions
        for name in names + [RAMP] * (RAMP in runs):
            done = args.out / f"s{seed}" / name
            variant = runs[name]
            if name == RAMP:  # over the first third of what this seed's best static run processed
                statics = [n for n in results if is_static(n) and seed in results[n]]
                if not statics:
                    raise SystemExit("ramp: needs the static runs of its seed (add them to --only)")
                best = min(statics, key=lambda n: progress(results[n][seed]))
                samples = total_samples(args.out / f"s{seed}" / best)
                variant = ramp_variant(variant, ladder[0], samples // 3, every[best]["search"]["gbs_static"])
            if not (args.reuse and finished(done)):
                done = run_once(name, variant, seed, args.out, args.max_time)
            results[name][seed] = times(done, targets)
        if i == 0 and args.drop_worst:
            statics = [n for n in runs if is_static(n) and n != "static-auto"]
            slowest = sorted(statics, key=lambda n: progress(results[n][seed]))[-args.drop_worst :]
            print(f"dropped after seed {base_seed}: {', '.join(slowest)} (fewest targets reached, then slowest)")
            runs = {k: v for k, v in runs.items() if k not in slowest}
    results = {name: per_seed for name, per_seed in results.items() if per_seed}
    curves = {
        seed: static_curves([args.out / f"s{seed}" / n for n, r in results.items() if is_static(n) and seed in r])
        for seed in sorted({seed for per_seed in results.values() for seed in per_seed})
    }
    curves = {seed: named for seed, named in curves.items() if len(named) > 1}
    chain: dict[int, list[float | None]] = {}
    paths: dict[int, list[ChainPath]] = {}
    for seed, named in curves.items():
        chain[seed], paths[seed] = hindsight_chain(named, targets)
    if chain:
        results[HINDSIGHT] = chain
        print("\nthe hindsight chain per seed (each run from the ppl where it is the fastest):")
        for seed, per_target in paths.items():
            path = next((p for p in reversed(per_target) if p), [])
            print(f"  s{seed}: " + " → ".join(f"{name} (from {ppl:.4g})" for name, ppl in path))
    if len(chain) > 1:
        results[ACROSS] = chain_from_other_seeds(curves, paths, targets)
        floor = chain_noise_floor(curves, targets)
        print(
            "\nthe chain's noise floor: the fastest seed of each static / the hindsight chain of its seeds' runs, "
            "median [range] over the statics (1 without noise): "
            + ", ".join(f"ppl {t:g} {spread(f)}" for t, f in zip(targets, floor))
        )

    rates = []
    for name in [n for n in results if n.startswith("static")]:  # with the reruns: their speed drifts too
        per_seed = [samples_per_s(args.out / f"s{seed}" / name) for seed in results[name]]
        rates.append(f"{name} {spread([r for r in per_seed if r is not None])}")
    print("\nsamples/s (median step of each run; median [range] over seeds): " + ", ".join(rates))
    ran = [args.out / f"s{seed}" / name for name, per_seed in results.items() if name != HINDSIGHT for seed in per_seed]
    warning = busy_warning(*busy_table_entries(ran))
    if warning:
        print(f"\nWARNING: {warning}")
    print(f"\n{args.seeds} seed(s), {budget(ran)}; time to target in s: median [min–max] over seeds")
    print("| run | " + " | ".join(f"ppl ≤ {t:g}" for t in targets) + " |")
    print("|---" * (len(targets) + 1) + "|")
    for name, per_seed in results.items():
        cells = []
        for j in range(len(targets)):
            reached = [t[j] for t in per_seed.values() if t[j] is not None]
            cells.append(f"{spread(reached)} ({len(reached)}/{len(per_seed)})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    conas = [n for n in results if n.startswith("cona") or n in (HINDSIGHT, ACROSS)]
    primary = doc["train"].get("lr_scaling", "adascale")
    labels = ["static-auto", "best static", f"best static {primary}", f"best static {other_recipe(doc)}"]
    labels += [RAMP] * (RAMP in results)
    labels += [n for n in (HINDSIGHT, ACROSS) if n in results]
    for cona in conas:
        for label in [lb for lb in labels if lb != cona]:
            ups = speedups(results, cona, label, len(targets), primary)
            cells = [spread([u[j] for u in ups.values() if u[j] is not None]) + "×" for j in range(len(targets))]
            print(f"| {cona} vs {label} | " + " | ".join(cells) + " |")
    print("\nper seed, against the best static of that seed (" + " / ".join(f"ppl {t:g}" for t in targets) + "):")
    for cona in conas:
        for seed, ups in sorted(speedups(results, cona, "best static", len(targets), primary).items()):
            print(f"  {cona} s{seed}: " + " / ".join("-" if u is None else f"{u:.3g}" for u in ups))
    print(f"\nglobal batches per seed, from the first step at each (the bound: {BOUND}):")
    for cona in [n for n in conas if n not in (HINDSIGHT, ACROSS)]:
        for seed in sorted(results[cona]):
            print(f"  {cona} s{seed}: {describe(read_run(args.out / f's{seed}' / cona))}")
    for again in [n for n in results if n.endswith(AGAIN)]:
        first = again.removesuffix(AGAIN)
        at = " / ".join(f"ppl {t:g}" for t in targets)
        print(f"\nidentical runs: {first}'s time / {again}'s time per seed ({at}):")
        for seed, t2 in sorted(results[again].items()):
            t1 = results[first].get(seed, [None] * len(targets))
            ratios = ("-" if a is None or b is None else f"{a / b:.3g}" for a, b in zip(t1, t2))
            print(f"  s{seed}: " + " / ".join(ratios))


if __name__ == "__main__":
    main()
