"""Chaos test: train the tiny config N times under the given policies, kill a process of the run at a
random moment or at a named point of the switch path (1 to --max-kills kills per run; `cona train
--resume` after a controller kill), then check that every run finished with continuous steps and
consumed samples, that each committed checkpoint loads, that no process of the run is left, how many
steps a recovery lost, how many launches failed after the kills, and that its final validation loss lies
within the spread of unkilled runs of its policy (--references per policy, run first; widened by
--loss-tol). Exits 1 if a run failed, a checkpoint was corrupted, a process outlived its run or a final
validation loss fell outside that spread.

    .venv/bin/python scripts/chaos.py 30 [--policy static,chain,cona] [--periodic on,off] [--seed 0]
        [--steps 30] [--max-kills 2] [--kills worker,restart,...] [--references 2] [--loss-tol 0.01] [--keep]

Runs cycle through the policies and the periodic-checkpoint settings (`on`: every 5 steps; `off`: the
default time-based interval, which a 30-step run never reaches). What is killed, at random (SIGKILL):
  worker         a rank, at a random step
  controller     `cona train`, at a random step, then `--resume`
  agent          the torchrun agent of the running job
  restart        a rank, then the agent of the launch that restarts the run, as soon as it is started
  switch-save    a rank inside the checkpoint save of the chain's first switch (chain only;
                 CONA_TEST_DIE_AT_STEP=N:RANK:save)
  switch-handoff the controller once a switch's checkpoint is committed, before the next launch steps
                 (chain and cona), then `--resume`
  standby-start  the agent of a standby while it starts (chain: its next stage is a relaunch)
  handover       a standby's rank just after it read its hand-over, before it loads (chain;
                 CONA_TEST_DIE_AT_STEP=*:RANK:handover)
  resize         a rank just after an in-place resize took effect (cona; CONA_TEST_DIE_AT_STEP=*:RANK:resize)
  sigterm        a rank, with SIGTERM, at a random step (a stray signal: the job checkpoints and is restarted)
  disconnect     rank 0's telemetry connection, at a random step (CONA_TEST_DISCONNECT_AT_STEP)
  load-error     every checkpoint load's first read fails with EIO once (CONA_TEST_LOAD_ERRNO; retried)
A kill whose moment never came in a run (cona did not resize, no standby started, nothing loaded a
checkpoint) is not counted.
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.control import usable_checkpoints as checkpoints  # noqa: E402
from cona_cli.control.runstate import RunState  # noqa: E402
from cona_core.config import config_from_dict  # noqa: E402
from cona_core.rundir import RunDir, committed  # noqa: E402
from tests.support import TINY, write_config  # noqa: E402

ENV = {**os.environ, "CONA_TEST_SAVE_DELAY_S": "0.3"}
POLICIES = ("static", "chain", "cona")
KILLS = (
    "worker",
    "controller",
    "agent",
    "restart",
    "switch-save",
    "switch-handoff",
    "standby-start",
    "handover",
    "resize",
    "sigterm",
    "disconnect",
    "load-error",
)
HOOKS = {"switch-save": "save", "handover": "handover", "resize": "resize"}  # kills the worker makes itself
# Faults the workers make themselves from their own variable: what sets it, and how to count them after.
FAULTS = {"disconnect", "load-error"}
FAILING = ("worker", "agent", "switch-save", "handover", "resize", "sigterm", "disconnect")  # each fails a launch
FOR_POLICY = {"switch-save": ("chain",), "switch-handoff": ("chain", "cona"), "standby-start": ("chain",)}
FOR_POLICY |= {"handover": ("chain",), "resize": ("cona",)}


def chain_boundary(steps: int) -> int:
    return steps // 3


def config_doc(steps: int, policy: str, periodic: bool) -> dict:
    """The tiny config on 2 ranks for `steps` steps. static: dp2 at gbs 16; chain: dp2 gbs 16, then pp2
    (a relaunch into another layout) from a third of the steps, then dp2 gbs 32 (a resize or relaunch);
    cona: its own ladder 8-32."""
    train = {**TINY["train"], "max_steps": steps, "max_restarts": 5}
    if periodic:
        train["checkpoint_interval"] = 5
    doc = {**TINY, "cluster": {"procs_per_node": 2}, "train": train, "policy": policy}
    if policy == "static":
        doc["strategy"] = "dp2-tp1-pp1-mbs2-gbs16"
    elif policy == "chain":
        doc.pop("strategy", None)
        third = chain_boundary(steps)
        doc["chain"] = [
            {"dp": 2, "tp": 1, "pp": 1, "mbs": 2, "gbs": 16, "steps": third},
            {"dp": 1, "tp": 1, "pp": 2, "mbs": 2, "gbs": 16, "steps": third},
            {"dp": 2, "tp": 1, "pp": 1, "mbs": 4, "gbs": 32},
        ]
    else:
        doc.pop("strategy", None)
        doc["search"] = {"gbs_min": 8, "gbs_max": 32, "mbs": [2, 4, 8]}
    return doc


def cona(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from cona_cli.app import main; main()", *args],
        cwd=REPO,
        env={**ENV, **(env or {})},
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


def job_processes(run: Path) -> list[int]:
    """Live processes whose command line names the run folder (ranks, agents, fork servers)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run) in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and int(cmdline.parent.name) != os.getpid():
                    found.append(int(cmdline.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(found)


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


def continuous(step_rows: list[dict], steps: int) -> bool:
    """The rows that stand (each step's last) cover steps 1..steps, each continuing the one before it
    (consumed samples those before plus its batch); within a launch every row continues the one before,
    and a launch's first row continues a row of the step before it (the checkpoint it restored) or the
    start. A launch abandoned by a recovery may have run on past that checkpoint under other batches."""
    final = {r["step"]: r for r in step_rows}
    if sorted(final) != list(range(1, steps + 1)):
        return False
    consumed = [0] + [final[step]["consumed_samples"] for step in range(1, steps + 1)]
    if any(final[step]["consumed_samples"] != consumed[step - 1] + final[step]["gbs"] for step in final):
        return False
    seen: dict[int, set[int]] = {0: {0}}
    last: dict[int, dict] = {}
    for r in step_rows:
        prev = last.get(r["launch"])
        if prev is not None and r["step"] != prev["step"] + 1:
            return False
        allowed = {prev["consumed_samples"]} if prev is not None else seen.get(r["step"] - 1, set())
        if r["consumed_samples"] - r["gbs"] not in allowed:
            return False
        seen.setdefault(r["step"], set()).add(r["consumed_samples"])
        last[r["launch"]] = r
    return True


def wait_for(proc: subprocess.Popen, ready: Callable[[], object], timeout: float = 120.0) -> object:
    """Poll `ready` until it returns something truthy, the run ends or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        time.sleep(0.02)
    return None


def outcome_written(run: Path) -> int | None:
    """The last launch, once its workers wrote the outcome of a switch (its checkpoint is committed)."""
    state = RunState.load(run)
    path = RunDir(run).launch_outcome(state.launch) if state else None
    try:
        reason = json.loads(path.read_text())["reason"] if path else None
    except (OSError, ValueError, KeyError):
        return None
    return state.launch if state and reason in ("stage_end", "command") else None


def fault_env(plan: list[str], rng: random.Random, steps: int) -> dict[str, str]:
    """The variables that make the workers fault themselves for the drawn kills."""
    hooks = {HOOKS[k] for k in plan if k in HOOKS}  # each fires once per run folder, however often drawn
    specs = {"save": f"{chain_boundary(steps)}:{rng.randint(0, 1)}:save"}
    specs |= {place: f"*:{rng.randint(0, 1)}:{place}" for place in ("handover", "resize")}
    env = {"CONA_TEST_DIE_AT_STEP": ",".join(specs[h] for h in sorted(hooks))} if hooks else {}
    if "disconnect" in plan:
        env["CONA_TEST_DISCONNECT_AT_STEP"] = str(rng.randint(2, steps - 2))
    if "load-error" in plan:
        env["CONA_TEST_LOAD_ERRNO"] = "EIO"
    return env


def one_run(
    tmp: Path, rng: random.Random, steps: int, max_kills: int, policy: str, periodic: bool, allowed: list[str]
) -> dict:
    tmp.mkdir(parents=True)
    doc = config_doc(steps, policy, periodic)
    cfg = write_config(tmp / "tiny.yaml", doc)
    run = tmp / "run"
    kinds = [k for k in allowed if policy in FOR_POLICY.get(k, POLICIES)]
    plan = [rng.choice(kinds) for _ in range(rng.choice(range(1, max_kills + 1)))]
    env = fault_env(plan, rng, steps)
    kills = dict.fromkeys(KILLS, 0)
    proc = kill_as_planned(run, cona("train", str(cfg), "--run-dir", str(run), env=env), plan, rng, env, kills)
    _, err = proc.communicate(timeout=600)
    for kind, place in HOOKS.items():
        kills[kind] = sum(1 for _ in run.glob(f".test-died-*-{place}"))
    kills["disconnect"] = sum(1 for _ in run.glob(".test-disconnected-*"))
    logs = run.glob("logs/*.log")
    kills["load-error"] = sum("reading checkpoint" in log.read_text(errors="replace") for log in logs)
    return {"policy": policy, "periodic": periodic, "kills": kills, **assess(run, doc, steps, proc.returncode, err)}


def kill_as_planned(
    run: Path, proc: subprocess.Popen, plan: list[str], rng: random.Random, env: dict[str, str], kills: dict
) -> subprocess.Popen:
    """Make the kills of `plan` that come from outside (the workers make the others themselves); returns
    the controller in charge at the end (`--resume` starts a new one after a controller kill)."""

    def kill_controller(kind: str) -> None:
        nonlocal proc
        proc.kill()
        proc.wait()
        kills[kind] += 1
        proc = cona("train", "--resume", str(run), env=env)

    for kind in (k for k in plan if k not in HOOKS and k not in FAULTS):
        if kind == "switch-handoff":
            seen = outcome_written(run) or 0  # not the outcome of a launch already past
            if wait_for(proc, lambda seen=seen: (outcome_written(run) or 0) > seen):
                kill_controller(kind)
            continue
        if kind == "standby-start":
            state = wait_for(proc, lambda: (lambda st: st if st and st.standby_pids else None)(RunState.load(run)))
            if state is not None and not RunDir(run).standby_ready(state.launch + 1).is_file():
                os.kill(state.standby_pids[0], signal.SIGKILL)
                kills[kind] += 1
            continue
        at = last_step(run) + rng.randint(1, 8)
        wait_for(proc, lambda at=at: last_step(run) >= at)
        time.sleep(rng.uniform(0, 0.4))
        if proc.poll() is not None:
            break
        state = RunState.load(run)
        ranks = kind in ("worker", "restart", "sigterm")
        pids = worker_pids(run) if ranks else state.agent_pids[:1] if state else []
        if kind == "controller" or not pids:
            kill_controller("controller")
            continue
        os.kill(rng.choice(pids), signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)
        if kind != "restart":
            kills[kind] += 1
            continue
        launch = state.launch if state else 0
        restarted = wait_for(
            proc,
            lambda launch=launch: (lambda st: st if st and st.launch > launch and st.agent_pids else None)(
                RunState.load(run)
            ),
        )
        if restarted is not None:
            os.kill(restarted.agent_pids[0], signal.SIGKILL)
            kills[kind] += 1
    return proc


def final_val_loss(run: Path, steps: int) -> float | None:
    """The validation loss at the run's last step (its final evaluation; the last row of it that stands)."""
    evals = [r for r in rows(run / "metrics.jsonl") if r.get("kind") == "eval" and r.get("step") == steps]
    return evals[-1]["val_loss"] if evals else None


def assess(run: Path, doc: dict, steps: int, returncode: int | None, err: str) -> dict:
    """What a finished run left: whether it completed, its failures, the steps a recovery lost, corrupt
    checkpoints, processes left, its final validation loss."""
    step_rows = [r for r in rows(run / "metrics.jsonl") if r.get("kind") == "step"]
    leftover = job_processes(run)
    ok = returncode == 0 and continuous(step_rows, steps) and not leftover
    lost = 0
    events = rows(run / "events.jsonl")
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
        "failures": sum(e.get("kind") == "failure" for e in events),
        "lost": lost,
        "corrupt": corrupt,
        "leftover": leftover,
        "val_loss": final_val_loss(run, steps),
        "err": "" if ok else err[-1500:],
    }


def extra_failures(r: dict) -> int:
    """Failed launches beyond the kills'. Each kill of a rank or an agent, a rank's SIGTERM and a dropped
    connection fail their launch at most once (not when they hit a job whose controller was dead: the job
    just stops); a restart kill fails two (the killed launch and the restart); a standby killed before its
    hand-over and a transient load error fail none. Any other is recovery's own (a relaunch refused a
    checkpoint, a resumed job collided with a live one, ...)."""
    expected = sum(r["kills"][k] for k in FAILING) + 2 * r["kills"]["restart"]
    return max(0, r["failures"] - expected)


def reference_losses(base: Path, policies: list[str], periodic: list[str], n: int, steps: int) -> dict:
    """Final validation losses of `n` unkilled runs per policy (cycling through the periodic settings)."""
    out: dict[str, list[float]] = {}
    for policy in policies:
        for i in range(n):
            tmp = base / f"reference-{policy}-{i}"
            tmp.mkdir(parents=True)
            doc = config_doc(steps, policy, periodic[i % len(periodic)] == "on")
            proc = cona("train", str(write_config(tmp / "tiny.yaml", doc)), "--run-dir", str(tmp / "run"))
            _, err = proc.communicate(timeout=600)
            loss = final_val_loss(tmp / "run", steps)
            if proc.returncode != 0 or loss is None:
                raise SystemExit(f"chaos: the unkilled {policy} run failed:\n{err[-1500:]}")
            out.setdefault(policy, []).append(loss)
            print(f"unkilled {policy} run {i + 1}/{n}: final validation loss {loss:.4f}", flush=True)
    return out


def in_spread(loss: float | None, spread: list[float] | None, tol: float) -> bool:
    """Whether a final validation loss lies within the unkilled runs' [min, max], widened by `tol` (True
    without unkilled runs to compare with)."""
    if not spread:
        return True
    return loss is not None and min(spread) - tol <= loss <= max(spread) + tol


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help="number of runs")
    parser.add_argument("--policy", default="static", help=f"comma-separated, cycled over runs ({', '.join(POLICIES)})")
    parser.add_argument("--periodic", default="on", help="comma-separated periodic checkpoints, cycled: on, off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30, help="steps per run (a checkpoint every 5)")
    parser.add_argument("--max-kills", type=int, default=2, help="kills per run: 1 to this many, at random")
    parser.add_argument("--kills", default=",".join(KILLS), help="comma-separated kinds of kill to draw from")
    parser.add_argument("--references", type=int, default=2, help="unkilled runs per policy (0: no loss check)")
    parser.add_argument("--loss-tol", type=float, default=0.01, help="widens the unkilled runs' loss spread")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args()
    if args.n < 1 or args.steps < 6 or args.max_kills < 1 or args.references < 0:
        parser.error("n and --max-kills must be >= 1, --steps >= 6, --references >= 0")
    args.policies, args.periodic_settings = args.policy.split(","), args.periodic.split(",")
    if not set(args.policies) <= set(POLICIES):
        unknown = ", ".join(sorted(set(args.policies) - set(POLICIES)))
        parser.error(f"--policy: unknown {unknown} (known: {', '.join(POLICIES)})")
    args.allowed = args.kills.split(",")
    if not set(args.allowed) <= set(KILLS):
        parser.error(
            f"--kills: unknown {', '.join(sorted(set(args.allowed) - set(KILLS)))} (known: {', '.join(KILLS)})"
        )
    for policy in args.policies:
        if not any(policy in FOR_POLICY.get(k, POLICIES) for k in args.allowed):
            parser.error(f"--kills: none of {args.kills} applies to policy {policy}")
    if not set(args.periodic_settings) <= {"on", "off"}:
        parser.error(f"--periodic: {args.periodic!r}: give on, off or on,off")
    return args


def describe(i: int, n: int, r: dict) -> str:
    killed = ", ".join(f"{k} {c}" for k, c in r["kills"].items() if c) or "none"
    loss = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "none"
    return (
        f"run {i + 1}/{n} ({r['policy']}, periodic {'on' if r['periodic'] else 'off'}): "
        f"{'completed' if r['ok'] else 'FAILED'}, kills: {killed}; failures recorded {r['failures']}, "
        f"beyond the kills {r['extra_failures']}, lost {r['lost']} steps, corrupt checkpoints {r['corrupt']}, "
        f"processes left {len(r['leftover'])}, final validation loss {loss}"
        f"{'' if r['in_spread'] else ' (OUTSIDE the unkilled runs)'}"
    )


def print_table(results: list[dict], policies: list[str], periodic: list[str]) -> None:
    head = "| policy | periodic | runs | completed | kills | extra failures | most steps lost | corrupt | left |"
    print(f"\n{head} val loss outside |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for policy in policies:
        for on in sorted({p == "on" for p in periodic}, reverse=True):
            group = [r for r in results if r["policy"] == policy and r["periodic"] == on]
            if group:
                kills = sum(sum(r["kills"].values()) for r in group)
                print(
                    f"| {policy} | {'on' if on else 'off'} | {len(group)} | {sum(r['ok'] for r in group)} | {kills} | "
                    f"{sum(r['extra_failures'] for r in group)} | {max(r['lost'] for r in group)} | "
                    f"{sum(r['corrupt'] for r in group)} | {sum(len(r['leftover']) for r in group)} | "
                    f"{sum(not r['in_spread'] for r in group)} |"
                )


def print_summary(results: list[dict], spreads: dict[str, list[float]], tol: float) -> None:
    print(f"\nruns completed:          {sum(r['ok'] for r in results)}/{len(results)}")
    by_kind = ", ".join(f"{k} {sum(r['kills'][k] for r in results)}" for k in KILLS)
    print(f"kills survived:          {sum(sum(r['kills'].values()) for r in results if r['ok'])} ({by_kind})")
    # A rank killed with SIGKILL fails its launch: the controller records a failure and restarts.
    print(f"launch failures recorded: {sum(r['failures'] for r in results)}")
    print(f"checkpoints corrupted:   {sum(r['corrupt'] for r in results)}")
    print(f"largest loss of progress: {max((r['lost'] for r in results), default=0)} steps")
    losses = sorted({round(r["val_loss"], 4) for r in results if r["val_loss"] is not None})
    print(f"final validation losses (distinct): {losses}")
    ranges = ", ".join(f"{p} [{min(v):.4f}, {max(v):.4f}]" for p, v in spreads.items()) or "none run"
    inside = sum(r["in_spread"] for r in results)
    print(f"within the unkilled runs' spread (+-{tol:g}): {inside}/{len(results)} (unkilled: {ranges})")


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    base = Path(tempfile.mkdtemp(prefix="cona-chaos-"))
    os.environ.setdefault("CONA_CACHE", str(base / "cache"))
    ENV.setdefault("CONA_CACHE", os.environ["CONA_CACHE"])
    t0 = time.monotonic()
    spreads = reference_losses(base, args.policies, args.periodic_settings, args.references, args.steps)
    results = []
    for i in range(args.n):
        policy = args.policies[i % len(args.policies)]
        on = args.periodic_settings[(i // len(args.policies)) % len(args.periodic_settings)] == "on"
        r = one_run(base / f"run{i:03d}", rng, args.steps, args.max_kills, policy, on, args.allowed)
        r["extra_failures"] = extra_failures(r)
        r["in_spread"] = in_spread(r["val_loss"], spreads.get(policy), args.loss_tol)
        results.append(r)
        print(describe(i, args.n, r), flush=True)
        if r["err"]:
            print(r["err"], flush=True)
    print_table(results, args.policies, args.periodic_settings)
    print_summary(results, spreads, args.loss_tol)
    print(f"wall time:               {time.monotonic() - t0:.0f} s  ({base})")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r["ok"] and not r["corrupt"] and not r["leftover"] and r["in_spread"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
