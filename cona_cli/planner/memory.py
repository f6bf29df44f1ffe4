"""Peak memory per device of a strategy, as the planner estimates it (feasibility), counting what the
engine keeps: fp32 master weights, gradients and AdamW moments, the activations autograd saves (checked
against `saved_tensors_hooks` counts in tests/test_activation_memory.py), logits gathered whole."""

from __future__ import annotations

from typing import Any

import numpy as np

from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.workload import Workload
from cona_core.buckets import BUCKET_BYTES, IN_FLIGHT
from cona_core.shape import ModelShape

STATE_BYTES = 16  # per parameter: fp32 weight, fp32 gradient, fp32 AdamW moments m and v
GRAD_BYTES = 4  # gradients are fp32 under every precision (master weights)
ADAM_TEMP_BYTES = 4  # foreach AdamW's sqrt(v) temporary, one fp32 tensor per parameter during the step


def compute_precision(precision: str, hw: HardwareProfile) -> str:
    """`search.precision` as the planner models it: `auto` is bf16 on a GPU profile (one without
    `cores_per_node`) that lists a bf16 peak, fp32 on a CPU profile (launch.precision.resolve_precision
    gives the same from the rank's device)."""
    if precision == "auto":
        return "bf16" if not hw.cores_per_node and "bf16" in hw.peak_tflops else "fp32"
    return precision


def layer_activation_bytes(shape: ModelShape, mbs: Any, tp: Any, act_bytes: int) -> Any:
    """Bytes one layer saves for backward per micro-batch: per token the two norms' inputs and outputs
    (4h, replicated under TP), q, k, v, the attention output and its reshaped copy ((3 + 2 kv/n) h / tp;
    SDPA keeps no score matrix), and the MLP's hidden tensors (2 ffn / tp for GELU: its input and output;
    4 ffn / tp gated: gate, up, activation and product). Without dropout masks (dropout 0)."""
    h = shape.d_model
    attention = (3 + 2 * shape.kv_heads / shape.n_heads) * h
    mlp = (2 if shape.mlp_matrices == 2 else 4) * shape.ffn
    return mbs * shape.seq_len * act_bytes * (4 * h + (attention + mlp) / tp)


def memory_bytes(
    x: np.ndarray, w: Workload, hw: HardwareProfile | None = None, budget: float | None = None
) -> np.ndarray:
    """Peak bytes per device (without the runtime reservation) for rows x = (dp, tp, pp, mbs, gbs)
    (`hw`: resolves `search.precision: auto`; `budget`: the bytes a device has, see below).

    Model states: 16 bytes per parameter (fp32 weights, gradients and moments under fp32 and bf16 alike),
    sharded over dp under FSDP, plus two gathered layers in the compute precision with pp = 1. FSDP under
    PP keeps the whole stage gathered (reshard_after_forward off, and `PipelineStage` turns
    reshard-after-backward and gradient sync off until the last micro-batch): its compute-precision
    parameters and their unsharded fp32 accumulated gradients, not divided by dp. FSDP with pp = 1 and
    three or more micro-batches keeps the middle ones' gradients unsharded in fp32 instead of
    reduce-scattering each (`ParallelModel.accumulate_unsharded`) where they fit: counted where the peak
    with them is within `budget` (the worker measures its own peak before it turns this on), everywhere
    without a budget. Under bf16 without FSDP, autocast's compute-precision copies of the weights. DDP's
    gradients are views into its buckets (gradient_as_bucket_view), no second copy. When dp > 1 and the
    gradients are averaged in buckets (DDP does not wrap TP or PP), the copies of the buckets in flight
    (`cona_core.buckets`). The optimizer step (activations freed by then) adds foreach AdamW's full fp32
    temporary over the local parameters.
    Activations: what each layer saves (`layer_activation_bytes`); with recomputation only each layer's
    input plus one layer's working set.
    1F1B keeps up to pp micro-batches in flight on stage 0, GPipe all m. The last stage holds the logits
    gathered whole on every TP rank, their fp32 copy and gradient, for one micro-batch.
    """
    dp, tp, pp, mbs, gbs = (x[:, i].astype(np.float64) for i in range(5))
    precision = compute_precision(w.precision, hw) if hw is not None else w.precision
    if precision == "auto":
        raise ValueError("search.precision auto: memory_bytes needs the hardware profile to resolve it")
    shape, e = w.shape, 4 if precision == "fp32" else 2
    m = gbs / (dp * mbs)
    params = w.stage_params(tp, pp)
    states = params * STATE_BYTES
    if w.dp_impl == "fsdp":
        gathered = np.where(pp == 1, 2 * shape.layer_params / tp * e, params * (e + GRAD_BYTES))
        states = states / dp + gathered
        optimizer_params = params / dp
    else:
        optimizer_params = params
        if e != 4:
            states = states + params * e  # autocast's casts of the weights
        bucketed = (dp > 1) & ((tp > 1) | (pp > 1))  # averaged in buckets, not by DDP (cona_core.buckets)
        states = states + np.where(bucketed, np.minimum(params * GRAD_BYTES, IN_FLIGHT * BUCKET_BYTES), 0.0)
    full_layer = layer_activation_bytes(shape, mbs, tp, e)
    layers = shape.n_layers / pp
    layer_input = mbs * shape.seq_len * shape.d_model * e
    per_microbatch = layers * layer_input + full_layer if w.recompute else layers * full_layer
    first_in_flight = np.where(pp == 1, 1, np.minimum(pp, m) if w.pp_schedule == "1f1b" else m)
    last_in_flight = np.where(pp == 1, 1, 1 if w.pp_schedule == "1f1b" else m)
    logits = mbs * shape.seq_len * shape.vocab * (e + 2 * 4 if e != 4 else 2 * 4)
    first = first_in_flight * per_microbatch + np.where(pp == 1, logits, 0.0)
    last = last_in_flight * per_microbatch + logits
    step_temporary = optimizer_params * ADAM_TEMP_BYTES
    peak = states + np.maximum(np.maximum(first, last), step_temporary)
    if w.dp_impl != "fsdp":
        return peak
    unsharded = np.where((pp == 1) & (m > 2), params * GRAD_BYTES, 0.0)  # beside the activations at their peak
    with_unsharded = states + np.maximum(np.maximum(first, last) + unsharded, step_temporary)
    return with_unsharded if budget is None else np.where(with_unsharded <= budget, with_unsharded, peak)


def training_budget(hw: HardwareProfile, procs_per_node: int, margin: float) -> float:
    """Bytes a rank's device has for what `memory_bytes` counts: its memory less `margin` of it and the
    runtime's reservation."""
    return (1 - margin) * hw.device_memory_bytes(procs_per_node) - hw.reserved_gib * 2**30


def startup_bytes(x: np.ndarray, w: Workload) -> np.ndarray:
    """Peak bytes per device while a launch builds its model, for rows x = (dp, tp, pp, mbs, gbs):
    `launch.materialise` allocates the rank's pieces as they will train (fp32, sharded by TP and FSDP)
    and draws the parameters whole, one at a time, each moved to the device to be sliced there."""
    dp, tp, pp = (x[:, i].astype(np.float64) for i in range(3))
    pieces = w.stage_params(tp, pp) * GRAD_BYTES
    return (pieces / dp if w.dp_impl == "fsdp" else pieces) + w.shape.largest_param * GRAD_BYTES
