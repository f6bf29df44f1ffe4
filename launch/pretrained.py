"""`model.init_from`: a pretrained model's weights as the first launch's values, under any layout.

`pretrained_values` stands in for a family's seeded init (`launch.materialise`): the whole model's
parameters by name, each value read from the folder when it is taken (one whole tensor at a time), of
which each rank keeps its own slice. A Hugging Face folder's tensors are found through the family's
`HFExport.sources` (the inverse of what `cona export` writes); a `cona export --format torch` folder's
`model.pt` is in cona's names already. Everything the run needs is checked before a value is read, so a
folder that does not fit fails at once, naming the tensor (`check_pretrained` runs the same check before
launch). Fitting a tensor to its parameter: vocabulary-indexed rows (`ModelSpec.vocab_params`) are cut to,
or padded with their mean row up to, the model's padded vocabulary, as long as every token id of the
tokenizer has a row; position embeddings are cut to `seq_len`; any other shape must match.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cona_core.config import ModelConfig
from cona_core.pretrained import CONA_CONFIG, HF_CONFIG
from launch.models import get_spec
from launch.models.spec import HFSource, ModelSpec

POSITIONS = "pos_embeddings.weight"  # learned positions (gpt, bert): a longer table is cut to seq_len
# Other spellings of a Hugging Face name: without the head class's prefix (a base model's checkpoint, GPT-2's
# original files), LayerNorm's legacy gamma/beta, and a tied head stored once as the embedding.
PREFIXES = ("transformer.", "model.", "bert.")
LEGACY = {".weight": ".gamma", ".bias": ".beta"}
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


class PretrainedError(ValueError):
    """A model folder whose weights do not fit the configured model; the message is one line."""


class TensorFile:
    """A folder's weights by name, read lazily: model.safetensors (or its shards), pytorch_model.bin or model.pt."""

    def __init__(self, folder: Path) -> None:
        self.files: dict[str, Path] = {}  # tensor name -> file
        self.opened: dict[Path, Any] = {}  # a safetensors reader, or a state dict (mmapped)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
            return
        for name in ("model.safetensors", "pytorch_model.bin", "model.pt"):
            if (folder / name).is_file():
                names = self._open(folder / name).keys()
                self.files = {key: folder / name for key in names}
                return
        raise PretrainedError(f"model.init_from: {folder}: no model.safetensors, pytorch_model.bin or model.pt")

    def _open(self, path: Path) -> Any:
        if path not in self.opened:
            if path.suffix == ".safetensors":
                try:
                    from safetensors import safe_open
                except ImportError:
                    need = f"model.init_from: {path.name} needs safetensors (pip install 'cona[hf]')"
                    raise PretrainedError(need) from None
                self.opened[path] = safe_open(str(path), framework="pt")
            else:
                self.opened[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self.opened[path]

    def find(self, name: str) -> str | None:
        """The name the folder holds `name` under (its own, or another spelling), None if none."""
        bare = next((name.removeprefix(p) for p in PREFIXES if name.startswith(p)), name)
        spellings = [name, bare] + [
            n.removesuffix(s) + old for n in (name, bare) for s, old in LEGACY.items() if n.endswith(s)
        ]
        found = next((s for s in spellings if s in self.files), None)
        return found if found is not None or name not in TIED else self.find(TIED[name])

    def shape(self, name: str) -> torch.Size:
        f = self._open(self.files[name])
        return f[name].shape if isinstance(f, dict) else torch.Size(f.get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        f = self._open(self.files[name])
        return (f[name] if isinstance(f, dict) else f.get_tensor(name)).float()


def sources(spec: ModelSpec, m: ModelConfig, folder: Path) -> dict[str, HFSource]:
    """Each parameter's tensor in the folder: the family's Hugging Face names, or cona's own (`cona.json`)."""
    if (folder / CONA_CONFIG).is_file() and not (folder / HF_CONFIG).is_file():
        return {}
    if spec.hf is None:
        raise PretrainedError(f"model.init_from: model.family {spec.family} has no Hugging Face mapping")
    return spec.hf.sources(m)


def fit(name: str, value: torch.Tensor, shape: torch.Size, spec: ModelSpec, vocab: int) -> torch.Tensor:
    """`value` (whole, its source's shape) as parameter `name` of `shape` (module docstring); PretrainedError."""
    if value.shape == shape:
        return value
    rows, rest = value.shape[0], value.shape[1:]
    if rest == shape[1:] and name in spec.vocab_params and rows >= vocab:
        if rows >= shape[0]:
            return value[: shape[0]]
        return torch.cat([value, value.mean(0, keepdim=True).expand(shape[0] - rows, *rest)])
    if rest == shape[1:] and name == POSITIONS and rows >= shape[0]:
        return value[: shape[0]]
    if name in spec.vocab_params and rows < vocab:
        raise PretrainedError(
            f"model.init_from: {name} has rows for {rows} token ids, the tokenizer has {vocab}; "
            "use the model's tokenizer (leave data.tokenizer out)"
        )
    raise PretrainedError(f"model.init_from: {name}: shape {tuple(value.shape)} does not fit {tuple(shape)}")


def pretrained_values(
    folder: str, spec: ModelSpec, m: ModelConfig, vocab: int, model: nn.Module
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole value) of every parameter `model` (the whole model, on meta) holds now, read from
    `folder` as they are taken; PretrainedError (at once) when one is missing or does not fit."""
    path = Path(folder).expanduser()
    tensors = TensorFile(path)
    where = sources(spec, m, path)
    plan = []
    for name, p in sorted(model.named_parameters()):
        source, how = where.get(name, (name, None))
        held = tensors.find(source)
        if held is None:
            raise PretrainedError(f"model.init_from: {folder} has no tensor {source} (for {name})")
        meta = torch.empty(tensors.shape(held), device="meta")
        fit(name, how(meta) if how else meta, p.shape, spec, vocab)  # raises before anything is read
        plan.append((name, held, how, p.shape))

    def values() -> Iterator[tuple[str, torch.Tensor]]:
        for name, held, how, shape in plan:
            value = tensors.read(held)
            yield name, fit(name, how(value) if how else value, shape, spec, vocab).contiguous()

    return values()


def check_pretrained(m: ModelConfig, vocab: int) -> None:
    """Before launch: `m.init_from`'s folder holds every parameter of the model, in a shape that fits a
    tokenizer of `vocab` ids; PretrainedError (one line) otherwise. Reads no weights."""
    spec = get_spec(m.family)
    with torch.device("meta"):
        model = spec.build(m, vocab)
    pretrained_values(m.init_from, spec, m, vocab, model)
