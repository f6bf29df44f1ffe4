"""Run under torchrun: the GNS inputs and the base LR's hypergradient, summed over TP/PP shards, equal a
single-process computation.

Both measure Adam-preconditioned gradients, P g with P = 1 / (√(v / (1 - β2^t)) + ε): the optimizer
state is set by hand to v = θ² + V0 and m = M0·θ at step t = STEP for every parameter (the same function
of the same initial weights in both), so the reference computes P from the full weights. Both leave out
the family's vocab_params (embeddings, output heads). The hypergradient's cosine g·u / (|g| |u|), u =
m̂ P + λθ the last update's direction, is read over every parameter (`launch.lr_calibration`).

Usage: torchrun --standalone --nproc-per-node W tests/dist/gns_shards.py RUN_DIR OUT_JSON LAYOUT[,LAYOUT]
LAYOUT: dp-tp-pp, or fsdp-dp-tp-pp for FSDP (whose small batch is every replica's first micro-batch).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from cona_core.gns import two_batch_estimate
from cona_core.strategy import Strategy
from launch.data.corpus import CorpusInfo
from launch.data.sampling import TokenStream, replica_microbatches
from launch.models import get_spec
from launch.worker import Worker
from tests.dist.common import start

MBS, GBS = 2, 16
STEP, V0, M0 = 7, 1e-3, 1e-2


def second_moment(p: torch.Tensor) -> torch.Tensor:
    """The hand-set Adam second moment (elementwise: a DTensor keeps its parameter's placements)."""
    return p.detach() ** 2 + V0


def set_adam_state(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(float(STEP)),
                "exp_avg": p.detach() * M0,
                "exp_avg_sq": second_moment(p),
            }


def reference(cfg, corpus: CorpusInfo, s: Strategy, fsdp: bool) -> tuple[float, float, float]:
    """Single process: (|G|^2, tr(Sigma)) raw estimates for the first step under strategy s, and the
    hypergradient's cosine of the step's whole gradient."""
    m = cfg.model
    spec = get_spec(m.family)
    model = spec.build(m, corpus.vocab_size)
    model.init_weights(cfg.train.seed)
    stream = TokenStream(corpus.train_path, m.seq_len, cfg.train.seed, spec.batch(corpus.vocab_size))

    beta2, eps = cfg.train.beta2, 1e-8  # AdamW's default eps
    precond = {n: 1 / ((second_moment(p) / (1 - beta2**STEP)).sqrt() + eps) for n, p in model.named_parameters()}

    def grad_sq(x: torch.Tensor, y: torch.Tensor) -> float:
        model.zero_grad()
        spec.loss(model(x), y).backward()
        counted = [(n, p) for n, p in model.named_parameters() if n not in spec.vocab_params]
        return float(sum((p.grad * precond[n]).double().pow(2).sum() for n, p in counted))

    big = grad_sq(*stream.samples(0, s.gbs))
    beta1, decay = cfg.train.beta1, cfg.train.weight_decay
    with torch.no_grad():  # the gradients of the whole batch, left by grad_sq
        u = {n: M0 * p / (1 - beta1**STEP) * precond[n] + decay * p for n, p in model.named_parameters()}
        params = list(model.named_parameters())
        gu = sum(float((p.grad.double() * u[n].double()).sum()) for n, p in params)
        gg = sum(float(p.grad.double().pow(2).sum()) for _, p in params)
        uu = sum(float(u[n].double().pow(2).sum()) for n, _ in params)
    cosine = gu / (gg * uu) ** 0.5
    if fsdp:  # every replica's first micro-batch, reduced over dp as FSDP does with each micro-batch
        first = [replica_microbatches(stream, 0, s.gbs, s.dp, r, s.mbs)[0] for r in range(s.dp)]
        small = grad_sq(torch.cat([x for x, _ in first]), torch.cat([y for _, y in first]))
        return (*two_batch_estimate(s.dp * s.mbs, small, s.gbs, big), cosine)
    if s.dp > 1:
        replicas = [replica_microbatches(stream, 0, s.gbs, s.dp, r, s.mbs) for r in range(s.dp)]
        small = sum(grad_sq(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])) for mbs in replicas) / s.dp
        return (*two_batch_estimate(s.gbs // s.dp, small, s.gbs, big), cosine)
    x, y = replica_microbatches(stream, 0, s.gbs, 1, 0, s.mbs)[0]  # dp = 1: the first micro-batch
    return (*two_batch_estimate(s.mbs, grad_sq(x, y), s.gbs, big), cosine)


def main() -> None:
    run_dir, out, cfg, corpus = start()
    results = {}
    for layout in sys.argv[3].split(","):
        fsdp = layout.startswith("fsdp-")
        dp, tp, pp = (int(v) for v in layout.removeprefix("fsdp-").split("-"))
        s = Strategy(dp, tp, pp, MBS, GBS)
        impl = dataclasses.replace(cfg.train, dp_impl="fsdp" if fsdp else "ddp")
        w = Worker(dataclasses.replace(cfg, train=impl), run_dir, s, launch=1)
        set_adam_state(w.opt)
        w.state.gns_from_step = 0  # measure from this step (a worker holds the estimator while v̂ is young)
        w._calibrating = lambda: True  # read the hypergradient at this step (a worker waits for warmup)
        noise = w.train_step(False).noise
        ref = reference(cfg, corpus, s, fsdp)
        results[layout] = {
            "grad_sq": noise["grad_sq_raw"],
            "trace": noise["trace_raw"],
            "ref_grad_sq": ref[0],
            "ref_trace": ref[1],
            "cosine": w.lr_calibration.cosines[0],
            "ref_cosine": ref[2],
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
