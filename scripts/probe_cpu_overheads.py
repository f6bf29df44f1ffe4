"""Host overheads of eager training on this CPU, for the cpu-local hardware profile.

One process, one thread, a model so small (d_model 8, 4 tokens, vocab 16) that its FLOPs are
negligible, so every microsecond is dispatch and autograd bookkeeping:
- layer_overhead_us: slope of forward+backward time over 1, 2, 4 and 8 layers;
- microbatch_overhead_us: the intercept (embedding, head, loss, autograd start: what every micro-batch
  pays once, whatever its depth);
- optimizer: grad-norm clip + AdamW step + zero_grad of the 4-layer model (part of step_overhead_ms;
  the rest is cona's per-step bookkeeping, which bench_layouts.py prints as cona vs a plain loop).
Medians of 200 timed repetitions after 20 warm-up ones (--reps, --warmup).

Usage: .venv/bin/python scripts/probe_cpu_overheads.py [--reps 200] [--warmup 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from cona_core.config import ModelConfig
from launch.models.gpt import GPT
from launch.models.gpt import SPEC as GPT_SPEC

LAYERS = (1, 2, 4, 8)
VOCAB = 16


def median_s(fn: Callable[[], None], reps: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tiny_model(n_layers: int) -> GPT:
    model = GPT(ModelConfig(n_layers=n_layers, d_model=8, n_heads=2, ffn=16, seq_len=4), VOCAB)
    model.init_weights(0)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200, help="timed repetitions (the median counts)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed repetitions before them")
    args = ap.parse_args()
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    x, y = torch.randint(0, VOCAB, (1, 4)), torch.randint(0, VOCAB, (1, 4))
    loss = GPT_SPEC.loss
    fwd_bwd = {}
    for n in LAYERS:
        model = tiny_model(n)
        fwd_bwd[n] = median_s(lambda m=model: loss(m(x), y).backward(), args.reps, args.warmup)
    slope, intercept = np.polyfit(LAYERS, [fwd_bwd[n] for n in LAYERS], 1)
    model = tiny_model(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    optimizer_s = median_s(optimizer_step, args.reps, args.warmup)
    print("forward+backward by layers: " + ", ".join(f"{n}: {fwd_bwd[n] * 1e6:.0f} us" for n in LAYERS))
    print(f"layer_overhead_us: {slope * 1e6:.0f}")
    print(f"microbatch_overhead_us: {intercept * 1e6:.0f}")
    print(f"optimizer (clip + AdamW + zero_grad, 4 layers): {optimizer_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
