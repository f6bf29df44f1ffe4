"""The BERT family: a post-LayerNorm encoder with learned positions and token types, GELU, and an MLM
head tied to the input embedding, trained with masked language modelling.

Masking (Devlin et al. 2019): 15% of the positions are targets; of those 80% read [MASK], 10% a
random corpus token, 10% the token itself. The draw is seeded by the sample's global index, so a
sample is masked the same under every layout and across switches. The loss is the sum over targets
divided by positions x 0.15 (`ModelSpec.target_fraction`): about the mean over masked tokens, and a
constant per position, so micro-batch splits sum to the same gradient; evaluation divides the exact
sum by the exact number of targets, so the perplexity is exp(mean loss over masked tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from cona_core.config import ModelConfig
from cona_core.shape import SPECIAL_TOKENS as FAMILY_TOKENS
from cona_core.shape import bert_shape
from launch.models.common import (
    TiedHead,
    block_tp_plan,
    copy_values,
    keep_stage,
    lm_loss,
    normal_init_values,
    tied_head_style,
)
from launch.models.spec import IGNORE_INDEX, Batch, BatchFn, HFExport, HFSource, ModelSpec

NORM_EPS = 1e-12
MASK_RATE = 0.15
SPECIAL_TOKENS = FAMILY_TOKENS["bert"]  # [MASK] last: id vocab_size - 1
TOKEN_TYPES = 2


class Attention(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.head_dim = m.d_model // m.n_heads
        self.wq = nn.Linear(m.d_model, m.d_model)
        self.wk = nn.Linear(m.d_model, m.d_model)
        self.wv = nn.Linear(m.d_model, m.d_model)
        self.wo = nn.Linear(m.d_model, m.d_model)
        self.dropout = m.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(m.d_model, m.ffn)
        self.w2 = nn.Linear(m.ffn, m.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Post-LN: each sublayer's residual sum is normalised."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(m)
        self.attention_norm = nn.LayerNorm(m.d_model, eps=NORM_EPS)
        self.feed_forward = MLP(m)
        self.ffn_norm = nn.LayerNorm(m.d_model, eps=NORM_EPS)
        self.drop = nn.Dropout(m.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.drop(self.attention(x)))
        return self.ffn_norm(x + self.drop(self.feed_forward(x)))


class MLMHead(nn.Module):
    """Dense, GELU, LayerNorm, then the tied decoder plus a per-token bias (added to gathered logits)."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model, eps=NORM_EPS)
        self.decoder = TiedHead()
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(h))), weight) + self.bias


