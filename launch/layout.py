"""A strategy's device mesh, parallel model and optimizer on this rank: what a launch builds before it
loads a checkpoint, and what a standby on CPU builds ahead of its hand-over when it is told the
strategy to expect."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from cona_core.config import Config
from cona_core.strategy import Strategy
from launch import checkpoint
from launch.materialise import build_unallocated
from launch.models import get_spec
from launch.optimizer import adamw
from launch.parallelize import ParallelModel, build_mesh, parallelize


@dataclass
class Layout:
    strategy: Strategy
    mesh: DeviceMesh
    pm: ParallelModel
    opt: torch.optim.Optimizer
    prepared: bool = False  # built ahead of the launch, its optimizer state ready for a checkpoint


def build_layout(cfg: Config, strategy: Strategy, device: torch.device, vocab: int, fresh: bool = True) -> Layout:
    """Collective: mesh, model, `parallelize` and AdamW for `strategy`. The model is seeded, or for a
    `fresh` start with `model.init_from` the pretrained one (a launch that loads a checkpoint over it
    may pass fresh=False to skip reading the folder)."""
    t, search = cfg.train, cfg.search
    spec = get_spec(cfg.model.family)
    mesh = build_mesh(strategy, device.type)
    whole = build_unallocated(spec, cfg.model, vocab, t.seed, pretrained=fresh and cfg.model.init_from is not None)
    pm = parallelize(
        whole.model,
        mesh,
        strategy,
        spec,
        dp_impl=t.dp_impl,
        pp_schedule=t.pp_schedule,
        precision=search.precision,
        recompute=search.recompute,
        device=device,
        materialise=whole.materialise,
    )
    opt = adamw(pm.model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    return Layout(strategy, mesh, pm, opt)


def prepare_layout(cfg: Config, strategy: Strategy, device: torch.device, vocab: int) -> Layout:
    """Collective: `build_layout`, plus the optimizer state a checkpoint load fills (built by a step
    that changes nothing). Only for a launch that loads a checkpoint: a fresh one starts without state."""
    layout = build_layout(cfg, strategy, device, vocab, fresh=False)
    checkpoint.init_optimizer_state(layout.pm.model, layout.opt)
    layout.prepared = True
    return layout
