"""Diagnostic: does the preconditioned GNS depend on the batch Adam's second moment was built at?

Trains the config's model in one process at `--gbs` (warmup, then the config's lr), and at `--fork-at`
continues two arms from the same state at one LR: one at `--gbs`, one at `--other`. Every `--every`
steps of each arm it reads the two-batch estimate B = tr(P Σ P) / |P G|² (P = 1/(√v̂ + ε), the family's
vocab_params left out, as the workers measure it) and the raw B = tr Σ / |G|², both from `--batches`
independent batches of `--gbs` samples that training never sees. Only v̂ differs between the arms'
preconditioners, so a gap in the P readings that the raw ones do not show is the preconditioner's. Each
read also gives B_P with v̂ carried over to the other arm's batch (its noise part v̂ − m̂² scaled by the
ratio of the batches): if that matches what the other arm reads, a rung's noise scale can be predicted
from the running one's optimizer state.

    python scripts/gns_precond_batch.py [--config configs/wikitext2-gpt-tiny.yaml] [--data PATH]
        [--gbs 8] [--other 32] [--fork-at 700] [--arm-steps 60] [--every 20] [--batches 16]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HELD_OUT = 50_000_000  # sample index where the measuring batches start (the run never trains there)


def main() -> None:
    ap = argparse.ArgumentParser(prog="gns_precond_batch.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "wikitext2-gpt-tiny.yaml"))
    ap.add_argument("--data", help="data.path (default: the config's)")
    ap.add_argument("--gbs", type=int, default=8, help="batch before the fork, of the first arm and of the reads")
    ap.add_argument("--other", type=int, default=32, help="the second arm's batch")
    ap.add_argument("--fork-at", type=int, default=700, help="steps at --gbs before the arms")
    ap.add_argument("--arm-steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--batches", type=int, default=16, help="independent batches per read (>= 2)")
    args = ap.parse_args()
    if args.batches < 2 or min(args.gbs, args.other, args.every, args.arm_steps) < 1 or args.fork_at < 1:
        ap.error("--batches must be >= 2; --gbs, --other, --every, --arm-steps and --fork-at >= 1")

    from gns_vocab_share import one_process_run, preconditioned_estimate

    torch, model, opt, stream, spec, cfg = one_process_run(args.config, args.data)
    m, t = cfg.model, cfg.train
    names = [k for k, _ in model.named_parameters() if k not in spec.vocab_params]
    b, n = args.gbs, args.batches

    def backward(start: int, size: int) -> float:
        model.zero_grad(set_to_none=True)
        x, y = stream.samples(start, size)
        loss = spec.loss(model(x), y)
        loss.backward()
        return loss.item()

    def step(start: int, size: int, lr: float) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        loss = backward(start, size)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        return loss

    def read(k: int, built_at: int) -> tuple[float, float, float]:
        """B_P, raw B, and B_P with v̂ carried over to the other arm's batch (`built_at` the batch v̂ is from)."""
        grads = []
        for i in range(n):
            backward(HELD_OUT + (k * n + i) * b, b)
            grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if name in names})
        target = args.other if built_at == b else b
        pre, raw = (preconditioned_estimate(model, opt, grads, b, power, names) for power in (2, 0))
        return pre, raw, preconditioned_estimate(model, opt, grads, b, 2, names, rescale=built_at / target)

    consumed = 0
    for i in range(args.fork_at):
        step(consumed, b, t.lr * min(1.0, (i + 1) * b * m.seq_len / max(t.warmup_tokens, 1)))
        consumed += b
    pre, raw, carried = read(0, b)
    print(
        f"{args.config}: {m.family}; fork after {args.fork_at} steps at gbs {b}: B_P {pre:.1f}, raw {raw:.1f}, "
        f"B_P with v̂ carried to gbs {args.other} {carried:.1f}",
        flush=True,
    )
    state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for arm in (b, args.other):
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
        at = consumed
        for k in range(1, args.arm_steps // args.every + 1):
            for _ in range(args.every):
                loss = step(at, arm, t.lr)
                at += arm
            pre, raw, carried = read(k, arm)
            other = args.other if arm == b else b
            print(
                f"arm gbs {arm:>3}, +{k * args.every} steps: loss {loss:.3f}  B_P {pre:.1f}  raw {raw:.1f}  "
                f"B_P with v̂ carried to gbs {other} {carried:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
