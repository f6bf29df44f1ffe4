"""Model families behind a small registry: `model.family` in the config picks one.

`get_spec` imports the family's module (torch) for the engine; what the planner and the corpus need of a
family without torch (its shape, special tokens, padded vocabulary) is `cona_core.shape`. A new family is
one module exporting `SPEC` (see `launch.models.spec`), one line in `FAMILY_MODULES` and one in each
table of `cona_core.shape`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cona_core.shape import padded_vocab

if TYPE_CHECKING:
    from cona_core.config import ModelConfig
    from launch.models.spec import ModelSpec

FAMILY_MODULES = {"gpt": "launch.models.gpt", "llama": "launch.models.llama", "bert": "launch.models.bert"}


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
