"""Build a model without allocating its parameters; once `parallelize` has split and sharded it, give this
rank's pieces real memory, with the same values whatever the layout.

The model is built with its parameters on the meta device (each is created by its module and moved there
at once, so at most one parameter is ever allocated on the host) and its buffers computed as usual on the
host. `parallelize` splits it into pipeline stages and shards it (TP, FSDP) on meta, then calls
`materialise`: `to_empty` allocates the rank's pieces on its device (and re-links FSDP's sharded
parameters), the buffers get their values back, and the family's seeded init draws every whole parameter
of the model on the host, one at a time and in the same order under every layout, of which each rank
keeps its own slice (`copy_values`); with `model.init_from`, each value is read from the pretrained
model's folder instead (`launch.pretrained`). A rank's peak while it starts is thus its pieces plus one
whole parameter, not its stage unsharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from cona_core.config import ModelConfig
from launch.models.common import copy_values
from launch.models.spec import ModelSpec
from launch.pretrained import pretrained_values

META = torch.device("meta")


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While building: every parameter a module registers goes to the meta device (tied ones stay tied)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device != META:
            param = nn.Parameter(param.to(META), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass
class Unallocated:
    """A whole model with its parameters on meta, and what `materialise` gives it once it is sharded."""

    model: nn.Module
    values: Iterator[tuple[str, torch.Tensor]]  # the seeded init of the whole model, drawn as taken
    buffers: dict[str, torch.Tensor]  # by name, on the host (`to_empty` drops their values)

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Allocate what `model` (this model, split and sharded) holds on `device` and set its values."""
        model.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(self.buffers[name])
        copy_values(model, self.values)


def build_unallocated(spec: ModelSpec, m: ModelConfig, vocab: int, seed: int, pretrained: bool = False) -> Unallocated:
    """The seeded model of `spec`, nothing allocated but its buffers; `pretrained`: its values are
    `m.init_from`'s weights instead (`launch.pretrained`)."""
    with _parameters_on_meta():
        model = spec.build(m, vocab)
    values = pretrained_values(m.init_from, spec, m, vocab, model) if pretrained else model.init_values(seed)
    return Unallocated(model, values, {n: b.clone() for n, b in model.named_buffers()})


def build_model(spec: ModelSpec, m: ModelConfig, vocab: int, seed: int, device: torch.device) -> nn.Module:
    """The whole seeded model on `device` (one process: no layout to shard it for)."""
    whole = build_unallocated(spec, m, vocab, seed)
    whole.materialise(whole.model, device)
    return whole.model
