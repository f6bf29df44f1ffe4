"""Local pieces of DTensor gradients: which rank counts which piece in a norm summed over ranks, and
how a gradient lines up with its parameter's shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def in_param_layout(p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """`grad` in the placements of its parameter (under TP the embedding's comes back Replicate while the
    tied head's is Shard(0): local pieces of both copies must line up to be summed)."""
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def counts_here(grad: torch.Tensor, coord: dict[str, int], dims: tuple[str, ...]) -> bool:
    """Whether this rank's local piece of `grad` is the one to count in norms summed over ranks.

    Among ranks holding identical copies along `dims`, exactly one counts: coordinate 0 on every
    dimension of `dims` over which the gradient is replicated. With dims = (dp, tp) a sum over all
    ranks gives the whole model's norm once; with (tp,) once per data-parallel replica. Placements
    are read from the gradient, not the parameter: under TP the embedding's gradient comes back
    Replicate although its weight is Shard(0). FSDP over a TP-sharded dimension 0 places a
    `_StridedShard` on dp, which is not a `Shard` subclass.
    """
    sharded: set[str] = set()
    if isinstance(grad, DTensor):
        names = grad.device_mesh.mesh_dim_names
        sharded = {names[i] for i, pl in enumerate(grad.placements) if isinstance(pl, (Shard, _StridedShard))}
    return all(coord[d] == 0 for d in dims if d not in sharded)
