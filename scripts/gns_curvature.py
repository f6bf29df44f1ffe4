"""Diagnostic: the noise scale weighted by the Hessian, against the two-batch estimate the workers read.

The efficiency 1/(1 + B/b) that Φ uses comes from the loss drop of one step at its best LR (McCandlish et
al. 2018). For Adam's update P g (P = 1/(√v̂ + ε)) that derivation gives B_H = tr(P H P Σ) / Gᵀ P H P G,
H the Hessian, Σ the per-sample gradient covariance, G the mean gradient. The workers read
B_P² = tr(P Σ P) / |P G|², which equals B_H only where P H P is a multiple of P² (H a multiple of the
identity); B_P (tr(P Σ) / Gᵀ P G) is the case H ∝ 1/P, and B_1 = tr Σ / |G|² plain SGD's B_simple.
This script measures B_H itself, and B_H(SGD) = tr(H Σ) / Gᵀ H G (McCandlish's B_noise).

It trains the config's model in one process at `--gbs` (linear warmup, then the config's lr: no schedule),
and every `--every` steps draws `--batches` independent batches of `--gbs` samples the run never trains
on. From their gradients g_k (mean ḡ, deviations d_k = g_k − ḡ) and Hessian-vector products on
`--hessian-samples` further held-out samples: tr(A Σ) = b/(n − 1) Σ_k d_kᵀ A d_k and
Gᵀ A G = ḡᵀ A ḡ − tr(A Σ)/(n b), for A = P H P (B_H) and A = H (the same for plain SGD). All over the
parameters the workers count (the family's `vocab_params` left out). Each row also gives the training
steps' median gradient norm since the last read and the share clipped at `train.grad_clip`. One process,
fixed sample indices.

    python scripts/gns_curvature.py [--config configs/wikitext2-gpt-tiny.yaml] [--gbs 8] [--steps 1200]
        [--every 300] [--batches 16] [--hessian-samples 32] [--data PATH]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HELD_OUT = 50_000_000  # sample index where the measuring batches start (the run never trains there)
HESSIAN_AT = 60_000_000  # and where the Hessian's samples start


def curvature_noise_scale(quadratic, mean: dict, deviations: list[dict], b: int) -> tuple[float, float]:
    """(tr(A Σ), Gᵀ A G) from the mean of n independent batches of b samples' gradients and their
    deviations from it; `quadratic(v)` is vᵀ A v."""
    n = len(deviations)
    trace = b / (n - 1) * sum(quadratic(d) for d in deviations)
    return trace, quadratic(mean) - trace / (n * b)


def hessian_form(loss, params: list) -> Callable[[list], float]:
    """v ↦ vᵀ H v, H the Hessian of `loss` in `params` and v a list of tensors shaped like them (double
    backward: one Hessian-vector product per call)."""
    import torch

    grads = torch.autograd.grad(loss, params, create_graph=True)

    def form(v: list) -> float:
        hv = torch.autograd.grad(grads, params, [x.to(p.dtype) for x, p in zip(v, params)], retain_graph=True)
        return sum(float((h.double() * x.double()).sum()) for h, x in zip(hv, v))

    return form


def main() -> None:
    ap = argparse.ArgumentParser(prog="gns_curvature.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "wikitext2-gpt-tiny.yaml"))
    ap.add_argument("--data", help="data.path (default: the config's)")
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--every", type=int, default=300)
    ap.add_argument("--batches", type=int, default=16, help="independent batches per read (>= 2)")
    ap.add_argument("--hessian-samples", type=int, default=32, help="samples of the Hessian's batch")
    args = ap.parse_args()
    if args.batches < 2 or min(args.gbs, args.every, args.steps, args.hessian_samples) < 1:
        ap.error("--batches must be >= 2; --gbs, --every, --steps and --hessian-samples >= 1")

    from gns_vocab_share import adam_preconditioner, one_process_run, preconditioned_estimate
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch, model, opt, stream, spec, cfg = one_process_run(args.config, args.data)
    m, t = cfg.model, cfg.train
    names = [k for k, _ in model.named_parameters() if k not in spec.vocab_params]
    params = dict(model.named_parameters())
    b, n = args.gbs, args.batches
    print(f"{args.config}: {m.family}, {b} per batch, {n} batches and {args.hessian_samples} Hessian samples per read")

    def gradient(start: int) -> dict:
        model.zero_grad(set_to_none=True)
        x, y = stream.samples(start, b)
        spec.loss(model(x), y).backward()
        return {k: params[k].grad.detach().double().clone() for k in names}

    def held_out_hessian(start: int) -> Callable[[dict], float]:
        """v ↦ vᵀ H v over `names` on the held-out samples at `start` (attention's math kernel has a double
        backward)."""
        x, y = stream.samples(start, args.hessian_samples)
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(SDPBackend.MATH):
            form = hessian_form(spec.loss(model(x), y), [params[k] for k in names])
        return lambda v: form([v[k] for k in names])

    def read(k: int) -> str:
        grads = [gradient(HELD_OUT + (k * n + i) * b) for i in range(n)]
        weights = (("P2", 2), ("P", 1), ("1", 0))
        simple = {w: preconditioned_estimate(model, opt, grads, b, power, names) for w, power in weights}
        mean = {name: sum(g[name] for g in grads) / n for name in names}
        deviations = [{name: g[name] - mean[name] for name in names} for g in grads]
        p = {name: w.double() for name, w in adam_preconditioner(model, opt, names).items()}
        form = held_out_hessian(HESSIAN_AT + k * args.hessian_samples)
        cells = []
        for label, quadratic in (("B_H", lambda v: form({x: v[x] * p[x] for x in names})), ("B_H(SGD)", form)):
            trace, signal = curvature_noise_scale(quadratic, mean, deviations, b)
            cells.append(f"{label} {trace / signal:,.1f}" if signal > 0 else f"{label} inf (GᵀAG {signal:.3g})")
        return f"B_P² {simple['P2']:,.1f}  B_P {simple['P']:,.1f}  B_1 {simple['1']:,.1f}  " + "  ".join(cells)

    norms: list[float] = []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = t.lr * min(1.0, step * b * m.seq_len / max(t.warmup_tokens, 1))
        model.zero_grad(set_to_none=True)
        x, y = stream.samples((step - 1) * b, b)
        loss = spec.loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        opt.step()
        if step % args.every == 0:
            clipped = sum(g > t.grad_clip for g in norms) / len(norms)
            head = f"step {step} loss {loss.item():.3f} (ppl {math.exp(loss.item()):,.0f})"
            norm = f"|g| {statistics.median(norms):.2f} ({clipped:.0%} clipped)"
            print(f"{head} {norm} | {read(step // args.every)}", flush=True)
            norms.clear()


if __name__ == "__main__":
    main()
