"""Run under torchrun (4 ranks): every layout (and FSDP under TP and PP) vs a single-process reference,
DCP resharding, and in-place resizes vs a relaunch from a checkpoint.

Usage: torchrun --standalone --nproc-per-node 4 tests/dist/layouts.py OUT_JSON RUN_DIR...
Each RUN_DIR holds config.resolved.json and corpus.json (written by the pytest side) of one model family;
OUT_JSON maps each family to its results (one torchrun for all: each start costs seconds).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from cona_core.strategy import Strategy
from launch import checkpoint
from launch import worker as worker_module
from launch.data.corpus import CorpusInfo
from launch.data.sampling import TokenStream
from launch.device import headroom_bytes
from launch.layout import build_layout, prepare_layout
from launch.lr import learning_rate
from launch.materialise import build_model
from launch.models import get_spec
from launch.models.spec import IGNORE_INDEX
from launch.snapshot import Snapshot
from launch.worker import Worker
from tests.dist.common import join, load_run

LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4), (1, 4, 1)]
STEPS = 2  # the second step's loss already depends on the first step's clip and AdamW update
FSDP_LAYOUTS = [(2, 2, 1), (2, 1, 2)]
# The other families differ from GPT only in their TP plans, pipeline splits and tied weights: the layouts
# that use all three (TP 2 and 4, 4 stages, TP with PP) and FSDP under PP (a tied weight sharded twice).
FAMILY_LAYOUTS = [(1, 2, 2), (1, 1, 4), (1, 4, 1)]
FAMILY_FSDP_LAYOUTS = [(2, 1, 2)]
RESHARD = [
    ((2, 2, 1, 2, 16), (4, 1, 1, 2, 16)),
    ((4, 1, 1, 2, 16), (1, 2, 2, 2, 16)),
    ((2, 1, 2, 2, 16), (1, 1, 4, 2, 16)),
    ((2, 2, 1, 2, 16), (2, 1, 2, 1, 32)),
]
# (from, to): DDP with larger micro-batches, TP with more accumulation steps, dp = 1 (first micro-batch GNS)
RESIZE = [((4, 1, 1, 2, 8), (4, 1, 1, 4, 16)), ((2, 2, 1, 4, 8), (2, 2, 1, 4, 16)), ((1, 4, 1, 4, 8), (1, 4, 1, 8, 16))]


def reference_losses(cfg, corpus: CorpusInfo, gbs: int, steps: int) -> tuple[list[float], list[float]]:
    """Plain single-process training: the same init, data, clipping, AdamW and LR rule. Returns the step
    losses and their exact means per target (differ for a masked LM, whose loss has a fixed divisor)."""
    m, t = cfg.model, cfg.train
    spec = get_spec(m.family)
    model = spec.build(m, corpus.vocab_size)
    model.init_weights(t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    stream = TokenStream(corpus.train_path, m.seq_len, t.seed, spec.batch(corpus.vocab_size))
    losses, means = [], []
    for step in range(steps):
        x, y = stream.samples(step * gbs, gbs)
        for g in opt.param_groups:
            g["lr"] = learning_rate(t, step * gbs * m.seq_len, step * gbs * m.seq_len, gbs)
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        if t.grad_clip and norm > t.grad_clip:
            for p in model.parameters():
                p.grad.mul_(t.grad_clip / (norm + 1e-6))
        opt.step()
        losses.append(loss.item())
        means.append(loss.item() * y.numel() * spec.target_fraction / int((y != IGNORE_INDEX).sum()))
    return losses, means


def full_state(w: Worker) -> dict[str, torch.Tensor]:
    """Whole-model parameters and Adam moments by fully qualified name, gathered on every rank."""
    local = {}
    for name, p in w.pm.model.named_parameters():
        local[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    osd = get_optimizer_state_dict(w.pm.model, w.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    for key, v in osd.items():
        if key.startswith("state.") and key.endswith(("exp_avg", "exp_avg_sq")):
            local[key] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def tied_copies_equal(w: Worker) -> list[bool]:
    """Whether the end stages' copies of each tied parameter are still equal (pp > 1; [] otherwise)."""
    if w.pm.tie_group is None:
        return []
    out = []
    for p in w.pm.tied:
        mine = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        other = mine.clone()
        dist.broadcast(other, group=w.pm.tie_group, group_src=0)
        out.append(bool(torch.equal(mine, other)))
    return out