class BERT(nn.Module):
    def __init__(self, m: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.n_layers = m.n_layers
        self.takes_tokens = True  # False on pipeline stages after the first
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, m.d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(m.seq_len, m.d_model)
        self.type_embeddings: nn.Embedding | None = nn.Embedding(TOKEN_TYPES, m.d_model)
        self.emb_norm: nn.LayerNorm | None = nn.LayerNorm(m.d_model, eps=NORM_EPS)
        self.drop = nn.Dropout(m.dropout)
        self.layers = nn.ModuleDict({str(i): Block(m) for i in range(m.n_layers)})
        self.head: MLMHead | None = MLMHead(m.d_model, vocab_size)

    def init_values(self, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        return normal_init_values(self, seed, self.n_layers, residual=())

    def init_weights(self, seed: int) -> None:
        copy_values(self, self.init_values(seed))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] (one segment: token type 0) -> MLM logits [b, t, vocab]; a pipeline stage maps
        hidden -> hidden as it holds."""
        h = tokens
        if self.takes_tokens:
            pos = self.pos_embeddings.weight[: tokens.shape[1]] + self.type_embeddings.weight[0]
            h = self.drop(self.emb_norm(self.tok_embeddings(tokens) + pos))
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h, self.tok_embeddings.weight) if self.head is not None else h


def mask_tokens(windows: torch.Tensor, sample_ids: torch.Tensor, vocab_size: int) -> Batch:
    """MLM inputs and targets from the first seq_len tokens of each window, drawn per global sample id."""
    tokens = windows[:, :-1]
    n_corpus = vocab_size - len(SPECIAL_TOKENS)  # random replacements are corpus tokens
    draws = []
    for i in sample_ids.tolist():
        rng = np.random.Generator(np.random.PCG64([int(i), 0x4D4C4D]))
        draws.append(
            (rng.random(tokens.shape[1]), rng.random(tokens.shape[1]), rng.integers(n_corpus, size=tokens.shape[1]))
        )
    select = torch.from_numpy(np.stack([d[0] for d in draws]) < MASK_RATE)
    how = torch.from_numpy(np.stack([d[1] for d in draws]))
    random_tokens = torch.from_numpy(np.stack([d[2] for d in draws]))
    inputs = torch.where(select & (how < 0.8), vocab_size - 1, tokens)
    inputs = torch.where(select & (how >= 0.8) & (how < 0.9), random_tokens, inputs)
    return inputs, torch.where(select, tokens, IGNORE_INDEX)


def mlm_batch(vocab_size: int) -> BatchFn:
    return functools.partial(mask_tokens, vocab_size=vocab_size)


def split_for_stage(model: BERT, pp_rank: int, pp: int) -> None:
    first = ("tok_embeddings", "pos_embeddings", "type_embeddings", "emb_norm")
    keep_stage(model, pp_rank, pp, first=first, last=("head", "tok_embeddings"))


def tp_plan(model: BERT) -> dict[str, ParallelStyle]:
    """Megatron-style TP: column-parallel q/k/v and up, row-parallel wo and down, vocab-parallel embedding
    and tied decoder on the same Shard(0) weight; positions, types, norms and the MLM transform replicated."""
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.head is not None:
        plan["head.decoder"] = tied_head_style()
    plan |= block_tp_plan(
        list(model.layers),
        colwise=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"),
        rowwise=("attention.wo", "feed_forward.w2"),
    )
    return plan


def hf_config(m: ModelConfig, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "intermediate_size": m.ffn,
        "hidden_act": "gelu",
        "max_position_embeddings": m.seq_len,
        "type_vocab_size": TOKEN_TYPES,
        "layer_norm_eps": NORM_EPS,
        "hidden_dropout_prob": m.dropout,
        "attention_probs_dropout_prob": m.dropout,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


_LAYER_NAMES = {
    "attention.wq": "attention.self.query",
    "attention.wk": "attention.self.key",
    "attention.wv": "attention.self.value",
    "attention.wo": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "feed_forward.w1": "intermediate.dense",
    "feed_forward.w2": "output.dense",
    "ffn_norm": "output.LayerNorm",
}


_END_NAMES = {
    "tok_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "pos_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "emb_norm.weight": "bert.embeddings.LayerNorm.weight",
    "emb_norm.bias": "bert.embeddings.LayerNorm.bias",
    "head.dense.weight": "cls.predictions.transform.dense.weight",
    "head.dense.bias": "cls.predictions.transform.dense.bias",
    "head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "head.bias": "cls.predictions.bias",
}


def hf_tensors(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    out = {hf: sd[ours] for ours, hf in _END_NAMES.items()}
    for i in range(m.n_layers):
        for ours, hf in _LAYER_NAMES.items():
            for p in ("weight", "bias"):
                out[f"bert.encoder.layer.{i}.{hf}.{p}"] = sd[f"layers.{i}.{ours}.{p}"]
    return out


def hf_sources(m: ModelConfig) -> dict[str, HFSource]:
    """The inverse of `hf_tensors` (names only)."""
    out: dict[str, HFSource] = {ours: (hf, None) for ours, hf in _END_NAMES.items()}
    for i in range(m.n_layers):
        for ours, hf in _LAYER_NAMES.items():
            out |= {f"layers.{i}.{ours}.{p}": (f"bert.encoder.layer.{i}.{hf}.{p}", None) for p in ("weight", "bias")}
    return out


SPEC = ModelSpec(
    family="bert",
    build=BERT,
    tp_plan=tp_plan,
    pipeline_split=split_for_stage,
    loss=functools.partial(lm_loss, target_fraction=MASK_RATE),
    batch=mlm_batch,
    shape=bert_shape,
    hf=HFExport("BertForMaskedLM", hf_config, hf_tensors, hf_sources),
    target_fraction=MASK_RATE,
    tied=("tok_embeddings.weight",),
    vocab_params=("tok_embeddings.weight", "head.bias"),
)
