"""Run under torchrun: the GNS inputs summed over TP/PP shards equal a single-process computation.

Usage: torchrun --standalone --nproc-per-node W tests/dist/gns_shards.py RUN_DIR OUT_JSON dp-tp-pp[,dp-tp-pp]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from cona_cli.gns import two_batch_estimate
from cona_cli.strategy import Strategy
from launch.data import CorpusInfo, TokenStream, replica_microbatches
from launch.models import get_spec
from launch.worker import Worker
from tests.dist.common import start

MBS, GBS = 2, 16


def reference(cfg, corpus: CorpusInfo, s: Strategy) -> tuple[float, float]:
    """Single process: (|G|^2, tr(Sigma)) raw estimates for the first step under strategy s."""
    m = cfg.model
    spec = get_spec(m.family)
    model = spec.build(m, corpus.vocab_size)
    model.init_weights(cfg.train.seed)
    stream = TokenStream(corpus.train_path, m.seq_len, cfg.train.seed, spec.batch(corpus.vocab_size))

    def grad_sq(x: torch.Tensor, y: torch.Tensor) -> float:
        model.zero_grad()
        spec.loss(model(x), y).backward()
        return float(sum(p.grad.double().pow(2).sum() for p in model.parameters()))

    big = grad_sq(*stream.samples(0, s.gbs))
    if s.dp > 1:
        replicas = [replica_microbatches(stream, 0, s.gbs, s.dp, r, s.mbs) for r in range(s.dp)]
        small = sum(grad_sq(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])) for mbs in replicas) / s.dp
        return two_batch_estimate(s.gbs // s.dp, small, s.gbs, big)
    x, y = replica_microbatches(stream, 0, s.gbs, 1, 0, s.mbs)[0]  # dp = 1: the first micro-batch
    return two_batch_estimate(s.mbs, grad_sq(x, y), s.gbs, big)


def main() -> None:
    run_dir, out, cfg, corpus = start()
    results = {}
    for layout in sys.argv[3].split(","):
        dp, tp, pp = (int(v) for v in layout.split("-"))
        s = Strategy(dp, tp, pp, MBS, GBS)
        w = Worker(cfg, run_dir, s, launch=1)
        noise = w.train_step(False).noise
        ref = reference(cfg, corpus, s)
        results[str(s)] = {
            "grad_sq": noise["grad_sq_raw"],
            "trace": noise["trace_raw"],
            "ref_grad_sq": ref[0],
            "ref_trace": ref[1],
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
