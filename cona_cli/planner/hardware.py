"""Hardware profiles: one device type and its interconnect, as the cost and memory models read them.

Profiles ship with the package (`cona_cli/planner/profiles/<name>.yaml`); `search.hardware` names
one or gives the path of a YAML file of the same form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from cona_core.config import ConfigError, read_yaml, type_ok

HARDWARE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and its interconnect; YAML units (TFLOP/s, GiB, GB/s, us, ms)."""

    name: str
    peak_tflops: dict[str, float]  # dense peak per device (per core when cores_per_node is set), by precision
    memory_gib: float  # per device (the node's total when cores_per_node is set)
    mem_bw_gbs: float  # device memory bandwidth (optimizer step)
    intra_bw_gbs: float  # per-direction bus bandwidth between devices of one node
    intra_latency_us: float  # per-message latency inside a node
    inter_bw_gbs: float  # per-node network bandwidth (shared by the rings that cross the node)
    inter_latency_us: float  # per-message latency between nodes
    mfu_max: float  # best achievable fraction of peak on large GEMMs
    eff_half_gflop: float  # work per layer and micro-batch on one device at which efficiency is half of mfu_max
    overlap: float  # fraction of data-parallel communication that can hide behind backward
    step_overhead_ms: float  # fixed per-step cost
    layer_overhead_us: float  # fixed cost per layer per micro-batch (kernel launches, Python)
    tp_overhead_us: float  # extra fixed cost per tensor-parallel layer per micro-batch (DTensor dispatch)
    reserved_gib: float  # runtime/context memory per process
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
    """A profile by name (one of `profiles/`) or a path to a YAML file."""
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
    if (
        not isinstance(peak, dict)
        or "fp32" not in peak
        or any(k not in ("fp32", "bf16", "fp16") or not type_ok(v, float) or v <= 0 for k, v in peak.items())
    ):
        raise ConfigError("peak_tflops: must map fp32 (and optionally bf16, fp16) to TFLOP/s > 0")
    for key, value in raw.items():
        if key == "peak_tflops":
            continue
        if not type_ok(value, hints[key]) or (isinstance(value, (int, float)) and value < 0):
            raise ConfigError(f"{key}: invalid value {value!r}")
    if not 0 <= raw["overlap"] <= 1:
        raise ConfigError("overlap: must be in [0, 1]")
    return HardwareProfile(**{k: float(v) if hints[k] is float else v for k, v in raw.items()})
