"""Diagnostic: the two-batch GNS along a one-process AdamW run, with and without the vocab parameters.

Trains the config's model at one global batch (linear warmup, then the config's lr: no schedule, so the
estimate is read at a fixed LR), and every `--every` steps draws `--batches` independent batches of the
same size from samples the run never trains on. From their gradients it prints the two-batch estimate
B = tr(W Σ) / Gᵀ W G with the squared gradient weighted by W = P² (what Adam's update sees, P = 1/(√v̂+ε)),
W = P and W = 1, over the whole model and over all but the family's `vocab_params` (embeddings, output
heads). One process, fixed sample indices: the figures do not depend on the host's speed.

    python scripts/gns_vocab_share.py [--config configs/wikitext2-commheavy.yaml] [--gbs 8] [--steps 1200]
        [--every 100] [--batches 16] [--data PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HELD_OUT = 50_000_000  # sample index where the measuring batches start (epochs wrap; the run never gets there)
WEIGHTS = (("P2", 2), ("P", 1), ("1", 0))


def one_process_run(config: str, data: str | None) -> tuple:
    """(torch, model, AdamW, train stream, family spec, config): the config's seeded model in one process."""
    import torch

    from cona_cli.run_config import load_config
    from cona_core.shape import SPECIAL_TOKENS
    from launch.data.corpus import prepare_corpus
    from launch.data.sampling import TokenStream
    from launch.materialise import build_model
    from launch.models import get_spec
    from launch.optimizer import adamw

    cfg = load_config(config, {"data.path": data} if data else None)
    m, t = cfg.model, cfg.train
    torch.manual_seed(t.seed)
    spec = get_spec(m.family)
    corpus = prepare_corpus(cfg.data, t.seed, SPECIAL_TOKENS[m.family])
    model = build_model(spec, m, corpus.vocab_size, t.seed, torch.device("cpu"))
    stream = TokenStream(corpus.train_path, m.seq_len, t.seed, spec.batch(corpus.vocab_size))
    return torch, model, adamw(model, t.lr, (t.beta1, t.beta2), t.weight_decay), stream, spec, cfg


def adam_preconditioner(model, opt, names: list[str], rescale: float = 1.0) -> dict:
    """P = 1/(√v̂ + ε) per parameter in `names`, from AdamW `opt`'s bias-corrected second moment. `rescale` ≠ 1:
    v̂ as it would be at a batch 1/rescale times the one it was built at, its noise part v̂ − m̂² scaled by
    `rescale` (m̂ the bias-corrected first moment, whose square is mostly the mean gradient's)."""
    (beta1, beta2), eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    out = {}
    for k, p in model.named_parameters():
        if k in names:
            state = opt.state[p]
            v = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            if rescale != 1.0:
                m2 = (state["exp_avg"] / (1 - beta1 ** float(state["step"]))) ** 2
                v = m2 + (v - m2).clamp_(min=0) * rescale
            out[k] = 1 / (v.sqrt() + eps)
    return out


def preconditioned_estimate(
    model, opt, grads: list[dict], b: int, power: int, names: list[str], rescale: float = 1.0
) -> float:
    """B = tr(W Σ) / Gᵀ W G over `names` from independent batches of `b` samples' gradients, W = P^power
    (P from `adam_preconditioner`, with its `rescale`; power 0: the raw estimate)."""
    from cona_core.gns import two_batch_estimate

    weight = {k: p**power for k, p in adam_preconditioner(model, opt, names, rescale).items()}

    def sq(g: dict) -> float:
        return sum(float((g[k].double() ** 2 * weight[k]).sum()) for k in names)

    n = len(grads)
    mean = {k: sum(g[k] for g in grads) / n for k in names}
    grad_sq, trace = two_batch_estimate(b, sum(sq(g) for g in grads) / n, b * n, sq(mean))
    return trace / grad_sq if grad_sq > 0 else math.inf


def main() -> None:
    ap = argparse.ArgumentParser(prog="gns_vocab_share.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "wikitext2-commheavy.yaml"))
    ap.add_argument("--data", help="data.path (default: the config's)")
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--batches", type=int, default=16, help="independent batches per measurement (>= 2)")
    args = ap.parse_args()
    if args.batches < 2 or args.gbs < 1 or args.every < 1:
        ap.error("--batches must be >= 2, --gbs and --every >= 1")

    torch, model, opt, stream, spec, cfg = one_process_run(args.config, args.data)
    m, t = cfg.model, cfg.train
    b, n = args.gbs, args.batches
    print(f"{args.config}: {m.family}, vocab_params {', '.join(spec.vocab_params)}; gbs {b}, {n} batches per read")

    def backward(start: int) -> float:
        model.zero_grad(set_to_none=True)
        x, y = stream.samples(start, b)
        loss = spec.loss(model(x), y)
        loss.backward()
        return loss.item()

    def gradient(start: int) -> dict[str, torch.Tensor]:
        backward(start)
        return {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    def estimate(grads: list[dict[str, torch.Tensor]], power: int, names: list[str]) -> float:
        return preconditioned_estimate(model, opt, grads, b, power, names)

    every_name = [k for k, _ in model.named_parameters()]
    counted = [k for k in every_name if k not in spec.vocab_params]
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = t.lr * min(1.0, step * b * m.seq_len / max(t.warmup_tokens, 1))
        loss = backward((step - 1) * b)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        if step % args.every:
            continue
        grads = [gradient(HELD_OUT + (step * n + i) * b) for i in range(n)]
        cells = [f"{name} {estimate(grads, power, every_name):,.0f}" for name, power in WEIGHTS]
        cells += [f"{name} {estimate(grads, power, counted):,.0f}" for name, power in WEIGHTS]
        print(
            f"step {step} loss {loss:.3f} (ppl {math.exp(loss):,.0f}) | whole model: {' '.join(cells[:3])}"
            f" | without vocab params: {' '.join(cells[3:])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
