"""Iteration-time model T(s) without profiling, in the style of Megatron / AMP / Calculon.

One step of strategy s = (dp, tp, pp, mbs, gbs) with m = gbs / (dp * mbs) micro-batches:

    T = pipeline                          m micro-batches through pp stages, incl. the bubble
      + exposed DP gradient sync          ring all-reduce, partly hidden behind backward
      + optimizer step                    memory-bound AdamW over the local parameters
      + step overhead                     fixed per step (data, loss, grad norm, logging, launch gaps)

Each stage's time per micro-batch is split into host work and waiting (AdaptDL-style named terms):

    work  = layers/pp * (compute + layer overhead + TP dispatch [+ TP data movement on CPUs])
            + output head + micro-batch overhead
    wait  = layers/pp * TP all-reduces [latency only on CPUs] + head TP collectives + PP send/recv

Compute is FLOPs / (peak * efficiency), efficiency = mfu_max * f / (f + f_half) growing with the work f
per layer and micro-batch on one device (so with mbs, and shrinking with tp). On GPUs the pipeline
takes (m + pp - 1) * (work + wait). On CPUs whose processes outnumber the cores (contention
c = procs / cores > 1) a rank's work runs c times slower while all ranks are busy, but the pipeline
bubble frees cores: work is bounded below by the critical path (m + pp - 1) * work at one core per
process and by the node's throughput m * c * work, whichever is larger; waiting uses no core.
Every function takes strategies as an (n, 5) integer array of (dp, tp, pp, mbs, gbs) rows and is
vectorised over n.
"""

from __future__ import annotations

import numpy as np

from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.memory import compute_precision
from cona_cli.planner.workload import Workload
from cona_core.strategy import Strategy

ADAM_BYTES_PER_PARAM = 28  # AdamW touches master weight, grad, m, v: 4 reads + 3 writes of 4 bytes
GRAD_BYTES = 4  # fp32 gradients (fp32 master weights under bf16 too)


def as_array(strategies: list[Strategy]) -> np.ndarray:
    """Strategies as an (n, 5) int array of (dp, tp, pp, mbs, gbs)."""
    return np.array([[s.dp, s.tp, s.pp, s.mbs, s.gbs] for s in strategies], dtype=np.int64).reshape(-1, 5)


