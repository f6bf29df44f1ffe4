"""Chaos test: train the tiny config N times, SIGKILL a random worker rank or the controller at a
random moment (1 to --max-kills kills per run; `cona train --resume` after a controller kill), then
check that every run finished, that each committed checkpoint loads, and how many steps a recovery lost.
Exits 1 if a run failed or a checkpoint was corrupted.

    .venv/bin/python scripts/chaos.py 20 [--seed 0] [--steps 30] [--max-kills 2] [--keep]

Saves linger 0.3 s (CONA_TEST_SAVE_DELAY_S) so that some kills land inside a checkpoint save.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.config import config_from_dict  # noqa: E402
from cona_cli.control import usable_checkpoints as checkpoints  # noqa: E402
from cona_cli.control.runstate import RunState  # noqa: E402
from cona_cli.rundir import RunDir, committed  # noqa: E402
from tests.support import TINY, write_config  # noqa: E402

GBS = 16
ENV = {**os.environ, "CONA_TEST_SAVE_DELAY_S": "0.3"}


def config_doc(steps: int) -> dict:
    """The tiny config on 2 ranks, `steps` steps, a checkpoint every 5."""
    return {
        **TINY,
        "cluster": {"procs_per_node": 2},
        "strategy": f"dp2-tp1-pp1-mbs2-gbs{GBS}",
        "train": {**TINY["train"], "max_steps": steps, "checkpoint_interval": 5, "max_restarts": 5},
    }


def cona(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from cona_cli.app import main; main()", *args],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def last_step(run: Path) -> int:
    return max((r["step"] for r in rows(run / "metrics.jsonl") if r.get("kind") == "step"), default=0)


def worker_pids(run: Path) -> list[int]:
    """The ranks of the running job: the agent's grandchildren. The agent (`launch.forkrun`) forks them
    from its fork server, a child of the agent; its other child is a helper, not a rank."""
    state = RunState.load(run)
    if state is None or not state.agent_pids:
        return []
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    agent = state.agent_pids[0]
    return sorted(pid for pid, ppid in parent.items() if parent.get(ppid) == agent)


def checkpoint_loads(path: Path, shapes: checkpoints.Shapes, cfg_doc: dict, vocab: int) -> bool:
    """Load the model tensors of a committed checkpoint in this process."""
    import torch.distributed.checkpoint as dcp

    from launch.models import get_spec

    if checkpoints.problem(path, shapes) is not None:
        return False
    m = config_from_dict(cfg_doc).model
    model = get_spec(m.family).build(m, vocab)
    try:
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(path))
    except BaseException:  # DCP's CheckpointException is a BaseException
        return False
    return True


def one_run(tmp: Path, rng: random.Random, steps: int, max_kills: int) -> dict:
    tmp.mkdir(parents=True)
    doc = config_doc(steps)
    cfg = write_config(tmp / "tiny.yaml", doc)
    run = tmp / "run"
    proc = cona("train", str(cfg), "--run-dir", str(run))
    kills = {"worker": 0, "controller": 0}
    for _ in range(rng.choice(range(1, max_kills + 1))):
        at = last_step(run) + rng.randint(1, 8)
        deadline = time.monotonic() + 120
        while proc.poll() is None and last_step(run) < at and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.4))
        if proc.poll() is not None:
            break
        pids = worker_pids(run)
        if rng.random() < 0.5 and pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
            kills["worker"] += 1
        else:
            proc.kill()
            proc.wait()
            kills["controller"] += 1
            proc = cona("train", "--resume", str(run))
    _, err = proc.communicate(timeout=600)
    step_rows = [r for r in rows(run / "metrics.jsonl") if r.get("kind") == "step"]
    final = {r["step"]: r for r in step_rows}
    ok = (
        proc.returncode == 0
        and sorted(final) == list(range(1, steps + 1))
        and all(r["consumed_samples"] == r["step"] * GBS for r in step_rows)
    )
    lost = 0
    events = rows(run / "events.jsonl")
    failures = sum(e.get("kind") == "failure" for e in events)
    for e in events:  # steps reached before a recovery minus the step it restored
        if e.get("kind") == "launch" and e.get("reason") in ("restart", "resume"):
            reached = max((r["step"] for r in step_rows if r["wall_clock"] < e["wall_clock"]), default=0)
            lost = max(lost, reached - e["step"])
    files = RunDir(run)
    shapes = checkpoints.expected_shapes(config_from_dict(doc), files)
    root = files.checkpoints
    corrupt = sum(not checkpoint_loads(p, shapes, doc, files.vocab_size()) for p in committed(root))
    corrupt += sum(1 for p in root.iterdir() if p.name.startswith("bad")) if root.is_dir() else 0
    return {
        "ok": ok,
        "kills": kills,
        "failures": failures,
        "lost": lost,
        "corrupt": corrupt,
        "loss": final.get(steps, {}).get("loss"),
        "err": "" if ok else err[-1500:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help="number of runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30, help="steps per run (a checkpoint every 5)")
    parser.add_argument("--max-kills", type=int, default=2, help="kills per run: 1 to this many, at random")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args()
    if args.n < 1 or args.steps < 1 or args.max_kills < 1:
        parser.error("n, --steps and --max-kills must be >= 1")
    rng = random.Random(args.seed)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    base = Path(tempfile.mkdtemp(prefix="cona-chaos-"))
    os.environ.setdefault("CONA_CACHE", str(base / "cache"))
    ENV.setdefault("CONA_CACHE", os.environ["CONA_CACHE"])
    results, t0 = [], time.monotonic()
    for i in range(args.n):
        r = one_run(base / f"run{i:03d}", rng, args.steps, args.max_kills)
        results.append(r)
        print(
            f"run {i + 1}/{args.n}: {'completed' if r['ok'] else 'FAILED'}, kills {r['kills']}, "
            f"failures recorded {r['failures']}, lost {r['lost']} steps, corrupt checkpoints {r['corrupt']}, "
            f"final loss {r['loss']}",
            flush=True,
        )
        if r["err"]:
            print(r["err"], flush=True)
    losses = {round(r["loss"], 4) for r in results if r["loss"] is not None}
    print(f"\nruns completed:          {sum(r['ok'] for r in results)}/{args.n}")
    print(
        f"kills survived:          {sum(sum(r['kills'].values()) for r in results if r['ok'])} "
        f"(worker {sum(r['kills']['worker'] for r in results)}, "
        f"controller {sum(r['kills']['controller'] for r in results)})"
    )
    # A rank killed with SIGKILL fails its launch: the controller records a failure and restarts.
    print(f"launch failures recorded: {sum(r['failures'] for r in results)}")
    print(f"checkpoints corrupted:   {sum(r['corrupt'] for r in results)}")
    print(f"largest loss of progress: {max((r['lost'] for r in results), default=0)} steps")
    print(f"final losses (distinct): {sorted(losses)}")
    print(f"wall time:               {time.monotonic() - t0:.0f} s  ({base})")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r["ok"] and not r["corrupt"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
