"""Peak memory per device of a strategy, as the planner estimates it (feasibility)."""

from __future__ import annotations

import numpy as np

from cona_cli.planner.workload import Workload


def memory_bytes(x: np.ndarray, w: Workload) -> np.ndarray:
    """Peak bytes per device (without the runtime reservation) for rows x = (dp, tp, pp, mbs, gbs).

    Model states: 16 bytes per parameter for AdamW in fp32 or mixed precision (weights + grads +
    fp32 master/moments), sharded over dp under FSDP. Activations per layer and micro-batch after
    Korthikanti et al. 2022 without the s^2 score term (SDPA / flash attention keeps no scores):
    s*b*h*(10 + 24/tp) bytes at 2-byte precision; with recomputation only each layer's input plus
    one layer's working set. 1F1B keeps up to pp micro-batches in flight on stage 0, GPipe all m;
    the last stage also holds fp32 logits and their gradient for one micro-batch.
    """
    dp, tp, pp, mbs, gbs = (x[:, i].astype(np.float64) for i in range(5))
    shape = w.shape
    m = gbs / (dp * mbs)
    states = w.stage_params(tp, pp) * 16
    if w.dp_impl == "fsdp":
        states = states / dp + 2 * shape.layer_params / tp * 2 * w.act_bytes  # plus two gathered layers
    sbh = shape.seq_len * mbs * shape.d_model * w.act_bytes / 2
    full_layer = sbh * (10 + 24 / tp)
    layers = shape.n_layers / pp
    per_microbatch = layers * 2 * sbh + full_layer if w.recompute else layers * full_layer
    first_in_flight = np.where(pp == 1, 1, np.minimum(pp, m) if w.pp_schedule == "1f1b" else m)
    last_in_flight = np.where(pp == 1, 1, 1 if w.pp_schedule == "1f1b" else m)
    logits = 2 * mbs * shape.seq_len * shape.vocab / tp * 4
    first = first_in_flight * per_microbatch + np.where(pp == 1, logits, 0.0)
    last = last_in_flight * per_microbatch + logits
    return states + np.maximum(first, last)