def one_rank_cannot_load(w: Worker, path) -> list[str]:
    """Every rank's error when only the last rank's read fails: all of them must fail, not wait."""
    load = checkpoint.dcp.load

    def garbled(*args, **kwargs) -> None:
        raise ValueError("shard garbled on this rank")

    if dist.get_rank() == dist.get_world_size() - 1:
        checkpoint.dcp.load = garbled
    try:
        w.restore(path)
        error = "loaded"
    except checkpoint.CheckpointError as e:
        error = str(e)
    finally:
        checkpoint.dcp.load = load
    errors: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def resize_vs_relaunch(cfg, run_dir, a: Strategy, b: Strategy, i: int) -> dict:
    """Two steps under `a`, the controller's resize to `b` read during the second, two steps under `b`;
    against a relaunch under `b` from the checkpoint taken right after the resize. With β2 = 0.5 the GNS
    estimator is held for 2 steps at the start and after the resize: both sides measure the 3rd step after."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, beta2=0.5))
    wa = Worker(cfg, run_dir, a, launch=1)
    wa.checkpointer.root = run_dir / f"resize_{i}"
    wa.train_step(False)
    if wa.rank == 0:
        wa.commands.resize_requested = b  # what Commands.poll sets on a `resize` command
    ran = wa.train_step(False).strategy
    path = wa.checkpointer.save("periodic")
    in_place = [wa.train_step(False) for _ in range(3)]
    wb = Worker(cfg, run_dir, b, launch=2)
    wb.restore(path)
    relaunched = [wb.train_step(False) for _ in range(3)]
    return {
        "ran": [str(ran), str(in_place[0].strategy)],
        "in_place": [[o.loss, o.grad_norm, o.noise.get("grad_sq_raw"), o.noise.get("trace_raw")] for o in in_place],
        "relaunch": [[o.loss, o.grad_norm, o.noise.get("grad_sq_raw"), o.noise.get("trace_raw")] for o in relaunched],
        "eval": [wa.evaluator.evaluate()[0], wb.evaluator.evaluate()[0]],
        "consumed": [wa.state.consumed_samples, wb.state.consumed_samples],
    }


def snapshot_replays(cfg, run_dir, s: Strategy) -> dict:
    """Two steps, the in-memory snapshot restored, the same two steps again (with pp = 1 after a resize and a
    step at the doubled batch in between, as a paired trial's second arm): the replay repeats them exactly."""
    w = Worker(cfg, run_dir, s, launch=1)
    w.train_step(False)
    snap = Snapshot.take(w.pm.model, w.opt, w.state)
    first = [w.train_step(False).loss for _ in range(2)]
    if s.pp == 1:  # in-place resizes keep pp = 1
        w.resize(dataclasses.replace(s, gbs=2 * s.gbs))
    w.train_step(False)
    w.state = snap.restore(w.pm.model, w.opt)
    if s.pp == 1:
        w.resize(s)
    return {"first": first, "replay": [w.train_step(False).loss for _ in range(2)]}


def micro_batch(tp: int) -> int:
    """Two samples per micro-batch (accumulation under DDP and PP), four under TP: every TP micro-batch
    costs dozens of collectives, and 4 ranks on 2 cores make each a context switch."""
    return 4 if tp > 1 else 2


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM) in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def sharded_start(cfg, corpus: CorpusInfo) -> dict:
    """A 110M-parameter GPT under FSDP over the 4 ranks: how much each rank's peak resident set grows while
    its layout is built (Linux's peak reset, clear_refs 5), against the model whole in fp32, and whether
    the gathered parameters equal a one-process build's, bit for bit."""
    big = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, n_layers=8, d_model=1024, ffn=4096, n_heads=8),
        train=dataclasses.replace(cfg.train, dp_impl="fsdp"),
    )
    spec = get_spec(big.model.family)
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss()
    layout = build_layout(big, Strategy(4, 1, 1, 1, 4), torch.device("cpu"), corpus.vocab_size)
    growth = _peak_rss() - before
    whole = build_model(spec, big.model, corpus.vocab_size, big.train.seed, torch.device("cpu"))
    reference = dict(whole.named_parameters())
    equal = all(torch.equal(p.full_tensor(), reference[n]) for n, p in layout.pm.model.named_parameters())
    growths: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(growths, growth)
    return {"growth": growths, "whole_bytes": 4 * sum(p.numel() for p in reference.values()), "equal": equal}


