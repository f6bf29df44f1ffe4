"""Apply a (dp, tp, pp) layout to a plain model: pipeline split, tensor parallel, recompute, data parallel.

`parallelize(model, mesh, strategy)` returns a `ParallelModel` that runs one step's micro-batches
(pipeline schedule when pp > 1, gradient accumulation when pp = 1) and knows which of its
parameters' gradient shards each rank must count so that norms cover the whole model exactly once.
Losses stay on the device as tensors: reading them is left to the step's one host sync.
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
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from cona_core.config import ConfigError
from cona_core.strategy import Strategy
from launch.device import group_device
from launch.dtensor_pieces import counts_here, in_param_layout, local_tensor
from launch.grad_average import GradAverager
from launch.models.spec import Batch, ModelSpec
from launch.precision import autocast_forward, fsdp_policy, resolve_precision
from launch.recompute import recompute_blocks


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
    averager: GradAverager | None = None  # set when gradients are averaged here, not by DDP/FSDP
    device: torch.device | None = None  # where the local model, its batches and its losses live
    tied: tuple[nn.Parameter, ...] = ()  # this end stage's copies of parameters both end stages hold (pp > 1)
    tie_group: dist.ProcessGroup | None = None  # the first and the last stage at this rank's (dp, tp)
    # FSDP with pp = 1: the middle micro-batches' gradients stay unsharded on each rank, without a
    # reduce-scatter each (the worker sets it where memory allows: `unsharded_grad_bytes` more per rank)
    accumulate_unsharded: bool = False
    # Called once the first micro-batch's backward is through (pp = 1, two or more micro-batches): the
    # noise scale reads that micro-batch's gradient there (`launch.gradstats`)
    after_first_backward: Callable[[], None] | None = None

    def counted_grads(self, dims: tuple[str, ...]) -> list[torch.Tensor]:
        """Local gradient pieces this rank counts (see `counts_here`); a tied parameter's once, on the
        first stage."""
        return [
            local_tensor(p.grad)
            for p in self.model.parameters()
            if p.grad is not None and not self.is_tied_copy(p) and counts_here(p.grad, self.coord, dims)
        ]

    def counted_pairs(self, dims: tuple[str, ...]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its gradient in the parameter's layout, for the pieces this rank counts (see
        `counts_here`); a tied parameter's once, on the first stage."""
        pairs = []
        for p in self.model.parameters():
            if p.grad is None or self.is_tied_copy(p):
                continue
            g = in_param_layout(p, p.grad)
            if counts_here(g, self.coord, dims):
                pairs.append((p, g))
        return pairs

    def is_tied_copy(self, p: nn.Parameter) -> bool:
        """`p` is the last stage's copy of a tied parameter."""
        return not self.is_first and any(p is t for t in self.tied)

    def sum_tied(self, grads: list[torch.Tensor]) -> None:
        """Sum gradient pieces of the tied parameters (in place, in their parameters' layouts) over the
        first and the last stage."""
        for g in grads:
            dist.all_reduce(local_tensor(g), group=self.tie_group)

    @property
    def can_accumulate_unsharded(self) -> bool:
        """FSDP with pp = 1 and at least three micro-batches: some reduce-scatters could be skipped. (The
        first micro-batch's always runs: the noise scale reads it, `launch.gradstats`.)"""
        return isinstance(self.wrapped, FSDPModule) and self.strategy.pp == 1 and self.strategy.n_microbatches > 2

    def unsharded_grad_bytes(self) -> int:
        """What accumulating unsharded keeps on this rank: each local parameter's gradient gathered over dp,
        in FSDP's fp32 reduce dtype (`launch.precision.fsdp_policy`)."""
        return 4 * self.strategy.dp * sum(local_tensor(p).numel() for p in self.model.parameters())

    @property
    def is_first(self) -> bool:
        """This rank's stage takes the token inputs."""
        return self.coord["pp"] == 0

    @property
    def is_last(self) -> bool:
        """This rank's stage computes the loss."""
        return self.coord["pp"] == self.strategy.pp - 1

    def forward_backward(self, micro: list[Batch]) -> torch.Tensor:
        """Run the step's micro-batches with backward; returns the summed micro-batch losses (last stage).
        Where the dp average is ours, its buckets start during the backward passes (`average_grads`
        finishes it): under PP the schedule then leaves the gradients as micro-batch sums."""
        if self.averager is not None:
            m = self.strategy.n_microbatches
            self.averager.arm(backwards=m, divide=self.strategy.dp * (m if self.schedule is not None else 1))
        if self.schedule is not None:
            loss = self._pipeline(micro, train=True)
            # Megatron's embedding all-reduce: each end stage's copy of a tied weight got its own use's
            # gradient; the sum is the whole model's, so the copies (equal at init) stay equal.
            for p in self.tied:
                p.grad = in_param_layout(p, p.grad)
            self.sum_tied([p.grad for p in self.tied])
            return loss
        losses = []
        m = len(micro)
        for i, (x, y) in enumerate(micro):
            sync = i == m - 1 or not isinstance(self.wrapped, DDP)
            if self.accumulate_unsharded:  # (FSDP's default, every micro-batch syncing, is left on the last)
                self.wrapped.set_requires_gradient_sync(i in (0, m - 1))
            with nullcontext() if sync else self.wrapped.no_sync():
                loss = self.loss(self.wrapped(x), y)
                (loss / m).backward()
            if i == 0 and m > 1 and self.after_first_backward is not None:
                self.after_first_backward()
            losses.append(loss.detach())
        return torch.stack(losses).sum()

    def average_grads(self) -> None:
        """Finish the data-parallel gradient average where DDP/FSDP do not do it (`GradAverager`, which
        launched most of it during backward)."""
        if self.averager is not None:
            self.averager.finish()

    @torch.no_grad()
    def evaluate(self, micro: list[Batch]) -> torch.Tensor:
        """Forward only; returns the summed micro-batch losses (last stage)."""
        if self.schedule is not None:
            return self._pipeline(micro, train=False)
        return torch.stack([self.loss(self.wrapped(x), y) for x, y in micro]).sum()

    def _pipeline(self, micro: list[Batch], train: bool) -> torch.Tensor:
        x = torch.cat([m[0] for m in micro]) if self.is_first else None
        y = torch.cat([m[1] for m in micro]) if self.is_last else None
        losses: list[torch.Tensor] = []
        args = (x,) if x is not None else ()
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=y, losses=losses if self.is_last else None, return_outputs=False)
        return torch.stack([loss.detach() for loss in losses]).sum() if losses else torch.zeros((), device=self.device)


