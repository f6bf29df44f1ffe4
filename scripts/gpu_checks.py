"""GPU checks of the engine on one node (up to 8 GPUs, about 10 minutes); prints one table.

    torchrun --standalone --nproc-per-node 8 scripts/gpu_checks.py [--out FILE] [--checks layouts,reshard]
    torchrun --standalone --nproc-per-node 4 scripts/gpu_checks.py --cpu     # reduced smoke run on gloo

Exits 1 when any row fails (or none ran), 0 otherwise: a gate. `--fail-check TEXT` marks the rows whose
check or layout contains TEXT as failed, to test that gate.

Checks (TF32 off): every feasible (dp, tp, pp) layout against a plain single-device fp32 reference
(loss within 1e-3 over a few steps); bf16 against fp32 over 100 steps (loss within 2%); measured peak
memory against the planner's estimate per layout (ratio, target within +-20%); DCP resharding through
up to three layouts and back to the first (each layout trains a step, saves into its own folder, and the
next one loads that save: weights and Adam moments exact); the pure data-parallel step time against a plain
single-device loop at the same per-device batch (ratio <= 1.10), and the step that measures the noise
scale against the same step without (ratio <= 1.10). `--cpu` runs the same code on gloo with
a tiny model and fewer steps: it exercises the script, its figures say nothing about GPUs (the memory
ratio there compares the process's peak resident set, interpreter and libraries included).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from cona_cli.planner.costmodel import as_array
from cona_cli.planner.memory import memory_bytes
from cona_cli.planner.workload import Workload
from cona_core.config import Config, config_from_dict
from cona_core.strategy import Strategy
from launch.data.corpus import CorpusInfo, prepare_corpus
from launch.data.sampling import TokenStream
from launch.device import init_distributed, reset_peak_memory, synchronize
from launch.lr import learning_rate
from launch.materialise import build_model
from launch.models import get_spec
from launch.worker import Worker

GPU_MODEL = {"n_layers": 8, "d_model": 1024, "n_heads": 16, "ffn": 4096, "seq_len": 1024}
CPU_MODEL = {"n_layers": 4, "d_model": 32, "n_heads": 4, "ffn": 64, "seq_len": 32}
CHECKS = ("layouts", "bf16", "reshard", "time")  # the groups of rows, in the order they run


def make_config(cpu: bool, world: int) -> Config:
    return config_from_dict(
        {
            "model": CPU_MODEL if cpu else GPU_MODEL,
            "data": {"tokenizer": "byte", "synthetic_tokens": 40_000 if cpu else 4_000_000},
            "cluster": {"procs_per_node": world, "backend": "gloo" if cpu else "auto"},
            "train": {"lr": 1e-3, "warmup_tokens": 0, "seed": 7, "max_steps": 100, "grad_clip": 1.0, "gns": False},
            "search": {"precision": "fp32"},  # the layout rows compare fp32 runs; the bf16 rows set theirs
            "strategy": f"dp{world}-tp1-pp1-mbs1-gbs{world}",
        },
        "gpu_checks",
    )


def with_precision(cfg: Config, precision: str) -> Config:
    return dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, precision=precision))


def plain_losses(
    cfg: Config, corpus: CorpusInfo, gbs: int, steps: int, device: torch.device
) -> tuple[list[float], float]:
    """A plain single-device loop (same init, data, clipping, AdamW, LR): losses and median step seconds."""
    m, t = cfg.model, cfg.train
    spec = get_spec(m.family)
    model = build_model(spec, m, corpus.vocab_size, t.seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    stream = TokenStream(corpus.train_path, m.seq_len, t.seed, spec.batch(corpus.vocab_size))
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = (z.to(device) for z in stream.samples(step * gbs, gbs))
        for g in opt.param_groups:
            g["lr"] = learning_rate(t, step * gbs * m.seq_len, step * gbs * m.seq_len, gbs)
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
        if t.grad_clip and norm > t.grad_clip:
            for p in model.parameters():
                p.grad.mul_(t.grad_clip / (norm + 1e-6))
        opt.step()
        losses.append(loss.item())
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return losses, sorted(times[2:])[len(times[2:]) // 2] if steps > 3 else times[-1]


def full_state(w: Worker) -> dict[str, torch.Tensor]:
    """Whole-model parameters and Adam moments by name, gathered on every rank (on the CPU)."""
    local = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in w.pm.model.named_parameters()
    }
    osd = get_optimizer_state_dict(w.pm.model, w.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    for key, v in osd.items():
        if key.endswith(("exp_avg", "exp_avg_sq")):
            local[key] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
    parts: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def layouts(cfg: Config, world: int) -> list[tuple[int, int, int]]:
    found = []
    for pp in (p for p in range(1, world + 1) if world % p == 0):
        for tp in (t for t in range(1, world // pp + 1) if (world // pp) % t == 0):
            if not cfg.problems(Strategy(world // (tp * pp), tp, pp, 1, 4 * world)):
                found.append((world // (tp * pp), tp, pp))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="reduced smoke run on gloo (no GPU needed)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma-separated groups to run (default: all of {','.join(CHECKS)})"
    )
    parser.add_argument("--fail-check", metavar="TEXT", help="mark the rows whose check or layout contain TEXT failed")
    args = parser.parse_args()
    checks = set(args.checks.split(","))
    if not checks <= set(CHECKS):
        parser.error(f"--checks: unknown {', '.join(sorted(checks - set(CHECKS)))} (known: {', '.join(CHECKS)})")
    world = int(__import__("os").environ["WORLD_SIZE"])
    cfg = make_config(args.cpu, world)
    device = init_distributed(cfg.cluster)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1 if args.cpu else torch.get_num_threads())
    rank = dist.get_rank()
    shared = [tempfile.mkdtemp(prefix="gpu_checks-") if rank == 0 else None]
    dist.broadcast_object_list(shared)
    run_dir = Path(shared[0])
    if rank == 0:
        (run_dir / "config.resolved.json").write_text(json.dumps(cfg.to_raw()))
        (run_dir / "corpus.json").write_text(prepare_corpus(cfg.data, seed=cfg.train.seed).to_json())
    dist.barrier()
    corpus = CorpusInfo.from_json((run_dir / "corpus.json").read_text())
    workload = Workload.from_config(cfg, vocab=corpus.vocab_size)
    few, long_steps = (3, 10) if args.cpu else (5, 100)
    gbs, rows = 4 * world, []

    def row(check: str, what: str, value: float, target: str, ok: bool) -> None:
        if args.fail_check and args.fail_check in f"{check} {what}":
            ok, target = False, f"{target} (forced to fail)"
        rows.append({"check": check, "layout": what, "value": value, "target": target, "ok": bool(ok)})

    ref: list[float] = [None]  # type: ignore[list-item]
    if rank == 0 and "layouts" in checks:
        ref = [plain_losses(cfg, corpus, gbs, few, device)[0]]
    dist.broadcast_object_list(ref)
    for dp, tp, pp in layouts(cfg, world) if "layouts" in checks else []:
        s = Strategy(dp, tp, pp, 1, gbs)
        reset_peak_memory(device)
        w = Worker(cfg, run_dir, s, 1, device)
        outs = [w.train_step(False) for _ in range(few)]
        diff = max(abs(o.loss - r) for o, r in zip(outs, ref[0]))
        row("layout vs 1-device fp32", str(s), diff, "<= 1e-3", diff <= 1e-3)
        peak = outs[-1].memory.get("peak_allocated_bytes", outs[-1].memory.get("peak_rss_bytes", 0))
        ratio = peak / float(memory_bytes(as_array([s]), workload)[0])
        row("peak memory / planner", str(s), ratio, "0.8 .. 1.2", 0.8 <= ratio <= 1.2)
        del w, outs
        gc.collect()

    losses = {}
    for precision in ("fp32", "bf16") if "bf16" in checks else ():
        w = Worker(with_precision(cfg, precision), run_dir, Strategy(world, 1, 1, 1, gbs), 1, device)
        losses[precision] = [w.train_step(False).loss for _ in range(long_steps)]
        del w
        gc.collect()
    if losses:
        tail = max(1, long_steps // 10)
        rel = abs(sum(losses["bf16"][-tail:]) / sum(losses["fp32"][-tail:]) - 1)
        row(f"bf16 vs fp32, {long_steps} steps", f"dp{world}", rel, "<= 2%", rel <= 0.02)

    chain = [Strategy(*lay, 1, gbs) for lay in layouts(cfg, world)[:3]] if "reshard" in checks else []
    hops = list(zip(chain, chain[1:] + chain[:1])) if len(chain) > 1 else []  # ... and back to the first
    w = Worker(cfg, run_dir, chain[0], 1, device) if hops else None
    for i, (here, nxt) in enumerate(hops):
        assert w is not None
        # One step under this layout, then its own save into a folder of its own: a restored Worker's
        # `saved` names the checkpoint it came from, and a save at that step would hand that one back.
        w.train_step(False)
        w.checkpointer.root = run_dir / f"reshard-{i}"
        before, path = full_state(w), w.checkpointer.save("switch")
        own = path.parent == w.checkpointer.root
        w = Worker(cfg, run_dir, nxt, i + 2, device)
        w.restore(path)
        after = full_state(w)
        diff = (
            max(float((before[k] - after[k]).abs().max()) for k in before)
            if own and before.keys() == after.keys()
            else math.inf
        )
        row("DCP reshard (exact)", f"{here} -> {nxt}", diff, "== 0", diff == 0)
    del w
    gc.collect()
    if "time" in checks:
        row_time(cfg, corpus, run_dir, world, gbs, few, device, row)

    failed = [True]
    if rank == 0:
        mode = "CPU smoke (gloo; figures say nothing about GPUs)" if args.cpu else f"{torch.cuda.get_device_name()}"
        print(f"\ncona GPU checks: {world} ranks, {mode}")
        print(f"{'check':<26} {'layout':<52} {'value':>10}  {'target':<11} ok")
        for r in rows:
            ok = "yes" if r["ok"] else "NO"
            print(f"{r['check']:<26} {r['layout']:<52} {r['value']:>10.4g}  {r['target']:<11} {ok}")
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
        failed = [not rows or not all(r["ok"] for r in rows)]
        bad = sum(not r["ok"] for r in rows)
        print(f"{bad} of {len(rows)} checks failed" if rows else "no check ran", flush=True)
    dist.broadcast_object_list(failed)  # rank 0's verdict: every rank exits with it
    dist.destroy_process_group()
    sys.exit(1 if failed[0] else 0)


def median_step(w: Worker, steps: int, device) -> float:
    """Median seconds per `train_step`, device synchronised, the first two steps left out."""
    measured = []
    for _ in range(steps):
        t0 = time.perf_counter()
        w.train_step(False)
        synchronize(device)
        measured.append(time.perf_counter() - t0)
    return sorted(measured[2:])[len(measured[2:]) // 2]


def row_time(cfg: Config, corpus: CorpusInfo, run_dir: Path, world: int, gbs: int, few: int, device, row) -> None:
    """The pure data-parallel step time against a plain single-device loop at the same per-device batch,
    and the step with the noise scale measured against the same step without (two micro-batches each)."""
    per_device = gbs // world
    times = [None]
    if dist.get_rank() == 0:
        times = [plain_losses(cfg, corpus, per_device, few + 5, device)[1]]
    dist.broadcast_object_list(times)
    step = median_step(Worker(cfg, run_dir, Strategy(world, 1, 1, per_device, gbs), 1, device), few + 5, device)
    ratio = step / times[0]
    row("step time / plain loop", f"dp{world} (same batch per device)", ratio, "<= 1.10", ratio <= 1.1)
    s = Strategy(world, 1, 1, max(1, per_device // 2), gbs)
    steps = {}
    for gns in (False, True):
        w = Worker(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, gns=gns)), run_dir, s, 1, device)
        w.state.gns_from_step = 1  # measured from the second step (Adam's second moment exists then)
        steps[gns] = median_step(w, few + 5, device)
        del w
        gc.collect()
    ratio = steps[True] / steps[False]
    row("step with GNS / without", str(s), ratio, "<= 1.10", ratio <= 1.1)


if __name__ == "__main__":
    main()