def fsdp_unsharded_accumulation(cfg, run_dir, full_rank: int | None = None) -> dict:
    """FSDP, dp 4 and four micro-batches for three steps: the first two reduce-scatter every micro-batch's
    gradients; the second votes (memory is plentiful unless `full_rank` says it has no room), and the
    third skips the two middle ones if every rank agreed."""
    fsdp = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dp_impl="fsdp"))
    w = Worker(fsdp, run_dir, Strategy(4, 1, 1, 1, 16), launch=1)
    if dist.get_rank() == full_rank:
        worker_module.headroom_bytes = lambda device, margin: 0.0
    calls, losses, accumulating = [0], [], []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        per_step = []
        for _ in range(STEPS + 1):
            calls[0] = 0
            accumulating.append(w.pm.accumulate_unsharded)
            losses.append(w.train_step(False).loss)
            per_step.append(calls[0])
    finally:
        dist.reduce_scatter_single = reduce_scatter
        worker_module.headroom_bytes = headroom_bytes
    return {"losses": losses, "reduce_scatters": per_step, "accumulating": accumulating}


def family_results(run_dir: Path, cfg, corpus: CorpusInfo) -> dict:
    results: dict = {"layouts": {}, "fsdp": {}, "reshard": [], "tied_equal": []}
    gbs = 16
    # four steps: the reference shows the tiny model trains (its loss falls out of the warmup)
    results["reference"], results["reference_mean"] = reference_losses(cfg, corpus, gbs, 4)
    gpt = cfg.model.family == "gpt"
    for dp, tp, pp in LAYOUTS if gpt else FAMILY_LAYOUTS:
        s = Strategy(dp, tp, pp, micro_batch(tp), gbs)
        w = Worker(cfg, run_dir, s, launch=1)
        results["layouts"][str(s)] = [w.train_step(False).loss for _ in range(STEPS)]
        results["tied_equal"] += tied_copies_equal(w)
    fsdp = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dp_impl="fsdp"))
    for dp, tp, pp in FSDP_LAYOUTS if gpt else FAMILY_FSDP_LAYOUTS:
        s = Strategy(dp, tp, pp, micro_batch(tp), gbs)
        w = Worker(fsdp, run_dir, s, launch=1)
        results["fsdp"][str(s)] = [w.train_step(False).loss for _ in range(STEPS)]
        results["tied_equal"] += tied_copies_equal(w)
    # every pair for GPT; for the others the two that move family-specific weights into TP + PP and from TP to PP
    pairs = RESHARD if gpt else [RESHARD[1], RESHARD[3]]
    for i, (a, b) in enumerate(pairs):
        wa = Worker(cfg, run_dir, Strategy(*a), launch=1)
        wa.checkpointer.root = run_dir / f"ckpt_{i}"
        wa.train_step(False)  # one step: the Adam moments exist
        before, loss_a = full_state(wa), wa.evaluator.evaluate()[0]
        path = wa.checkpointer.save("switch")
        # the second pair loads into a layout built ahead of its launch, as a standby does
        ahead = (a, b) == RESHARD[1]
        layout = prepare_layout(cfg, Strategy(*b), wa.device, corpus.vocab_size) if ahead else None
        wb = Worker(cfg, run_dir, Strategy(*b), launch=2, layout=layout)
        wb.restore(path)
        after, loss_b = full_state(wb), wb.evaluator.evaluate()[0]
        max_diff = max(float((before[k] - after[k]).abs().max()) for k in before)
        results["reshard"].append(
            {
                "from": str(Strategy(*a)),
                "to": str(Strategy(*b)),
                "keys": len(before),
                "same_keys": sorted(before) == sorted(after),
                "max_abs_diff": max_diff,
                "loss_before": loss_a,
                "loss_after": loss_b,
                "step": wb.state.step,
                "consumed": wb.state.consumed_samples,
                "prepared": wb.prepared,
            }
        )
    if gpt:  # a failed load, a resize and a snapshot touch no family-specific code: one family keeps the suite short
        results["load_failure"] = one_rank_cannot_load(wb, path)
        results["resize"] = [
            resize_vs_relaunch(cfg, run_dir, Strategy(*a), Strategy(*b), i) for i, (a, b) in enumerate(RESIZE)
        ]
        results["sharded_start"] = sharded_start(cfg, corpus)
        results["fsdp_unsharded"] = fsdp_unsharded_accumulation(cfg, run_dir)
        results["fsdp_unsharded_one_full"] = fsdp_unsharded_accumulation(cfg, run_dir, full_rank=3)
        results["snapshot"] = {
            "ddp-tp": snapshot_replays(cfg, run_dir, Strategy(2, 2, 1, 4, 8)),
            "pp": snapshot_replays(cfg, run_dir, Strategy(2, 1, 2, 2, 8)),
            "fsdp": snapshot_replays(fsdp, run_dir, Strategy(4, 1, 1, 2, 8)),
        }
    return results


def main() -> None:
    out = Path(sys.argv[1])
    join()
    results = {}
    for run_dir in map(Path, sys.argv[2:]):
        cfg, corpus = load_run(run_dir)
        results[cfg.model.family] = family_results(run_dir, cfg, corpus)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
