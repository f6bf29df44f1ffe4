"""Build a model without allocating its parameters, then give this rank's pipeline stage real memory.

The model is built with its parameters on the meta device (each is created by its module and moved
there at once, so at most one parameter is ever allocated on the host) and its buffers computed as
usual on the host. The parameters this stage keeps are then allocated on the rank's device, buffers
moved there, and the family's seeded `init_weights` runs over the whole model: every layout draws the
same numbers in the same order (parameters left on meta draw and discard theirs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from cona_cli.config import ModelConfig
from launch.models.spec import ModelSpec

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


def _replace(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, value)


def build_model(
    spec: ModelSpec, m: ModelConfig, vocab: int, seed: int, device: torch.device, pp_rank: int, pp: int
) -> nn.Module:
    """The seeded model with stage `pp_rank` of `pp`'s parameters and all buffers on `device` (others on meta)."""
    with _parameters_on_meta():
        model = spec.build(m, vocab)
    with torch.device(META):
        stage = spec.build(m, vocab)
    spec.pipeline_split(stage, pp_rank, pp)
    owned = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
    real: dict[int, nn.Parameter] = {}  # by the meta parameter's id: tied parameters stay tied
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if name in owned:
            if id(p) not in real:
                real[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            _replace(model, name, real[id(p)])
    for name, b in list(model.named_buffers()):
        _replace(model, name, b.to(device))
    model.init_weights(seed)
    return model
