"""Activation recompute per block: a block keeps only its input and recomputes its forward in backward."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def recompute_blocks(model: nn.Module) -> None:
    """Checkpoint every block of `model.layers` (in place: parameter names do not change). Applied after
    tensor parallelism (the recomputed forward repeats its collectives) and before data parallelism."""
    for block in model.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
