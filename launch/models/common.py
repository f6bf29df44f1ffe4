"""What the model families share: the loss, seeded init, the pipeline split and the tied output head."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInputOutput, RowwiseParallel

from launch.models.spec import IGNORE_INDEX


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, target_fraction: float = 1.0) -> torch.Tensor:
    """Token cross-entropy summed over real targets and divided by all positions times `target_fraction`.

    Without padding (causal LM) this is the mean; loss * targets.numel() * target_fraction is the exact sum.
    """
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    return ce / (targets.numel() * target_fraction)


def normal_init_values(
    model: nn.Module, seed: int, n_layers: int, residual: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-2 style init of the parameters `model` holds now, by name, one full tensor at a time in a seeded
    order: N(0, 0.02) matrices, N(0, 0.02 / sqrt(2 n_layers)) for the `residual` output projections, norm
    weights 1, biases 0. Called on the whole model (before any pipeline split or sharding) it gives the
    same values whatever the layout (the names are read now, the values drawn as they are taken)."""
    shapes = sorted((name, p.shape) for name, p in model.named_parameters())
    g = torch.Generator().manual_seed(seed)

    def values() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes:
            if name.endswith("bias"):
                yield name, torch.zeros(shape)
            elif len(shape) == 1:
                yield name, torch.ones(shape)
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(residual) else 0.02
                yield name, torch.randn(shape, generator=g) * std

    return values()


@torch.no_grad()
def copy_values(model: nn.Module, values: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Set `model`'s parameters from (name, whole value) pairs: a plain parameter takes it whole, a DTensor
    (TP, FSDP) this rank's slice of it, cut locally (no communication); a name `model` does not hold
    (another pipeline stage's) is skipped."""
    params = dict(model.named_parameters())
    for name, value in values:
        p = params.get(name)
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None))
        elif p is not None:
            p.copy_(value)


def keep_stage(model: nn.Module, pp_rank: int, pp: int, first: tuple[str, ...], last: tuple[str, ...]) -> None:
    """Keep only stage `pp_rank`'s layers (global indices kept as keys) and the end modules it holds:
    `first` on stage 0, `last` on stage pp - 1 (a name in both, a tied embedding, stays on both)."""
    per_stage = len(model.layers) // pp
    owned = set(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    held = (first if pp_rank == 0 else ()) + (last if pp_rank == pp - 1 else ())
    for name in set(first + last) - set(held):
        setattr(model, name, None)
    model.takes_tokens = pp_rank == 0


class TiedHead(nn.Module):
    """Logits from hidden states with the input embedding's weight, passed at call time: the model holds
    (and a checkpoint names) that weight once, as the embedding's."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)


def block_tp_plan(layer_ids: list[str], colwise: tuple[str, ...], rowwise: tuple[str, ...]) -> dict[str, ParallelStyle]:
    """Megatron's plan for the blocks a stage holds: the projections into attention and MLP column-parallel,
    the ones out of them row-parallel (one all-reduce each)."""
    plan: dict[str, ParallelStyle] = {}
    for i in layer_ids:
        plan |= {f"layers.{i}.{name}": ColwiseParallel() for name in colwise}
        plan |= {f"layers.{i}.{name}": RowwiseParallel() for name in rowwise}
    return plan


def tied_head_style() -> ParallelStyle:
    """Tensor parallelism for a `TiedHead`: ColwiseParallel's layouts on the weight the vocab-parallel
    embedding shards as Shard(0) (replicated hidden states in, vocabulary-sharded logits gathered)."""
    return PrepareModuleInputOutput(
        input_layouts=(Replicate(), None),
        desired_input_layouts=(Replicate(), None),
        output_layouts=Shard(-1),
        desired_output_layouts=Replicate(),
    )
