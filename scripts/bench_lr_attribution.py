"""Benchmark: is it the LR rule or Φ? Samples to target of two batches at two learning rates.

For each config, trains gbs_min (b) and 4·gbs_min (4b) at the config's lr and at 2× it, with
`lr_scaling: none` (the LR is what it says at every batch), one process, stopped by a token budget, and
prints the samples each needed to reach each target perplexity relative to b at 1×. Under the old
sqrt recipe 4b ran at 2× the LR of b; if 4b at 1× needs what Φ predicts and b at 2× needs fewer
samples than b at 1×, the gap between Φ and the sqrt runs was the LR, not Φ. Samples to a target do
not depend on the layout (every layout matches one process) nor on the host's speed, so these runs
may share the machine with other work.

    python scripts/bench_lr_attribution.py [--config configs/wikitext2-gpt-tiny.yaml ...] [--seeds 1234,1235]
        [--tokens 1400000,450000] [--targets 600,450,350 1500,1000,700] [--out runs/lr-attribution] [--tabulate]
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.report.crossing import crossing  # noqa: E402
from cona_cli.report.runlog import read_run  # noqa: E402

CONFIGS = [REPO / "configs" / "wikitext2-gpt-tiny.yaml", REPO / "configs" / "wikitext2-commheavy.yaml"]
DATA = REPO.parent / "shared" / "data" / "wikitext-2-raw"
EVAL_EVERY = 40  # steps at gbs b between evaluations; the 4b runs evaluate at the same sample counts


def conditions(b: int) -> list[tuple[str, int, float]]:
    """(name, global batch, LR multiplier): b and 4b at 1x and 2x."""
    return [(f"g{b}-lr1", b, 1.0), (f"g{4 * b}-lr2", 4 * b, 2.0), (f"g{b}-lr2", b, 2.0), (f"g{4 * b}-lr1", 4 * b, 1.0)]


def variant(doc: dict, seed: int, gbs: int, mult: float, tokens: int, b: int) -> dict:
    """One process (every layout matches it), lr_scaling none, a token budget, evaluations every
    EVAL_EVERY steps at gbs b (the same sample counts at 4b)."""
    doc = copy.deepcopy(doc)
    doc["data"] = {**doc.get("data", {}), "path": str(DATA)}
    doc["cluster"] = {"nodes": 1, "procs_per_node": 1, "threads_per_proc": 2, "standby": False}
    t = doc["train"]
    t.update(seed=seed, lr=t["lr"] * mult, lr_scaling="none", max_tokens=tokens, eval_interval=EVAL_EVERY * b // gbs)
    for key in ("max_time", "eval_interval_s", "lr_base_gbs", "target_ppl"):
        t.pop(key, None)
    mbs = max(m for m in (1, 2, 4, 8) if gbs % m == 0 and gbs // m >= 2)  # >= 2 micro-batches: a GNS at dp 1
    return {**doc, "policy": "static", "strategy": f"dp1-tp1-pp1-mbs{mbs}-gbs{gbs}"}


def samples_to(run_dir: Path, target: float) -> float | None:
    """Samples at which the validation curve first reaches `target` (linear in log-ppl)."""
    evals = [
        (e.consumed_samples, math.log(e.val_ppl))
        for e in read_run(run_dir).evals
        if e.consumed_samples is not None and math.isfinite(e.val_ppl)
    ]
    return crossing(evals, math.log(target))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, nargs="+", default=CONFIGS)
    ap.add_argument("--seeds", default="1234,1235")
    ap.add_argument("--tokens", default="1400000,450000", help="token budget per config")
    ap.add_argument("--targets", nargs="+", default=["600,450,350", "1500,1000,700"], help="per config")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "lr-attribution")
    ap.add_argument("--tabulate", action="store_true", help="run nothing: tabulate the run folders under --out")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if not (len(args.config) == len(tokens) == len(args.targets)):
        raise SystemExit("--config, --tokens and --targets: give one entry per config")
    for cfg_path, budget, targets in zip(args.config, tokens, args.targets):
        doc = yaml.safe_load(cfg_path.read_text())
        b = doc["search"]["gbs_min"]
        for seed in (int(s) for s in args.seeds.split(",")):
            rows = {}
            for name, gbs, mult in conditions(b):
                run = args.out / f"{cfg_path.stem}-s{seed}-{name}"
                if not args.tabulate and not (run / "DONE").exists():
                    shutil.rmtree(run, ignore_errors=True)
                    run.parent.mkdir(parents=True, exist_ok=True)
                    cfg = run.with_suffix(".yaml")
                    cfg.write_text(yaml.safe_dump(variant(doc, seed, gbs, mult, budget, b), sort_keys=False))
                    print(f"== {run.name}", flush=True)
                    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", "train", str(cfg)]
                    subprocess.run([*cmd, "--run-dir", str(run)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
                    (run / "DONE").write_text("")
                if (run / "DONE").exists():
                    rows[name] = [samples_to(run, float(t)) for t in targets.split(",")]
            if not rows:
                continue
            base = rows.get(f"g{b}-lr1")
            print(f"\n{cfg_path.stem}, seed {seed}: samples to ppl {targets.replace(',', ' / ')} (ratio to g{b}-lr1)")
            for name, got in rows.items():
                cells = [
                    "-" if n is None else f"{n:.0f}" + (f" ({n / base[j]:.2f})" if base and base[j] else "")
                    for j, n in enumerate(got)
                ]
                print(f"  {name}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