def ring_allreduce_s(n: np.ndarray, nbytes: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> np.ndarray:
    """Ring all-reduce over n ranks: 2(n-1)/n * bytes / bandwidth + 2(n-1) latencies; 0 when n = 1."""
    return np.where(n > 1, 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat, 0.0)


def tp_collectives_per_layer(recompute: bool) -> float:
    """Megatron TP all-reduces per layer and micro-batch: 2 forward (attention and MLP outputs),
    2 backward (their inputs' gradients), and the 2 forward ones again when the layer is recomputed."""
    return 6.0 if recompute else 4.0


def iteration_time(x: np.ndarray, w: Workload, hw: HardwareProfile) -> np.ndarray:
    """Predicted seconds per training step for each row of x = (dp, tp, pp, mbs, gbs)."""
    dp, tp, pp, mbs, gbs = (x[:, i].astype(np.float64) for i in range(5))
    m = gbs / (dp * mbs)
    ppn = w.procs_per_node
    precision = compute_precision(w.precision, hw)
    e = 4 if precision == "fp32" else 2  # bytes per activation / gathered weight in the compute precision
    flops = hw.device_flops(precision, ppn)  # already the per-process share of the node's cores
    contention = hw.cpu_contention(ppn)
    intra_bw, inter_bw = hw.intra_bw_gbs * 1e9, hw.inter_bw_gbs * 1e9
    intra_lat, inter_lat = hw.intra_latency_us * 1e-6, hw.inter_latency_us * 1e-6
    half = hw.eff_half_gflop * 1e9

    def compute_s(work: np.ndarray) -> np.ndarray:
        return work / (flops * hw.mfu_max * work / (work + half))

    passes = 4.0 if w.recompute else 3.0  # forward + backward (2x forward) [+ recomputed forward]
    shape = w.shape
    layer_fwd = compute_s(shape.layer_fwd_flops(mbs) / tp)
    head_fwd = compute_s(shape.head_fwd_flops(mbs) / tp)
    act = mbs * shape.seq_len * shape.d_model * e  # one activation tensor of a micro-batch

    # Ranks are laid out (pp, dp, tp) with tp innermost; a node's NIC is shared by the rings crossing it.
    tp_local = tp <= ppn
    tp_bw, tp_lat = np.where(tp_local, intra_bw, inter_bw), np.where(tp_local, intra_lat, inter_lat)
    tp_ar = ring_allreduce_s(tp, act, tp_bw, tp_lat)
    # On CPUs a collective's data movement (copies, reduction, loopback TCP) runs on the same cores as
    # compute: it is work, slowed by contention; only the latency is waiting.
    tp_copy = ring_allreduce_s(tp, act, tp_bw, 0.0) if hw.cores_per_node else np.zeros_like(tp)
    n_tp = tp_collectives_per_layer(w.recompute)
    # Host work, in seconds of a process that has a core to itself (compute_s already divides the
    # node's FLOP/s among its processes, so compute is not slowed again by the contention below).
    host_layer = (hw.layer_overhead_us + np.where(tp > 1, hw.tp_overhead_us, 0.0)) * 1e-6  # eager dispatch
    layer_work = passes * layer_fwd / contention + host_layer + n_tp * tp_copy
    layer_wait = n_tp * (tp_ar - tp_copy)
    # Vocab-parallel ends: the embedding's output all-reduce (forward) on the first stage; the output
    # head's logits all-gather (forward) and input-gradient all-reduce (backward) on the last one.
    head_wait = np.where(pp == 1, 3.0, 2.0) * tp_ar
    if w.nodes > 1:  # some stage boundary crosses nodes; every rank of a stage sends at once
        pp_bw, pp_lat = inter_bw / np.minimum(dp * tp, ppn), inter_lat
    else:
        pp_bw, pp_lat = intra_bw, intra_lat
    p2p = np.where(pp > 1, 2 * (pp_lat + act / pp_bw), 0.0)  # activation forward, its gradient back
    stage_work = shape.n_layers / pp * layer_work + 3 * head_fwd / contention + hw.microbatch_overhead_us * 1e-6
    stage_wait = shape.n_layers / pp * layer_wait + head_wait + p2p
    slots = m + pp - 1  # 1F1B / GPipe: pp - 1 fill-and-drain slots around the m micro-batches
    # Host work runs `contention` times slower while every process is busy; in the bubble some are
    # idle and the others get their cores: at least the critical path at one core per process, at
    # least the node's total work divided among its cores (equal on GPUs: contention 1).
    pipeline = np.maximum(slots, contention * m) * stage_work + slots * stage_wait

    local_params = w.stage_params(tp, pp)
    dp_local = dp * tp <= ppn
    dp_bw = np.where(dp_local, intra_bw, inter_bw / np.minimum(tp, ppn))  # tp DP rings share a NIC
    dp_lat = np.where(dp_local, intra_lat, inter_lat)
    grad_bytes = local_params * GRAD_BYTES  # gradients are fp32 under every precision
    stage = stage_work * contention + stage_wait  # one micro-batch of a stage with all processes busy
    if w.dp_impl == "fsdp":  # all-gather (compute precision) before forward and backward of every
        # micro-batch, one reduce-scatter of the fp32 gradients

        def sharded(nbytes: np.ndarray) -> np.ndarray:
            return np.where(dp > 1, (dp - 1) / dp * nbytes / dp_bw + (dp - 1) * dp_lat, 0.0)

        # Under PP the stage stays gathered from the first micro-batch's forward to the last one's backward
        # (reshard_after_forward off; PipelineStage defers resharding and the reduce-scatter): one all-gather.
        # Without PP every micro-batch's backward reduce-scatters its gradients; under PP only the last.
        gathers = np.where(pp == 1, 2 * m, 1.0)
        reduces = np.where(pp == 1, m, 1.0)
        dp_comm = gathers * sharded(local_params * e) + reduces * sharded(grad_bytes)
        hideable = pipeline
        optimizer_params = local_params / dp
    else:
        dp_comm = ring_allreduce_s(dp, grad_bytes, dp_bw, dp_lat)
        # DDP (and the engine's own buckets under TP or PP) hides the bucketed all-reduce behind the
        # last micro-batch's backward.
        hideable = (passes - 1) / passes * stage
        optimizer_params = local_params
    exposed = dp_comm - np.minimum(hw.overlap * dp_comm, hideable)
    optimizer = optimizer_params * ADAM_BYTES_PER_PARAM / (hw.mem_bw_gbs * 1e9)
    return pipeline + exposed + optimizer + hw.step_overhead_ms * 1e-3 * contention
