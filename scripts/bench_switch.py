"""Benchmark: what a switch costs with a pre-warmed standby job and with a cold relaunch, side by side.

Runs the same chain (default `configs/tiny.yaml`, 4 gloo ranks, stages of `--stage-steps` steps
alternating dp4 and dp2-pp2 at gbs 16) with `cluster.standby` on and off, interleaved over
`--rounds` rounds so host drift hits both alike. Prints, per condition, the median and range of the
switch cost from the decision (the stage's last step) to the end of the first step under the new
layout, the median of each phase, and how much the standby slowed the running job: the median
s/iter of each stage with a standby against the same stage without one.

    python scripts/bench_switch.py [--rounds 3] [--stages 4] [--stage-steps 150] [--out runs/switch]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CONA = [sys.executable, "-c", "from cona_cli.app import main; main()"]
LAYOUTS = ({"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16}, {"dp": 2, "tp": 1, "pp": 2, "mbs": 2, "gbs": 16})


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(out: Path, name: str, standby: bool, stages: int, steps: int) -> Path:
    doc = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    doc["cluster"] = {**doc.get("cluster", {}), "standby": standby}
    doc["train"] = {**doc["train"], "max_steps": stages * steps, "eval_interval": stages * steps}
    doc.pop("strategy", None)
    doc["chain"] = [{**LAYOUTS[i % 2], "steps": steps} for i in range(stages)]
    cfg = out / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"== {name}", flush=True)
    subprocess.run(
        [*CONA, "train", str(cfg), "--run-dir", str(run_dir)],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return run_dir


def stage_medians(run_dir: Path, steps: int) -> list[float]:
    """Median s/iter of each stage, its first 5 steps (start-up, first-step effects) left out."""
    by_stage: dict[int, list[float]] = {}
    for r in rows(run_dir / "metrics.jsonl"):
        if r["kind"] == "step" and (r["step"] - 1) % steps >= 5:
            by_stage.setdefault((r["step"] - 1) // steps, []).append(r["iter_s"])
    return [statistics.median(v) for _, v in sorted(by_stage.items())]


def spread(values: list[float], unit: str = "s") -> str:
    return f"{statistics.median(values):.3g} {unit} [{min(values):.3g}–{max(values):.3g}]" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage-steps", type=int, default=150)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "switch")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    switches: dict[str, list[dict]] = {"standby": [], "cold": []}
    stage_times: dict[str, list[list[float]]] = {"standby": [], "cold": []}
    for r in range(args.rounds):
        order = ("standby", "cold") if r % 2 == 0 else ("cold", "standby")
        for cond in order:
            run_dir = run(args.out, f"{cond}-{r}", cond == "standby", args.stages, args.stage_steps)
            switches[cond] += [e for e in rows(run_dir / "events.jsonl") if e["kind"] == "switch"]
            stage_times[cond].append(stage_medians(run_dir, args.stage_steps))

    print(f"\n{args.rounds} rounds x {args.stages - 1} switches per condition ({args.stage_steps} steps per stage)")
    for cond, events in switches.items():
        cost = [e["decision_to_first_step_s"] for e in events]
        ready = sum(e.get("standby_ready", False) for e in events)
        prepared = sum(e.get("prepared", False) for e in events)
        print(
            f"{cond:8s} decision to first step: {spread(cost)}"
            + (f"; standby ready in {ready}/{len(events)}, layout prepared in {prepared}" if cond == "standby" else "")
        )
        phases = sorted({k for e in events for k in e["phases"]})
        print(
            "         phases (median s): "
            + ", ".join(
                f"{k} {statistics.median([e['phases'][k] for e in events if k in e['phases']]):.3g}" for k in phases
            )
        )
    # Every stage but the last runs beside a standby (started after its first step).
    ratios = [w / c for ws, cs in zip(stage_times["standby"], stage_times["cold"]) for w, c in list(zip(ws, cs))[:-1]]
    print(
        f"running job slowed by the standby (s/iter with / without, stages 1..{args.stages - 1}): {spread(ratios, 'x')}"
    )


if __name__ == "__main__":
    main()
