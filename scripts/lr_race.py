"""Diagnostic: does a short trial after warmup find the base LR that long trials (`cona tune-lr`) find?

Trains the config's model in one process at `--gbs` through the config's warmup at `train.lr`, then,
from that state (an in-memory copy, restored before each branch), runs one branch per LR in `--lrs`
(constant, every branch on the same batches) for `--steps` steps, and prints each branch's validation
loss after each of `--checks` steps (the same held-out batches for all) beside two one-step signals read
over the branch's steps, which cost nothing in a run:
- the hypergradient's cosine, Σ g_t·d_{t−1} / √(Σ|g_t|² Σ|d_{t−1}|²), d the last update (Baydin et al.
  2018): positive where a longer step would have lowered the loss, negative where the steps overshoot;
- its t-statistic over the branch's first 50 steps (the cosine drifts negative as training goes on).
A trial of M steps per LR picks the LR of the lowest loss at M; where that agrees with the long trials'
best at a small M, a run could set its own base LR for the cost of the losing branches.

    python scripts/lr_race.py [--config configs/tiny.yaml] [--data DIR] [--gbs 8]
        [--lrs 0.5,1,2,4 (× train.lr)] [--checks 25,50,100,200] [--eval-batches 16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIGNAL_STEPS = 50  # the hypergradient is read over a branch's first steps, where it is read in a run


def numbers(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(prog="lr_race.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--data", help="data.path (default: the config's)")
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--lrs", type=numbers, default=[0.5, 1.0, 2.0, 4.0], help="multiples of train.lr")
    ap.add_argument("--checks", type=numbers, default=[25, 50, 100, 200], help="steps after warmup")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument(
        "--online",
        type=float,
        metavar="Z",
        help="instead: train the config's schedule over --tokens at train.lr, at 2× it, and under the online rule "
        "(after warmup, raise the LR by √2 while the last 50 steps' hypergradient t-statistic exceeds Z), "
        "and print each one's validation loss",
    )
    ap.add_argument("--tokens", type=int, default=400_000, help="the schedule's length with --online")
    args = ap.parse_args()
    checks = sorted({int(c) for c in args.checks})
    lrs_ok = bool(args.lrs) and min(args.lrs) > 0
    if min(args.gbs, args.eval_batches) < 1 or not lrs_ok or not checks or checks[0] < 1 or checks[-1] < 3:
        ap.error("--gbs, --eval-batches and every check must be >= 1 (the last >= 3), every LR multiple > 0")

    from gns_vocab_share import one_process_run

    from cona_core.shape import SPECIAL_TOKENS
    from launch.data.corpus import prepare_corpus
    from launch.data.sampling import TokenStream
    from launch.snapshot import Snapshot

    torch, model, opt, stream, spec, cfg = one_process_run(args.config, args.data)
    t, seq, b = cfg.train, cfg.model.seq_len, args.gbs
    corpus = prepare_corpus(cfg.data, t.seed, SPECIAL_TOKENS[cfg.model.family])
    valid = TokenStream(corpus.valid_path, seq, t.seed, spec.batch(corpus.vocab_size))
    params = list(model.parameters())

    def step(i: int, lr: float) -> None:
        """The gradient of step `i` (the stream's i-th batch) at `lr`, left in `.grad` for `update`."""
        for group in opt.param_groups:
            group["lr"] = lr
        model.zero_grad(set_to_none=True)
        x, y = stream.samples(i * b, b)
        spec.loss(model(x), y).backward()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()

    def val_loss() -> float:
        with torch.no_grad():
            losses = []
            for i in range(args.eval_batches):
                x, y = valid.samples(i * b, b)
                losses.append(float(spec.loss(model(x), y)))
            return statistics.fmean(losses)

    warmup = max(1, math.ceil(t.warmup_tokens / (b * seq)))

    def hypergradient_cos(prev: list) -> float | None:
        """g_t·d_{t−1} / (|g_t| |d_{t−1}|), `prev` the parameters before the last update."""
        gd = sum(float((p.grad * (q - p)).sum()) for p, q in zip(params, prev))
        gg = sum(float((p.grad**2).sum()) for p in params)
        dd = sum(float(((q - p) ** 2).sum()) for p, q in zip(params, prev))
        return gd / math.sqrt(gg * dd) if gg * dd > 0 else None

    if args.online is not None:
        start = Snapshot.take(model, opt)  # the model as built: each schedule starts from it
        total = max(warmup + 1, args.tokens // (b * seq))
        decay = max(1, total - warmup)
        print(f"{args.config}: gbs {b}, {total} steps ({warmup} of warmup, cosine to {t.min_lr_ratio} after)")
        for name, fixed in (("train.lr", 1.0), ("2 × train.lr", 2.0), (f"online, z {args.online:g}", None)):
            start.restore(model, opt)
            gain, window, prev, raises = fixed or 1.0, [], None, []
            for i in range(total):
                done = min(1.0, max(0, i + 1 - warmup) / decay)
                shape = (
                    (i + 1) / warmup
                    if i < warmup
                    else t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))
                )
                step(i, t.lr * gain * shape)
                with torch.no_grad():
                    if fixed is None and i >= warmup and prev is not None:
                        c = hypergradient_cos(prev)
                        if c is not None:
                            window.append(c)
                        if len(window) == SIGNAL_STEPS:
                            tstat = statistics.fmean(window) / (statistics.stdev(window) / math.sqrt(len(window)))
                            raises.append(f"{tstat:+.1f}")
                            window = []
                            if tstat > args.online:
                                gain *= math.sqrt(2)
                            else:
                                fixed = gain  # settled: no more reads
                    prev = [p.detach().clone() for p in params] if fixed is None else None
                update()
            reads = ", ".join(raises) or "-"
            print(
                f"  {name}: LR {t.lr * gain:.3g} (t per window: {reads}), validation loss {val_loss():.4f}", flush=True
            )
        return
    for i in range(warmup):
        step(i, t.lr * (i + 1) / warmup)
        update()
    start = Snapshot.take(model, opt)
    print(f"{args.config}: gbs {b}, warmup {warmup} steps at train.lr {t.lr:g}, validation loss {val_loss():.4f}")
    head = " | ".join(f"loss at {c}" for c in checks)
    print(f"| LR | {head} | hypergradient cos (t), first {SIGNAL_STEPS} steps |")
    print("|---|" + "---|" * (len(checks) + 1))
    for mult in args.lrs:
        lr = t.lr * mult
        start.restore(model, opt)
        prev, cos, losses = None, [], []
        for k in range(1, checks[-1] + 1):
            step(warmup + k - 1, lr)
            with torch.no_grad():
                if prev is not None and k <= SIGNAL_STEPS:
                    gd = sum(float((p.grad * (q - p)).sum()) for p, q in zip(params, prev))
                    gg = sum(float((p.grad**2).sum()) for p in params)
                    dd = sum(float(((q - p) ** 2).sum()) for p, q in zip(params, prev))
                    if gg * dd > 0:
                        cos.append(gd / math.sqrt(gg * dd))
                prev = [p.detach().clone() for p in params] if k < SIGNAL_STEPS else None
            update()
            if k in checks:
                losses.append(val_loss())
        mean, sd = statistics.fmean(cos), statistics.stdev(cos)
        row = " | ".join(f"{v:.4f}" for v in losses)
        print(f"| {lr:g} | {row} | {mean:+.4f} ({mean / (sd / math.sqrt(len(cos))):+.1f}) |", flush=True)


if __name__ == "__main__":
    main()
