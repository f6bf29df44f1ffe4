"""An in-memory copy of one rank's training state, restored exactly: the base of paired trials, which run
the same samples from the same state under two batch sizes and keep the better end.

It holds the rank's local shards (parameters, buffers, AdamW's moments and step counts) as device
clones, so it is layout-bound: it restores into the same mesh, under any micro- and global batch (an
in-place resize), never into another layout (that is what a DCP checkpoint is for).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


@dataclass
class Snapshot:
    tensors: list[torch.Tensor]  # parameters then buffers, in the module's order
    optimizer: list[dict[str, Any]]  # each parameter's state, in the parameters' order
    extra: Any  # anything else the caller keeps with it (trainer state, estimator state), deep-copied

    @classmethod
    def take(cls, model: nn.Module, opt: torch.optim.Optimizer, extra: Any = None) -> Snapshot:
        with torch.no_grad():
            tensors = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
            state = [{k: _clone(v) for k, v in opt.state.get(p, {}).items()} for p in model.parameters()]
        return cls(tensors, state, copy.deepcopy(extra))

    def restore(self, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        """Write the copy back into `model` and `opt` (the same objects it was taken from, or ones of the
        same layout); returns a fresh copy of `extra`."""
        params = list(model.parameters())
        live = [*params, *model.buffers()]
        if len(live) != len(self.tensors):
            raise ValueError(f"snapshot of {len(self.tensors)} tensors restored into a model of {len(live)}")
        with torch.no_grad():
            for dst, src in zip(live, self.tensors):
                dst.copy_(src)
            for p, saved in zip(params, self.optimizer):
                if saved:
                    opt.state[p] = {k: _clone(v) for k, v in saved.items()}
                else:
                    opt.state.pop(p, None)
        return copy.deepcopy(self.extra)
