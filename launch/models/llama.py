"""The Llama 3 family: RMSNorm, RoPE (configurable theta), SwiGLU MLP, grouped-query attention, untied head.

The model knows nothing about parallelism; its TP plan and pipeline split are data for `parallelize()`.
Layers live in an `nn.ModuleDict` keyed by their global index, and the embedding, final norm and
output head may be `None`, so a pipeline stage keeps exactly the names the whole model has. RoPE
rotates the two halves of each head (Hugging Face's `rotate_half`), so the export maps names only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from cona_core.config import ModelConfig
from cona_core.shape import llama_shape
from launch.models.common import block_tp_plan, copy_values, keep_stage, lm_loss, normal_init_values
from launch.models.spec import HFExport, HFSource, ModelSpec, causal_lm_batch

NORM_EPS = 1e-5


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim] of the rotation angles, each frequency used for both halves."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim]: channel i pairs with channel i + head_dim / 2."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)  # fp32 tables: keep bf16 q, k in bf16


class Attention(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.head_dim = m.d_model // m.n_heads
        self.wq = nn.Linear(m.d_model, m.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(m.d_model, m.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(m.d_model, m.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(m.n_heads * self.head_dim, m.d_model, bias=False)
        self.dropout = m.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = apply_rope(self.wq(x).view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            enable_gqa=k.shape[1] != q.shape[1],
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(m.d_model, m.ffn, bias=False)  # gate
        self.w3 = nn.Linear(m.d_model, m.ffn, bias=False)  # up
        self.w2 = nn.Linear(m.ffn, m.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(m.d_model, eps=NORM_EPS)
        self.attention = Attention(m)
        self.ffn_norm = nn.RMSNorm(m.d_model, eps=NORM_EPS)
        self.feed_forward = SwiGLU(m)
        self.drop = nn.Dropout(m.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.attention_norm(x), cos, sin))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    def __init__(self, m: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.n_layers = m.n_layers
        self.takes_tokens = True  # False on pipeline stages after the first
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, m.d_model)
        self.layers = nn.ModuleDict({str(i): Block(m) for i in range(m.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(m.d_model, eps=NORM_EPS)
        self.output: nn.Linear | None = nn.Linear(m.d_model, vocab_size, bias=False)
        cos, sin = rope_tables(m.d_model // m.n_heads, m.seq_len, m.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_values(self, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        return normal_init_values(self, seed, self.n_layers, residual=("wo.weight", "w2.weight"))

    def init_weights(self, seed: int) -> None:
        copy_values(self, self.init_values(seed))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] -> logits [b, t, vocab]; a pipeline stage maps hidden -> hidden as it holds."""
        h = self.tok_embeddings(tokens) if self.takes_tokens else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def split_for_stage(model: Llama, pp_rank: int, pp: int) -> None:
    keep_stage(model, pp_rank, pp, first=("tok_embeddings",), last=("norm", "output"))


def tp_plan(model: Llama) -> dict[str, ParallelStyle]:
    """Megatron-style TP: column-parallel q/k/v, gate and up; row-parallel wo and down; vocab-parallel ends."""
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    plan |= block_tp_plan(
        list(model.layers),
        colwise=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
        rowwise=("attention.wo", "feed_forward.w2"),
    )
    return plan


def hf_config(m: ModelConfig, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.d_model // m.n_heads,
        "max_position_embeddings": m.seq_len,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": NORM_EPS,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


_END_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensors(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    out = {hf: sd[ours] for ours, hf in _END_NAMES.items()}
    for i in range(m.n_layers):
        out |= {f"model.layers.{i}.{hf}": sd[f"layers.{i}.{ours}"] for ours, hf in _LAYER_NAMES.items()}
    return out


def hf_sources(m: ModelConfig) -> dict[str, HFSource]:
    """The inverse of `hf_tensors` (names only)."""
    out: dict[str, HFSource] = {ours: (hf, None) for ours, hf in _END_NAMES.items()}
    for i in range(m.n_layers):
        out |= {f"layers.{i}.{ours}": (f"model.layers.{i}.{hf}", None) for ours, hf in _LAYER_NAMES.items()}
    return out


SPEC = ModelSpec(
    family="llama",
    build=Llama,
    tp_plan=tp_plan,
    pipeline_split=split_for_stage,
    loss=lm_loss,
    batch=causal_lm_batch,
    shape=llama_shape,
    hf=HFExport("LlamaForCausalLM", hf_config, hf_tensors, hf_sources),
    vocab_params=("tok_embeddings.weight", "output.weight"),
)
