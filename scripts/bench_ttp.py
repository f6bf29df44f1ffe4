"""Benchmark: time to target perplexity of cona against static strategies, same config and seed.

Runs one config (default: WikiText-2, tiny GPT, 4 gloo ranks) under
  cona          policy cona (online chaining)
  static-auto   the shortest predicted iteration time at search.gbs_static (what offline planners pick)
  static-min    the shortest predicted iteration time at the smallest rung of the ladder
  static-max    the shortest predicted iteration time at the largest rung
each for the same wall-time budget, then prints `cona report` for them (time to each target and the
speed-ups against static-auto).

    python scripts/bench_ttp.py [--config configs/wikitext2-gpt-tiny.yaml] [--data DIR]
        [--max-time 300] [--targets 600,400,300] [--out runs/ttp] [--only cona,static-auto]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.config import load_config  # noqa: E402
from cona_cli.planner.space import gbs_ladder  # noqa: E402


def variants(doc: dict, ladder: list[int], gbs_static: int) -> dict[str, dict]:
    def static(gbs: int) -> dict:
        return {**doc, "policy": "static", "strategy": "auto", "search": {**doc.get("search", {}), "gbs_static": gbs}}

    return {
        "cona": {**doc, "policy": "cona"},
        "static-auto": static(gbs_static),
        "static-min": static(ladder[0]),
        "static-max": static(ladder[-1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "wikitext-2-raw")
    ap.add_argument("--max-time", type=float, default=300.0)
    ap.add_argument("--targets", default="600,400,300")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "ttp")
    ap.add_argument("--only", default="", help="comma-separated subset of the runs")
    args = ap.parse_args()

    doc = yaml.safe_load(args.config.read_text())
    doc["data"] = {**doc.get("data", {}), "path": str(args.data.resolve())}
    doc["train"] = {**doc["train"], "max_time": args.max_time}
    doc["train"].pop("target_ppl", None)  # run the whole budget: every target gets a time
    for key in ("strategy", "chain", "policy"):
        doc.pop(key, None)
    cfg = load_config(args.config)
    ladder = gbs_ladder(cfg)
    runs = variants(doc, ladder, cfg.search.gbs_static or ladder[len(ladder) // 2])
    names = list(runs)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    cona = [sys.executable, "-c", "from cona_cli.app import main; main()"]
    for name, variant in runs.items():
        cfg_path = args.out / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(variant, sort_keys=False))
        run_dir = args.out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"== {name}: {args.max_time:.0f} s", flush=True)
        subprocess.run([*cona, "train", str(cfg_path), "--run-dir", str(run_dir)], check=True, cwd=REPO)
    dirs = [str(args.out / n) for n in names if (args.out / n / "events.jsonl").exists()]  # --only: earlier ones too
    targets = [a for t in args.targets.split(",") for a in ("--target-ppl", t)]
    baseline = ["--baseline", str(args.out / "static-auto")] if str(args.out / "static-auto") in dirs else []
    subprocess.run([*cona, "report", *dirs, *targets, *baseline, "--format", "markdown"], check=True, cwd=REPO)


if __name__ == "__main__":
    main()
