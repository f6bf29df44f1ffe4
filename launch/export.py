"""Consolidate a DCP checkpoint of any layout into one state dict and write it out (`cona export`).

Runs in one process without a process group: the model is built on the meta device, given empty CPU
storage, and DCP reads every shard of every rank into its full tensors. Two formats:

- `torch`: `model.pt` (the state dict in cona's parameter names) and `cona.json` (family, model
  config, vocabulary, step), enough to rebuild the model with `launch.models.get_spec`;
- `hf`: a Hugging Face model folder (`config.json`, `model.safetensors`) through the family's
  `HFExport` mapping.

Both get the run's tokenizer, the one the corpus was tokenized with: `tokenizer.json` from the corpus
cache (the trained BPE, the byte-level one, or the `data.tokenizer` PATH's; an equivalent byte-level
one for a synthetic `tokenizer: byte` corpus) and `tokenizer_config.json` (a tokenizer folder's own,
else one naming its special tokens). Pre-tokenized data without `data.tokenizer` has none to write.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from cona_core.config import ModelConfig
from cona_core.shape import SPECIAL_TOKENS
from launch.data.tokenize import byte_tokenizer
from launch.models import get_spec
from launch.models.spec import HFExport

# Special tokens by their conventional text -> the transformers roles they take.
SPECIAL_ROLES = {
    "<|endoftext|>": ("bos_token", "eos_token"),
    "<|begin_of_text|>": ("bos_token",),
    "<|end_of_text|>": ("eos_token",),
    "<s>": ("bos_token",),
    "</s>": ("eos_token",),
    "[PAD]": ("pad_token",),
    "<pad>": ("pad_token",),
    "[UNK]": ("unk_token",),
    "<unk>": ("unk_token",),
    "[CLS]": ("cls_token",),
    "[SEP]": ("sep_token",),
    "[MASK]": ("mask_token",),
    "<mask>": ("mask_token",),
}


class ExportError(ValueError):
    """A run that cannot be exported as asked; the message is one line."""


def consolidated_state(ckpt: Path, m: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """The full model of checkpoint folder `ckpt` as one state dict in cona's names (no `model.` prefix)."""
    with torch.device("meta"):
        model = get_spec(m.family).build(m, vocab_size)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state["model"]


def write_tokenizer(
    tokenizer_path: str | None, special_tokens: tuple[str, ...], seq_len: int, out: Path, pretokenized: bool = False
) -> dict[str, int]:
    """tokenizer.json (copied, or the byte-level one when `tokenizer_path` is None) and
    tokenizer_config.json; returns the ids of its special tokens by role (`bos_token_id`, ...).
    `pretokenized` without a tokenizer: writes nothing."""
    if tokenizer_path is None and pretokenized:
        return {}
    if tokenizer_path is None:
        byte_tokenizer(special_tokens).save(str(out / "tokenizer.json"))
    else:
        if not Path(tokenizer_path).is_file():
            raise ExportError(f"{tokenizer_path}: the run's tokenizer is missing (corpus cache removed?)")
        shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    added = json.loads((out / "tokenizer.json").read_text()).get("added_tokens") or []
    by_text = {t["content"]: t["id"] for t in added}
    own = Path(tokenizer_path).with_name("tokenizer_config.json") if tokenizer_path else None
    if own is not None and own.is_file():  # a tokenizer folder's own roles (data.tokenizer: FOLDER)
        config = json.loads(own.read_text())
        roles = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        config.pop("auto_map", None)
        config.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=seq_len)
    else:
        roles = {}
        for token in added:
            for role in SPECIAL_ROLES.get(token["content"], ()) if token.get("special") else ():
                roles[role] = token["content"]
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len, **roles}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {f"{role}_id": by_text[text] for role, text in roles.items() if text in by_text}


def write_torch(state: dict[str, torch.Tensor], m: ModelConfig, vocab_size: int, step: int, out: Path) -> None:
    """model.pt (the state dict) and cona.json (what builds the model it fits)."""
    torch.save(state, out / "model.pt")
    meta = {"family": m.family, "model": dataclasses.asdict(m), "vocab_size": vocab_size, "step": step}
    (out / "cona.json").write_text(json.dumps(meta, indent=2) + "\n")


def hf_mapping(family: str) -> HFExport:
    """The family's Hugging Face mapping; ExportError if it has none or safetensors is not installed."""
    hf = get_spec(family).hf
    if hf is None:
        raise ExportError(f"model.family {family}: no Hugging Face mapping (use --format torch)")
    if importlib.util.find_spec("safetensors") is None:
        raise ExportError("--format hf needs the safetensors package (pip install safetensors)")
    return hf


def write_hf(
    hf: HFExport, state: dict[str, torch.Tensor], m: ModelConfig, vocab_size: int, token_ids: dict[str, int], out: Path
) -> None:
    """config.json (with the tokenizer's bos/eos/pad ids) and model.safetensors through the mapping."""
    from safetensors.torch import save_file

    # Own, contiguous storage per tensor: safetensors refuses tensors that share memory (tied weights).
    tensors = {k: v.detach().clone().contiguous() for k, v in hf.tensors(state, m).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = {k: v for k, v in token_ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config: dict[str, Any] = {**hf.config(m, vocab_size), "architectures": [hf.architecture], **ids}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def export(
    ckpt: Path,
    m: ModelConfig,
    vocab_size: int,
    tokenizer_path: str | None,
    step: int,
    fmt: str,
    out: Path,
    pretokenized: bool = False,
) -> None:
    """Write checkpoint `ckpt` in format `fmt` (hf or torch) into the existing empty folder `out`.
    `vocab_size` is the tokenizer's; the model's embedding holds `padded_vocab(vocab_size)` rows."""
    hf = hf_mapping(m.family) if fmt == "hf" else None
    state = consolidated_state(ckpt, m, vocab_size)
    token_ids = write_tokenizer(tokenizer_path, SPECIAL_TOKENS[m.family], m.seq_len, out, pretokenized)
    if hf is not None:
        write_hf(hf, state, m, vocab_size, token_ids, out)
    else:
        write_torch(state, m, vocab_size, step, out)
