"""Diagnostic: does a short trial after warmup find the base LR that long trials (`cona tune-lr`) find?

Trains the config's model in one process at `--gbs` through the config's warmup at `train.lr`, then,
from that state (an in-memory copy, restored before each branch), runs one branch per LR in `--lrs`
(constant, every branch on the same batches) up to the last of `--checks` steps, and prints each
branch's validation loss after each of them (the same held-out batches for all) beside the one-step
signal the workers read, which costs nothing in a run: the hypergradient's cosine g_t·u / (|g_t| |u|), u
the last AdamW update (`launch.lr_calibration`; Baydin et al. 2018), positive where a longer step would
have lowered the loss, its mean and t-statistic over the branch's first 50 steps (it drifts negative as
training goes on). `--online Z` runs the shipped rule instead, against fixed LRs.
A trial of M steps per LR picks the LR of the lowest loss at M; where that agrees with the long trials'
best at a small M, a run could set its own base LR for the cost of the losing branches.

    python scripts/lr_race.py [--config configs/tiny.yaml] [--data DIR] [--gbs 8]
        [--lrs 0.5,1,2,4 (× train.lr)] [--checks 25,50,100,200] [--eval-batches 16] [--online Z [--tokens N]]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


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
        help="instead: train a cosine schedule over --tokens at train.lr, at 2× it, and under the workers' rule "
        "(launch.lr_calibration, at z = Z), and print each one's LR and validation loss",
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
    from launch.lr import schedule_factor
    from launch.lr_calibration import WINDOW, LrCalibration, hypergradient_terms
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

    def hypergradient() -> tuple[float, float, float]:
        """g·u, |g|² and |u|² of the gradient now against the last update, as the workers read them."""
        gu, uu = hypergradient_terms([(p, p.grad) for p in params], opt)
        return float(gu), sum(float(p.grad.double().pow(2).sum()) for p in params), float(uu)

    warmup = max(1, math.ceil(t.warmup_tokens / (b * seq)))
    if args.online is not None:
        # The shipped rule (`LrCalibration`) from where the workers start reading: warmup over and Adam's
        # second moment settled; the fixed LRs are the same schedule with a settled gain.
        start = Snapshot.take(model, opt)  # the model as built: each schedule starts from it
        schedule = dataclasses.replace(t, schedule="cosine", decay_tokens=max(1, args.tokens - t.warmup_tokens))
        total, first = max(warmup + 1, args.tokens // (b * seq)), max(warmup, math.ceil(1 / (1 - t.beta2)))
        print(f"{args.config}: gbs {b}, {total} steps (warmup {warmup}, cosine to {t.min_lr_ratio} after)")
        for name, cal in (
            ("train.lr", LrCalibration(settled=True)),
            ("2 × train.lr", LrCalibration(gain=2.0, settled=True)),
            (f"online, z {args.online:g}", LrCalibration()),
        ):
            start.restore(model, opt)
            for i in range(total):
                step(i, t.lr * cal.gain * schedule_factor(schedule, i * b * seq, i * b * seq))
                if i >= first and not cal.settled:
                    cal.add(*hypergradient(), z=args.online)
                update()
            reads = ", ".join(f"{r:+.1f}" for r in cal.reads) or "-"
            print(f"  {name}: LR {t.lr * cal.gain:.3g} (t per window: {reads}), validation loss {val_loss():.4f}")
        return
    for i in range(warmup):
        step(i, t.lr * (i + 1) / warmup)
        update()
    start = Snapshot.take(model, opt)
    print(f"{args.config}: gbs {b}, warmup {warmup} steps at train.lr {t.lr:g}, validation loss {val_loss():.4f}")
    head = " | ".join(f"loss at {c}" for c in checks)
    print(f"| LR | {head} | hypergradient cos (t), first {WINDOW} steps |")
    print("|---|" + "---|" * (len(checks) + 1))
    for mult in args.lrs:
        lr = t.lr * mult
        start.restore(model, opt)
        cos, losses = [], []
        for k in range(1, checks[-1] + 1):
            step(warmup + k - 1, lr)
            if k <= WINDOW:
                gu, gg, uu = hypergradient()
                cos.append(gu / math.sqrt(gg * uu))
            update()
            if k in checks:
                losses.append(val_loss())
        mean, sd = statistics.fmean(cos), statistics.stdev(cos)
        row = " | ".join(f"{v:.4f}" for v in losses)
        print(f"| {lr:g} | {row} | {mean:+.4f} ({mean / (sd / math.sqrt(len(cos))):+.1f}) |", flush=True)


if __name__ == "__main__":
    main()
