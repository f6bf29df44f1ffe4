"""Model families behind a small registry: `model.family` in the config picks one.

Importing this package does not import torch: `model_shape` serves the planner and `SPECIAL_TOKENS`
the corpus, `get_spec` imports the family's module (torch) for the engine. A new family is one module exporting `SPEC`
(see `launch.models.spec`) and one line in each table below.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from launch.models.shape import ModelShape, bert_shape, gpt_shape, llama_shape

if TYPE_CHECKING:
    from cona_cli.config import ModelConfig
    from launch.models.spec import ModelSpec

FAMILY_MODULES = {"gpt": "launch.models.gpt", "llama": "launch.models.llama", "bert": "launch.models.bert"}
SHAPES: dict[str, Callable[[ModelConfig, int], ModelShape]] = {
    "gpt": gpt_shape,
    "llama": llama_shape,
    "bert": bert_shape,
}
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "gpt": (),
    "llama": (),
    "bert": ("[PAD]", "[CLS]", "[SEP]", "[MASK]"),  # [MASK] last: id vocab_size - 1
}
"""Tokens each family's tokenizer adds after the corpus's own (the corpus cache key includes them): the
controller prepares the corpus with them, without importing torch."""


VOCAB_MULTIPLE = 128  # Megatron's make-vocab-size-divisible-by: tp 1, 2, 4, 8 (any power of two to 128) divide it


def padded_vocab(vocab: int) -> int:
    """The model's embedding rows for a tokenizer of `vocab` ids: rounded up to a multiple of 128, the same
    under every layout (so checkpoints move between strategies); the extra rows are never targets."""
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _padded(fn: Callable, m: ModelConfig, vocab: int) -> Any:
    return fn(m, padded_vocab(vocab))


@functools.cache
def get_spec(family: str) -> ModelSpec:
    """The engine's spec of a family (imports torch). Its `build`, `shape` and Hugging Face config take the
    tokenizer's vocabulary and pad it (`padded_vocab`); its `batch` keeps the tokenizer's ids."""
    if family not in FAMILY_MODULES:
        raise KeyError(f"model.family: unknown family {family!r} (known: {', '.join(FAMILY_MODULES)})")
    spec = importlib.import_module(FAMILY_MODULES[family]).SPEC
    hf = spec.hf and dataclasses.replace(spec.hf, config=functools.partial(_padded, spec.hf.config))
    return dataclasses.replace(
        spec, build=functools.partial(_padded, spec.build), shape=functools.partial(_padded, spec.shape), hf=hf
    )


def model_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """The planner's view of the configured model (torch-free), its vocabulary padded as the engine's."""
    return SHAPES[m.family](m, padded_vocab(vocab))