def tie_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of the first and the last pipeline stage at this rank's (dp, tp) coordinates (every rank
    creates every such group; None on middle stages)."""
    ranks = mesh.mesh  # global ranks by (pp, dp, tp)
    mine = None
    for ends in torch.stack([ranks[0].flatten(), ranks[-1].flatten()], dim=1).tolist():
        group = dist.new_group(ends)
        if dist.get_rank() in ends:
            mine = group
    return mine


def refuse_tp_dropout(model: nn.Module) -> None:
    """Refuse dropout under TP: every TP rank draws the same masks from the same seed, so the attention
    dropout of its head shard would repeat across shards (a separate TP stream, Megatron's RNG tracker,
    is not implemented)."""
    rates = [mod.p if isinstance(mod, nn.Dropout) else getattr(mod, "dropout", 0.0) for mod in model.modules()]
    p = max((float(r) for r in rates if isinstance(r, (int, float))), default=0.0)
    if p > 0:
        raise ConfigError(
            f"model.dropout: {p} with tp > 1 is not supported (TP ranks would share dropout masks); set it to 0"
        )


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    strategy: Strategy,
    spec: ModelSpec,
    *,
    dp_impl: str = "ddp",
    pp_schedule: str = "1f1b",
    precision: str = "fp32",
    recompute: bool = False,
    device: torch.device | None = None,
    materialise: Callable[[nn.Module, torch.device], None] | None = None,
) -> ParallelModel:
    """Apply the layout in a fixed order: pipeline split, tensor parallel, recompute, FSDP (with its mixed
    precision), `materialise`, then DDP or autocast, the tied weights' group and the schedule. `device`:
    where the model lives (default: the process group's device). `materialise(model, device)`: for a model
    built on the meta device (`launch.materialise`), allocates and initialises the rank's pieces once
    they are sharded."""
    device = device or group_device()
    precision = resolve_precision(precision, device)
    if strategy.tp > 1:
        refuse_tp_dropout(model)
    pp_rank = mesh["pp"].get_local_rank()
    if strategy.pp > 1:
        spec.pipeline_split(model, pp_rank, strategy.pp)
    if strategy.tp > 1:
        parallelize_module(model, mesh["tp"], spec.tp_plan(model))
    if recompute:
        recompute_blocks(model)
    wrapped: nn.Module = model
    if dp_impl == "fsdp":
        dp_mesh, mp = mesh["dp"], fsdp_policy(precision)
        # Under PP every micro-batch runs each block's forward and backward separately: resharding after
        # forward would all-gather each block again per micro-batch (TorchTitan keeps them unsharded
        # between forward and backward when pp > 1; `PipelineStage` turns reshard-after-backward and
        # gradient sync off until the last micro-batch anyway).
        reshard = strategy.pp == 1
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    if materialise is not None:
        materialise(model, device)
    if dp_impl != "fsdp":
        autocast_forward(model, precision, device)
        if strategy.dp > 1 and strategy.tp == 1 and strategy.pp == 1:
            # gradient_as_bucket_view: each `.grad` is a view into DDP's fp32 bucket, not a second copy
            # of the gradients (the comm hook in launch.gradstats reads the buckets before reducing them).
            wrapped = DDP(
                model,
                process_group=mesh["dp"].get_group(),
                forward_sync_buffers=False,
                gradient_as_bucket_view=True,
            )
    pm = ParallelModel(
        model=model,
        wrapped=wrapped,
        mesh=mesh,
        strategy=strategy,
        loss=spec.loss,
        coord=dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())),
        device=device,
    )
    # Measured with torch 2.13 on gloo: DDP's reducer rejects DTensor parameters under TP (mixed
    # Tensor/DTensor ops), and under pipelining with 2 micro-batches it fails its bucket rebuild
    # (INTERNAL ASSERT in reducer.cpp). There the local gradients are averaged here, in buckets over
    # the dp group launched during backward (`launch.grad_average`).
    manual = dp_impl == "ddp" and strategy.dp > 1 and wrapped is model
    if strategy.pp > 1 and spec.tied:
        pm.tie_group = tie_group(mesh)
        if pm.is_first or pm.is_last:
            params = dict(model.named_parameters())
            pm.tied = tuple(params[name] for name in spec.tied)
    if manual:
        pm.averager = GradAverager(list(model.parameters()), mesh["dp"].get_group(), deferred=pm.tied)
    if strategy.pp > 1:
        stage = PipelineStage(wrapped, pp_rank, strategy.pp, device, group=mesh["pp"].get_group())
        schedule_cls = Schedule1F1B if pp_schedule == "1f1b" else ScheduleGPipe
        # scale_grads off where our buckets are in flight during backward: the schedule's division
        # after the last backward would race them (the averager divides by dp·m instead)
        pm.schedule = schedule_cls(
            stage, n_microbatches=strategy.n_microbatches, loss_fn=spec.loss, scale_grads=not manual
        )
    return pm


def build_mesh(strategy: Strategy, device: str) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    assert dist.get_world_size() == strategy.world
    return init_device_mesh(device, (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=("pp", "dp", "tp"))
