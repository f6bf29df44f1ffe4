"""AdamW with multi-tensor (foreach) kernels under every layout.

One foreach kernel cannot mix plain tensors and DTensors, nor DTensors of different meshes (under TP
the norms stay plain, under FSDP2 + TP they live on another mesh than the matrices): parameters are
grouped by kind so that each group's kernels see one kind only. The hyperparameters are the same in
every group, and DCP's flattened optimizer state is keyed by parameter name, so checkpoints still
reshard between layouts that group differently.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _kind(p: torch.Tensor) -> tuple:
    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh.mesh_dim_names, tuple(p.device_mesh.mesh.flatten().tolist()))
    return ("tensor",)


def adamw(model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters, foreach kernels, one parameter group per kind of tensor."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        groups.setdefault(_kind(p), []).append(p)
    params = [{"params": ps} for ps in groups.values()]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=True)
