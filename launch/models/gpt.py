"""The GPT-2/GPT-3 family: pre-LayerNorm with biases, learned absolute positions, GELU MLP, tied embeddings.

The model knows nothing about parallelism; its TP plan and pipeline split are data for `parallelize()`.
Layers live in an `nn.ModuleDict` keyed by their global index and end modules may be `None`, so a
pipeline stage keeps exactly the names the whole model has. The output head uses the token
embedding's weight (`TiedHead`); under pipelining the last stage keeps `tok_embeddings` for it (its
gradients are summed with the first stage's, see `ModelSpec.tied`). q, k and v are separate
projections (column-parallel under TP); the export concatenates them into GPT-2's `c_attn`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from cona_core.config import ModelConfig
from cona_core.shape import gpt_shape
from launch.models.common import (
    TiedHead,
    block_tp_plan,
    copy_values,
    keep_stage,
    lm_loss,
    normal_init_values,
    tied_head_style,
)
from launch.models.spec import HFExport, HFSource, ModelSpec, causal_lm_batch

NORM_EPS = 1e-5


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
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(m.d_model, m.ffn)
        self.w2 = nn.Linear(m.ffn, m.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # GPT-2's gelu_new


class Block(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(m.d_model, eps=NORM_EPS)
        self.attention = Attention(m)
        self.ffn_norm = nn.LayerNorm(m.d_model, eps=NORM_EPS)
        self.feed_forward = MLP(m)
        self.drop = nn.Dropout(m.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.attention_norm(x)))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    def __init__(self, m: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.n_layers = m.n_layers
        self.takes_tokens = True  # False on pipeline stages after the first
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, m.d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(m.seq_len, m.d_model)
        self.drop = nn.Dropout(m.dropout)
        self.layers = nn.ModuleDict({str(i): Block(m) for i in range(m.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(m.d_model, eps=NORM_EPS)
        self.output: TiedHead | None = TiedHead()

    def init_values(self, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        return normal_init_values(self, seed, self.n_layers, residual=("wo.weight", "w2.weight"))

    def init_weights(self, seed: int) -> None:
        copy_values(self, self.init_values(seed))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] -> logits [b, t, vocab]; a pipeline stage maps hidden -> hidden as it holds."""
        h = tokens
        if self.takes_tokens:
            h = self.drop(self.tok_embeddings(tokens) + self.pos_embeddings.weight[: tokens.shape[1]])
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None:
            return h
        return self.output(self.norm(h), self.tok_embeddings.weight)


def split_for_stage(model: GPT, pp_rank: int, pp: int) -> None:
    keep_stage(
        model, pp_rank, pp, first=("tok_embeddings", "pos_embeddings"), last=("norm", "output", "tok_embeddings")
    )


def tp_plan(model: GPT) -> dict[str, ParallelStyle]:
    """Megatron-style TP: column-parallel q/k/v and up, row-parallel wo and down, vocab-parallel embedding
    and the tied head on the same Shard(0) weight; position embeddings and norms replicated."""
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = tied_head_style()
    plan |= block_tp_plan(
        list(model.layers),
        colwise=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"),
        rowwise=("attention.wo", "feed_forward.w2"),
    )
    return plan


def hf_config(m: ModelConfig, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": m.seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": m.ffn,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": NORM_EPS,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def hf_tensors(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D layers hold [in, out] weights: ours are transposed, q/k/v concatenated."""
    out = {
        "transformer.wte.weight": sd["tok_embeddings.weight"],
        "transformer.wpe.weight": sd["pos_embeddings.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": sd["norm.bias"],
    }
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        qkv = [f"{ours}attention.{w}" for w in ("wq", "wk", "wv")]
        out |= {
            f"{hf}ln_1.weight": sd[f"{ours}attention_norm.weight"],
            f"{hf}ln_1.bias": sd[f"{ours}attention_norm.bias"],
            f"{hf}attn.c_attn.weight": torch.cat([sd[f"{n}.weight"] for n in qkv]).t().contiguous(),
            f"{hf}attn.c_attn.bias": torch.cat([sd[f"{n}.bias"] for n in qkv]),
            f"{hf}attn.c_proj.weight": sd[f"{ours}attention.wo.weight"].t().contiguous(),
            f"{hf}attn.c_proj.bias": sd[f"{ours}attention.wo.bias"],
            f"{hf}ln_2.weight": sd[f"{ours}ffn_norm.weight"],
            f"{hf}ln_2.bias": sd[f"{ours}ffn_norm.bias"],
            f"{hf}mlp.c_fc.weight": sd[f"{ours}feed_forward.w1.weight"].t().contiguous(),
            f"{hf}mlp.c_fc.bias": sd[f"{ours}feed_forward.w1.bias"],
            f"{hf}mlp.c_proj.weight": sd[f"{ours}feed_forward.w2.weight"].t().contiguous(),
            f"{hf}mlp.c_proj.bias": sd[f"{ours}feed_forward.w2.bias"],
        }
    return out


def _transposed(w: torch.Tensor) -> torch.Tensor:
    return w.t()


def _qkv_part(i: int, w: torch.Tensor) -> torch.Tensor:
    """q, k or v (i = 0, 1, 2) of GPT-2's fused c_attn: its Conv1D weight [in, 3 d_model] or its bias."""
    return (w.t() if w.dim() == 2 else w).chunk(3)[i]


def hf_sources(m: ModelConfig) -> dict[str, HFSource]:
    """The inverse of `hf_tensors`: Conv1D weights transposed back, c_attn split into q, k and v."""
    out: dict[str, HFSource] = {
        "tok_embeddings.weight": ("transformer.wte.weight", None),
        "pos_embeddings.weight": ("transformer.wpe.weight", None),
        "norm.weight": ("transformer.ln_f.weight", None),
        "norm.bias": ("transformer.ln_f.bias", None),
    }
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for j, w in enumerate(("wq", "wk", "wv")):
            for p in ("weight", "bias"):
                out[f"{ours}attention.{w}.{p}"] = (f"{hf}attn.c_attn.{p}", functools.partial(_qkv_part, j))
        for name, conv in (
            ("attention.wo", "attn.c_proj"),
            ("feed_forward.w1", "mlp.c_fc"),
            ("feed_forward.w2", "mlp.c_proj"),
        ):
            out[f"{ours}{name}.weight"] = (f"{hf}{conv}.weight", _transposed)
            out[f"{ours}{name}.bias"] = (f"{hf}{conv}.bias", None)
        for name, norm in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out |= {f"{ours}{name}.{p}": (f"{hf}{norm}.{p}", None) for p in ("weight", "bias")}
    return out


SPEC = ModelSpec(
    family="gpt",
    build=GPT,
    tp_plan=tp_plan,
    pipeline_split=split_for_stage,
    loss=lm_loss,
    batch=causal_lm_batch,
    shape=gpt_shape,
    hf=HFExport("GPT2LMHeadModel", hf_config, hf_tensors, hf_sources),
    tied=("tok_embeddings.weight",),
    vocab_params=("tok_embeddings.weight",),
)
