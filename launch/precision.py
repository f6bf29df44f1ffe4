"""Compute precision: bf16 with fp32 master weights, gradients and optimizer state.

Under FSDP2 the parameters are cast for compute by a `MixedPrecisionPolicy` (gradients reduced in
fp32); elsewhere the model's forward runs under autocast. Both apply to training and evaluation alike.
fp16 is refused by the config (it would need loss scaling).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """`search.precision` as the worker runs it: `auto` is bf16 on CUDA, fp32 on the CPU (the planner's
    `cona_cli.planner.memory.compute_precision` gives the same answer from the hardware profile, and
    `launch.device` refuses a GPU profile on CPU ranks under `backend: auto`)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered and used in the compute dtype, gradients reduced in fp32."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def autocast_forward(model: nn.Module, precision: str, device: torch.device) -> None:
    """Run `model`'s forward under autocast to `precision` (in place: parameter names do not change)."""
    if precision != "fp32":
        model.forward = torch.autocast(device.type, dtype=DTYPES[precision])(model.forward)
