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

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np

from cona_cli.config import Config, ConfigError, _type_ok, read_yaml
from cona_cli.strategy import Strategy

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "configs" / "hardware"
ADAM_BYTES_PER_PARAM = 28  # AdamW touches master weight, grad, m, v: 4 reads + 3 writes of 4 bytes


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and its interconnect; YAML units (TFLOP/s, GiB, GB/s, us, ms)."""

    name: str
    peak_tflops: dict[str, float]  # dense peak per device (per core when cores_per_node is set), by precision
    memory_gib: float              # per device (the node's total when cores_per_node is set)
    mem_bw_gbs: float              # device memory bandwidth (optimizer step)
    intra_bw_gbs: float            # per-direction bus bandwidth between devices of one node
    intra_latency_us: float        # per-message latency inside a node
    inter_bw_gbs: float            # per-node network bandwidth (shared by the rings that cross the node)
    inter_latency_us: float        # per-message latency between nodes
    mfu_max: float                 # best achievable fraction of peak on large GEMMs
    eff_half_gflop: float          # work per layer and micro-batch on one device at which efficiency is half of mfu_max
    overlap: float                 # fraction of data-parallel communication that can hide behind backward
    step_overhead_ms: float        # fixed per-step cost
    layer_overhead_us: float       # fixed cost per layer per micro-batch (kernel launches, Python)
    tp_overhead_us: float          # extra fixed cost per tensor-parallel layer per micro-batch (DTensor dispatch)
    reserved_gib: float            # runtime/context memory per process
    cores_per_node: int | None = None  # CPUs: processes of a node share its cores and memory
    microbatch_overhead_us: float = 0.0  # fixed host cost per micro-batch and stage (schedule, loss, autograd start)

    def device_flops(self, precision: str, procs_per_node: int) -> float:
        """FLOP/s one process can reach at 100% efficiency."""
        peak = self.peak_tflops[precision] * 1e12
        return peak * self.cores_per_node / procs_per_node if self.cores_per_node else peak

    def cpu_contention(self, procs_per_node: int) -> float:
        """Slow-down of single-threaded overheads when processes outnumber cores."""
        return max(1.0, procs_per_node / self.cores_per_node) if self.cores_per_node else 1.0

    def device_memory_bytes(self, procs_per_node: int) -> float:
        gib = self.memory_gib / procs_per_node if self.cores_per_node else self.memory_gib
        return gib * 2**30

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A profile by name (`configs/hardware/<name>.yaml`) or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
            raise ConfigError(f"hardware {name_or_path!r}: unknown profile (known: {known})")
    raw = read_yaml(path)
    try:
        return hardware_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def hardware_from_dict(raw: Any) -> HardwareProfile:
    """Validate a parsed profile: every key known, numbers non-negative, peak_tflops by precision."""
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping")
    hints = get_type_hints(HardwareProfile)
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(fields)})")
    for key, f in fields.items():
        if key not in raw and f.default is dataclasses.MISSING:
            raise ConfigError(f"{key}: required")
    peak = raw["peak_tflops"]
    if not isinstance(peak, dict) or "fp32" not in peak or any(
            k not in ("fp32", "bf16", "fp16") or not _type_ok(v, float) or v <= 0 for k, v in peak.items()):
        raise ConfigError("peak_tflops: must map fp32 (and optionally bf16, fp16) to TFLOP/s > 0")
    for key, value in raw.items():
        if key == "peak_tflops":
            continue
        if not _type_ok(value, hints[key]) or (isinstance(value, (int, float)) and value < 0):
            raise ConfigError(f"{key}: invalid value {value!r}")
    if not 0 <= raw["overlap"] <= 1:
        raise ConfigError("overlap: must be in [0, 1]")
    return HardwareProfile(**{k: float(v) if hints[k] is float else v for k, v in raw.items()})


@dataclass(frozen=True)
class Workload:
    """The model shape and training settings that T(s) and memory depend on."""

    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    vocab: int
    precision: str = "fp32"
    recompute: bool = False
    pp_schedule: str = "1f1b"
    dp_impl: str = "ddp"
    nodes: int = 1
    procs_per_node: int = 1

    @classmethod
    def from_config(cls, cfg: Config) -> "Workload":
        m = cfg.model
        return cls(m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn, m.seq_len, cfg.data.vocab_size,
                   cfg.search.precision, cfg.search.recompute, cfg.train.pp_schedule, cfg.train.dp_impl,
                   cfg.cluster.nodes, cfg.cluster.procs_per_node)

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def act_bytes(self) -> int:
        """Bytes per activation / weight / gradient element in the compute precision."""
        return 4 if self.precision == "fp32" else 2

    @property
    def layer_params(self) -> int:
        h = self.d_model
        qkv = h * (h + 2 * h * self.kv_heads // self.n_heads)
        return qkv + h * h + 2 * h * self.ffn + 2 * h  # attention, GELU MLP, two norms

    @property
    def total_params(self) -> int:
        return self.n_layers * self.layer_params + 2 * self.vocab * self.d_model + self.d_model

    def layer_fwd_flops(self, mbs: np.ndarray) -> np.ndarray:
        """Forward FLOPs of one transformer layer for a micro-batch of `mbs` sequences (all of tp)."""
        h, s = self.d_model, self.seq_len
        tokens = mbs * s
        gemm = 2 * tokens * (h * (h + 2 * h * self.kv_heads // self.n_heads) + h * h + 2 * h * self.ffn)
        attention = 4 * tokens * s * h  # QK^T and AV, causal mask not discounted (as Megatron counts)
        return gemm + attention

    def head_fwd_flops(self, mbs: np.ndarray) -> np.ndarray:
        return 2 * mbs * self.seq_len * self.d_model * self.vocab

    def stage_params(self, tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
        """Parameters held by one device of the largest stage (layers plus embedding or head)."""
        return (self.n_layers / pp * self.layer_params + self.vocab * self.d_model * np.where(pp == 1, 2, 1)) / tp


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
    flops = hw.device_flops(w.precision, ppn)  # already the per-process share of the node's cores
    contention = hw.cpu_contention(ppn)
    intra_bw, inter_bw = hw.intra_bw_gbs * 1e9, hw.inter_bw_gbs * 1e9
    intra_lat, inter_lat = hw.intra_latency_us * 1e-6, hw.inter_latency_us * 1e-6
    half = hw.eff_half_gflop * 1e9

    def compute_s(work: np.ndarray) -> np.ndarray:
        return work / (flops * hw.mfu_max * work / (work + half))

    passes = 4.0 if w.recompute else 3.0  # forward + backward (2x forward) [+ recomputed forward]
    layer_fwd = compute_s(w.layer_fwd_flops(mbs) / tp)
    head_fwd = compute_s(w.head_fwd_flops(mbs) / tp)
    act = mbs * w.seq_len * w.d_model * w.act_bytes  # one activation tensor of a micro-batch

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
    stage_work = w.n_layers / pp * layer_work + 3 * head_fwd / contention + hw.microbatch_overhead_us * 1e-6
    stage_wait = w.n_layers / pp * layer_wait + head_wait + p2p
    slots = m + pp - 1  # 1F1B / GPipe: pp - 1 fill-and-drain slots around the m micro-batches
    # Host work runs `contention` times slower while every process is busy; in the bubble some are
    # idle and the others get their cores: at least the critical path at one core per process, at
    # least the node's total work divided among its cores (equal on GPUs: contention 1).
    pipeline = np.maximum(slots, contention * m) * stage_work + slots * stage_wait

    local_params = w.stage_params(tp, pp)
    dp_local = dp * tp <= ppn
    dp_bw = np.where(dp_local, intra_bw, inter_bw / np.minimum(tp, ppn))  # tp DP rings share a NIC
    dp_lat = np.where(dp_local, intra_lat, inter_lat)
    grad_bytes = local_params * w.act_bytes
    stage = stage_work * contention + stage_wait  # one micro-batch of a stage with all processes busy
    if w.dp_impl == "fsdp":  # all-gather before forward and backward of every micro-batch, reduce-scatter
        gather = np.where(dp > 1, (dp - 1) / dp * grad_bytes / dp_bw + (dp - 1) * dp_lat, 0.0)
        dp_comm = (2 * m + 1) * gather
        hideable = pipeline
        optimizer_params = local_params / dp
    else:
        dp_comm = ring_allreduce_s(dp, grad_bytes, dp_bw, dp_lat)
        hideable = (passes - 1) / passes * stage  # backward of the last micro-batch
        optimizer_params = local_params
    exposed = dp_comm - np.minimum(hw.overlap * dp_comm, hideable)
    optimizer = optimizer_params * ADAM_BYTES_PER_PARAM / (hw.mem_bw_gbs * 1e9)
    return pipeline + exposed + optimizer + hw.step_overhead_ms * 1e-3 * contention
