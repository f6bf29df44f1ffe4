"""Apply a (dp, tp, pp) layout to a plain model: pipeline split, then tensor parallel, then data parallel.

`parallelize(model, mesh, strategy)` returns a `ParallelModel` that runs one step's micro-batches
(pipeline schedule when pp > 1, gradient accumulation when pp = 1) and knows which of its
parameters' gradient shards each rank must count so that norms cover the whole model exactly once.
What is particular to a model family (its TP plan, pipeline split and loss) comes from its `ModelSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from cona_cli.strategy import Strategy
from launch.models.spec import Batch, ModelSpec


@dataclass
class ParallelModel:
    """The local piece of the model under a layout, and how to run a step on it."""

    model: nn.Module  # unwrapped local module: the state dict and the optimiser use it
    wrapped: nn.Module  # what runs forward (DDP / FSDP / plain)
    mesh: DeviceMesh
    strategy: Strategy
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    schedule: object | None = None
    coord: dict[str, int] = field(default_factory=dict)  # this rank's (pp, dp, tp) coordinates
    dp_group: dist.ProcessGroup | None = None  # set when gradients are averaged here, not by DDP/FSDP

    def counted_grads(self, dims: tuple[str, ...]) -> list[torch.Tensor]:
        """Local gradient pieces this rank counts (see `counts_here`)."""
        return [
            local_tensor(p.grad)
            for p in self.model.parameters()
            if p.grad is not None and counts_here(p.grad, self.coord, dims)
        ]

    @property
    def is_first(self) -> bool:
        """This rank's stage takes the token inputs."""
        return self.coord["pp"] == 0

    @property
    def is_last(self) -> bool:
        """This rank's stage computes the loss."""
        return self.coord["pp"] == self.strategy.pp - 1

    def forward_backward(self, micro: list[Batch]) -> float:
        """Run the step's micro-batches with backward; returns the summed micro-batch losses (last stage)."""
        if self.schedule is not None:
            total = self._pipeline(micro, train=True)
        else:
            total = 0.0
            m = len(micro)
            for i, (x, y) in enumerate(micro):
                sync = i == m - 1 or not isinstance(self.wrapped, DDP)
                with nullcontext() if sync else self.wrapped.no_sync():
                    loss = self.loss(self.wrapped(x), y)
                    (loss / m).backward()
                total += loss.item()
        return total

    def average_grads(self) -> None:
        """Data-parallel gradient average where DDP/FSDP did not already do it during backward:
        the local (TP-sharded) gradients in one flat all-reduce over the dp group."""
        if self.dp_group is None:
            return
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.strategy.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def evaluate(self, micro: list[Batch]) -> float:
        """Forward only; returns the summed micro-batch losses (last stage)."""
        if self.schedule is not None:
            return self._pipeline(micro, train=False)
        return sum(self.loss(self.wrapped(x), y).item() for x, y in micro)

    def _pipeline(self, micro: list[Batch], train: bool) -> float:
        x = torch.cat([m[0] for m in micro]) if self.is_first else None
        y = torch.cat([m[1] for m in micro]) if self.is_last else None
        losses: list[torch.Tensor] = []
        args = (x,) if x is not None else ()
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=y, losses=losses if self.is_last else None, return_outputs=False)
        return float(sum(loss.item() for loss in losses))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def counts_here(grad: torch.Tensor, coord: dict[str, int], dims: tuple[str, ...]) -> bool:
    """Whether this rank's local piece of `grad` is the one to count in norms summed over ranks.

    Among ranks holding identical copies along `dims`, exactly one counts: coordinate 0 on every
    dimension of `dims` over which the gradient is replicated. With dims = (dp, tp) a sum over all
    ranks gives the whole model's norm once; with (tp,) once per data-parallel replica. Placements
    are read from the gradient, not the parameter: under TP the embedding's gradient comes back
    Replicate although its weight is Shard(0).
    """
    sharded: set[str] = set()
    if isinstance(grad, DTensor):
        names = grad.device_mesh.mesh_dim_names
        sharded = {names[i] for i, pl in enumerate(grad.placements) if isinstance(pl, Shard)}
    return all(coord[d] == 0 for d in dims if d not in sharded)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    strategy: Strategy,
    spec: ModelSpec,
    *,
    dp_impl: str = "ddp",
    pp_schedule: str = "1f1b",
) -> ParallelModel:
    """Apply the layout in a fixed order: pipeline split, tensor parallel, data parallel, schedule."""
    pp_rank = mesh["pp"].get_local_rank()
    if strategy.pp > 1:
        spec.pipeline_split(model, pp_rank, strategy.pp)
    if strategy.tp > 1:
        parallelize_module(model, mesh["tp"], spec.tp_plan(model))
    wrapped: nn.Module = model
    if dp_impl == "fsdp":
        dp_mesh = mesh["dp"]
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=strategy.pp == 1)
    elif strategy.dp > 1 and strategy.tp == 1 and strategy.pp == 1:
        wrapped = DDP(model, process_group=mesh["dp"].get_group(), forward_sync_buffers=False)
    pm = ParallelModel(
        model=model,
        wrapped=wrapped,
        mesh=mesh,
        strategy=strategy,
        loss=spec.loss,
        coord=dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())),
    )
    if dp_impl == "ddp" and strategy.dp > 1 and wrapped is model:
        # Measured with torch 2.13 on gloo: DDP's reducer rejects DTensor parameters under TP (mixed
        # Tensor/DTensor ops), and under pipelining with 2 micro-batches it fails its bucket rebuild
        # (INTERNAL ASSERT in reducer.cpp). There the local gradients are averaged here, after the
        # step's backward passes, in one flat all-reduce over the dp group.
        pm.dp_group = mesh["dp"].get_group()
    if strategy.pp > 1:
        stage = PipelineStage(wrapped, pp_rank, strategy.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule_cls = Schedule1F1B if pp_schedule == "1f1b" else ScheduleGPipe
        pm.schedule = schedule_cls(stage, n_microbatches=strategy.n_microbatches, loss_fn=spec.loss)
    return pm


def build_mesh(strategy: Strategy, device: str) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    assert dist.get_world_size() == strategy.world
    return init_device_mesh(device, (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=("pp", "dp", "tp"))
