"""Diagnostic: how much of the mean gradient persists from step to step, against the two-batch GNS.

The two-batch estimate B = tr(P Σ P) / |P G|² (P = 1/(√v̂ + ε), what the workers read) takes |G|² at the
iterate. Near a minimum part of that gradient is the iterate's own fluctuation about its path, which
reverses within a few steps and which no batch size turns into progress. The product of two training
batches' gradients k steps apart, gₜ·gₜ₋ₖ, has the mean E[Gₜ·gₜ₋ₖ]: the mean gradient now along the
gradient step t − k took, its sampling noise included, so it also counts how the iterate has since
answered that noise (a reversal counts against it). This script prints, over each window of `--every`
steps of a one-process AdamW run at `--gbs` (linear warmup, then the config's lr: no schedule):

- B_P² = mean tr(PΣP) / mean |PG|², the two-batch estimate of each step's two half-batches and whole;
- B_lag(k) = mean tr(PΣP) / mean (P g)ₜ·(P g)ₜ₋ₖ for each k of `--lags`: the noise scale of the
  gradient that persists k steps;

with the vocabulary's parameters left out, as the workers do. One process, fixed sample indices.

    python scripts/gns_lag.py [--config configs/wikitext2-gpt-tiny.yaml] [--gbs 8] [--steps 1200]
        [--every 200] [--lags 1,4,16] [--data PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class LagWindow:
    """Window means of a run's two-batch estimates and of the products of its whole-batch gradients k steps
    apart (gradients as dicts of tensors; only the last max(lags) are kept)."""

    def __init__(self, lags: list[int]) -> None:
        self.lags = lags
        self.history: deque[dict] = deque(maxlen=max(lags))
        self.clear()

    def clear(self) -> None:
        self.trace = self.grad_sq = 0.0
        self.steps = 0
        self.products = {k: [0.0, 0] for k in self.lags}

    def add(self, trace: float, grad_sq: float, whole: dict) -> None:
        self.trace += trace
        self.grad_sq += grad_sq
        self.steps += 1
        for k in self.lags:
            if len(self.history) >= k:
                self.products[k][0] += _dot(whole, self.history[-k])
                self.products[k][1] += 1
        self.history.append(whole)

    def scales(self) -> dict[str, float]:
        """{"B_P²": mean tr / mean |G|², "B_lag(k)": mean tr / mean product at lag k}; ∞ where a denominator
        is ≤ 0 (a lag with no product yet is left out)."""

        def ratio(d: float) -> float:
            return self.trace / d if d > 0 else math.inf

        lagged = {k: s * self.steps / n for k, (s, n) in self.products.items() if n}  # on the traces' scale
        return {"B_P²": ratio(self.grad_sq), **{f"B_lag({k})": ratio(v) for k, v in sorted(lagged.items())}}


def _dot(u: dict, v: dict) -> float:
    return sum(float((u[k].double() * v[k].double()).sum()) for k in u)


def main() -> None:
    ap = argparse.ArgumentParser(prog="gns_lag.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "wikitext2-gpt-tiny.yaml"))
    ap.add_argument("--data", help="data.path (default: the config's)")
    ap.add_argument("--gbs", type=int, default=8, help="batch per step (even: two halves give the estimate)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--every", type=int, default=200, help="steps per window")
    ap.add_argument("--lags", default="1,4,16", help="comma-separated lags in steps")
    args = ap.parse_args()
    try:
        lags = sorted({int(k) for k in args.lags.split(",")})
    except ValueError:
        ap.error(f"--lags: not a list of integers: {args.lags!r}")
    if args.gbs < 2 or args.gbs % 2 or min(args.steps, args.every, *lags) < 1:
        ap.error("--gbs must be even and >= 2; --steps, --every and every lag >= 1")

    from gns_vocab_share import adam_preconditioner, one_process_run

    from cona_core.gns import two_batch_estimate

    torch, model, opt, stream, spec, cfg = one_process_run(args.config, args.data)
    m, t = cfg.model, cfg.train
    names = [k for k, _ in model.named_parameters() if k not in spec.vocab_params]
    params = dict(model.named_parameters())
    b, half = args.gbs, args.gbs // 2
    print(f"{args.config}: {m.family}, {b} per step, windows of {args.every} steps, lags {lags}")

    def half_gradient(start: int) -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        x, y = stream.samples(start, half)
        loss = spec.loss(model(x), y)
        loss.backward()
        return loss.item(), {k: q.grad.detach().clone() for k, q in params.items() if q.grad is not None}

    window = LagWindow(lags)
    loss_sum = 0.0
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = t.lr * min(1.0, step * b * m.seq_len / max(t.warmup_tokens, 1))
        loss_a, ga = half_gradient((step - 1) * b)
        loss_b, gb = half_gradient((step - 1) * b + half)
        whole = {k: (ga[k] + gb[k]) / 2 for k in ga}
        if step > 1:  # v̂ exists: precondition as the step that follows will
            p = adam_preconditioner(model, opt, names)
            pa, pb, pw = ({k: g[k] * p[k] for k in names} for g in (ga, gb, whole))
            grad_sq, trace = two_batch_estimate(half, (_dot(pa, pa) + _dot(pb, pb)) / 2, b, _dot(pw, pw))
            window.add(trace, grad_sq, pw)
            loss_sum += (loss_a + loss_b) / 2
        for k, g in whole.items():
            params[k].grad = g
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        if step % args.every == 0 and window.steps:
            loss = loss_sum / window.steps
            cells = "  ".join(f"{name} {v:,.1f}" for name, v in window.scales().items())
            print(
                f"steps {step - args.every + 1}-{step} loss {loss:.3f} (ppl {math.exp(loss):,.0f}) | {cells}",
                flush=True,
            )
            window.clear()
            loss_sum = 0.0


if __name__ == "__main__":
    main()
