"""Model families behind a small registry: `model.family` in the config picks one.

Importing this package does not import torch: `model_shape` serves the planner, `get_spec`
imports the family's module (torch) for the engine. A new family is one module exporting `SPEC`
(see `launch.models.spec`) and one line in each table below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

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


def get_spec(family: str) -> ModelSpec:
    """The engine's spec of a family (imports torch)."""
    if family not in FAMILY_MODULES:
        raise KeyError(f"model.family: unknown family {family!r} (known: {', '.join(FAMILY_MODULES)})")
    return importlib.import_module(FAMILY_MODULES[family]).SPEC


def model_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """The planner's view of the configured model (torch-free)."""
    return SHAPES[m.family](m, vocab)
