"""`model.init_from: PATH`: what a pretrained model folder says about the model, read without torch.

Two kinds of folder: a Hugging Face model folder (`config.json` in transformers' format, weights in
`model.safetensors`, sharded safetensors or `pytorch_model.bin`) of a GPT-2, Llama or BERT model, and a
`cona export --format torch` folder (`cona.json`, `model.pt`). Its config gives the family and the shape
fields (`HF_FIELDS` maps transformers' names onto the config's); `resolve` fills in those the cona config
leaves out and refuses those it states differently. Its tokenizer (`tokenizer.json`) becomes
`data.tokenizer` unless the config names one. The weights are read by the workers (`launch.pretrained`),
and checked against the prepared corpus's vocabulary before launch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HF_CONFIG = "config.json"
CONA_CONFIG = "cona.json"  # `cona export --format torch`
TOKENIZER = "tokenizer.json"

# transformers' model_type -> (family, {model field: its key in config.json})
HF_FIELDS: dict[str, tuple[str, dict[str, str]]] = {
    "gpt2": (
        "gpt",
        {"n_layers": "n_layer", "d_model": "n_embd", "n_heads": "n_head", "ffn": "n_inner", "seq_len": "n_positions"},
    ),
    "llama": (
        "llama",
        {
            "n_layers": "num_hidden_layers",
            "d_model": "hidden_size",
            "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads",
            "ffn": "intermediate_size",
            "seq_len": "max_position_embeddings",
            "rope_theta": "rope_theta",
        },
    ),
    "bert": (
        "bert",
        {
            "n_layers": "num_hidden_layers",
            "d_model": "hidden_size",
            "n_heads": "num_attention_heads",
            "ffn": "intermediate_size",
            "seq_len": "max_position_embeddings",
        },
    ),
}
# config.json values the families do not implement (absent means transformers' default, which they do)
UNSUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "gpt2": {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "tie_word_embeddings": (True,)},
    "llama": {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "rope_scaling": (None,)},
    "bert": {"hidden_act": ("gelu",), "position_embedding_type": ("absolute",)},
}
CONA_SHAPE = ("family", "n_layers", "d_model", "n_heads", "ffn", "seq_len", "n_kv_heads", "rope_theta")  # cona.json's
HF_ROPE_THETA = 10000.0  # transformers' Llama default when config.json gives none


@dataclass(frozen=True)
class Pretrained:
    """A model folder's family, shape fields (the config's names) and tokenizer."""

    family: str
    fields: dict[str, Any]
    source: dict[str, str]  # model field -> where the folder gives it (for messages), e.g. config.json n_layer
    tokenizer: str | None


def read_folder(folder: str) -> Pretrained:
    """The folder's model; ValueError (one line) when it is none of the two kinds or is not supported."""
    path = Path(folder).expanduser()
    tokenizer = str(Path(folder) / TOKENIZER) if (path / TOKENIZER).is_file() else None
    if (path / HF_CONFIG).is_file():
        return _from_hf(_json(path / HF_CONFIG), tokenizer)
    if (path / CONA_CONFIG).is_file():
        meta = _json(path / CONA_CONFIG)
        model = {k: v for k, v in meta["model"].items() if k in CONA_SHAPE}
        return Pretrained(meta["family"], model, {k: f"{CONA_CONFIG} model.{k}" for k in model}, tokenizer)
    raise ValueError(f"{folder}: no {HF_CONFIG} (Hugging Face) or {CONA_CONFIG} (cona export) in it")


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None


def _from_hf(config: dict[str, Any], tokenizer: str | None) -> Pretrained:
    kind = config.get("model_type")
    if kind not in HF_FIELDS:
        raise ValueError(f"{HF_CONFIG}: model_type {kind!r} is not one cona builds (known: {', '.join(HF_FIELDS)})")
    for key, allowed in UNSUPPORTED[kind].items():
        if config.get(key, allowed[0]) not in allowed:
            raise ValueError(f"{HF_CONFIG}: {key} {config[key]!r} is not supported for {kind} (only {allowed[0]!r})")
    family, names = HF_FIELDS[kind]
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{HF_CONFIG}: rope_parameters.rope_type {rope['rope_type']!r} is not supported")
    values = {**config, "rope_theta": config.get("rope_theta", rope.get("rope_theta", HF_ROPE_THETA))}
    if kind == "gpt2" and values.get("n_inner") is None:  # GPT-2's default MLP: 4 x n_embd
        values["n_inner"] = 4 * values["n_embd"]
    fields = {ours: values[theirs] for ours, theirs in names.items() if values.get(theirs) is not None}
    source = {ours: f"{HF_CONFIG} {names[ours]}" for ours in fields}
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * fields["n_heads"] != fields["d_model"]:
        raise ValueError(f"{HF_CONFIG}: head_dim {head_dim} is not hidden_size / num_attention_heads")
    return Pretrained(family, fields, {**source, "family": f"{HF_CONFIG} model_type"}, tokenizer)


def resolve(raw: dict[str, Any]) -> dict[str, Any]:
    """The config document `raw` with `model.init_from`'s shape fields and tokenizer filled in. ValueError
    naming the field when the config states one differently (`seq_len` may be shorter: a context the
    model was trained past)."""
    model, data = raw["model"], raw.get("data") or {}
    try:
        found = read_folder(model["init_from"])
    except ValueError as e:
        raise ValueError(f"model.init_from: {e}") from None
    given = {"family": found.family, **found.fields}
    for key, theirs in given.items():
        ours = model.get(key)
        if ours is None or ours == theirs or (key == "seq_len" and isinstance(ours, int) and ours <= theirs):
            continue
        raise ValueError(f"model.{key}: {ours} differs from model.init_from's {found.source[key]} {theirs}")
    if found.tokenizer is not None and isinstance(data, dict) and "tokenizer" not in data:
        data = {**data, "tokenizer": found.tokenizer}
    return {**raw, "model": {**given, **{k: v for k, v in model.items() if v is not None}}, "data": data}
