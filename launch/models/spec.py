"""What a model family gives the engine: the `ModelSpec` every family module exports as `SPEC`.

The trainer and `parallelize()` know nothing about a family beyond this. Conventions a family's
module keeps: its blocks live in an `nn.ModuleDict` named `layers` keyed by global index (so a
pipeline stage keeps the whole model's parameter names), and it has `init_values(seed)`, its whole
seeded init as (name, value) pairs drawn one at a time (identical whatever the layout:
`launch.materialise` copies each rank's slice), and `init_weights(seed)`, the same in place. A family's
special tokens (`cona_core.shape.SPECIAL_TOKENS`) follow the corpus's own tokens: with a vocabulary of V
ids in all, the k specials are ids V - k .. V - 1 in their order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle

    from cona_core.config import ModelConfig
    from cona_core.shape import ModelShape

IGNORE_INDEX = -100  # target id excluded from the loss (padding of evaluation batches)

Batch = tuple["torch.Tensor", "torch.Tensor"]
BatchFn = Callable[["torch.Tensor", "torch.Tensor"], Batch]


def next_token_batch(windows: torch.Tensor, sample_ids: torch.Tensor) -> Batch:
    """Causal language modelling: from windows of seq_len + 1 tokens, predict token t+1 from tokens <= t."""
    return windows[:, :-1], windows[:, 1:]


def causal_lm_batch(vocab_size: int) -> BatchFn:
    """The batch function of a causal language model (any vocabulary)."""
    return next_token_batch


HFSource = tuple[str, "Callable[[torch.Tensor], torch.Tensor] | None"]
"""Where a parameter's value is in a Hugging Face checkpoint: the tensor's name, and what makes the value
from it (None: the tensor as it is)."""


@dataclass(frozen=True)
class HFExport:
    """How a family maps onto a Hugging Face `transformers` model (`cona export --format hf`) and back
    (`model.init_from`)."""

    architecture: str
    """The transformers class, e.g. GPT2LMHeadModel."""
    config: Callable[[ModelConfig, int], dict[str, Any]]
    """config.json for a model config and vocabulary size (tokenizer ids are added by the exporter)."""
    tensors: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    """A consolidated state dict in cona's names (no `model.` prefix) -> tensors in the HF model's names."""
    sources: Callable[[ModelConfig], dict[str, HFSource]]
    """The inverse of `tensors`: each parameter of the whole model (cona's name) -> its `HFSource`."""


@dataclass(frozen=True)
class ModelSpec:
    family: str
    build: Callable[[ModelConfig, int], nn.Module]
    """The plain model for a config and a vocabulary size (no parallelism; honours torch.device)."""
    tp_plan: Callable[[nn.Module], dict[str, ParallelStyle]]
    """Tensor-parallel styles by submodule name, for the modules this (pipeline stage's) model holds."""
    pipeline_split: Callable[[nn.Module, int, int], None]
    """Keep only stage `pp_rank` of `pp` in place: its layers and, at the ends, embedding and head."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(outputs, targets) -> loss summed over real targets, divided by all target positions times
    `target_fraction` (a constant per position, so any split into micro-batches sums to the same gradient)."""
    batch: Callable[[int], BatchFn]
    """vocabulary size -> ((token windows [n, seq_len + 1], global sample ids [n]) -> (inputs, targets))."""
    shape: Callable[[ModelConfig, int], ModelShape]
    """The torch-free shape the planner's cost and memory models read."""
    hf: HFExport | None = None
    """The Hugging Face mapping, if the family has one."""
    target_fraction: float = 1.0
    """Expected share of positions that are targets (masked LM: the masking rate)."""
    tied: tuple[str, ...] = ()
    """Parameters the first and the last pipeline stage both hold (tied input/output embeddings)."""
    vocab_params: tuple[str, ...] = ()
    """Parameters indexed by token id (embeddings, output heads and their biases; the tied ones among
    them): the gradient noise scale leaves them out (see `launch.gradstats`)."""
