"""cona's GPT family: a plain decoder-only transformer (RMSNorm, RoPE, GELU MLP) and its `SPEC`.

The model knows nothing about parallelism; its TP plan and pipeline split are data for `parallelize()`.

Layers live in an `nn.ModuleDict` keyed by their global index, and the embedding, final norm and
output head may be set to `None`, so a pipeline stage keeps exactly the fully qualified names the
whole model has (`layers.3.attention.wq.weight` is the same key under every layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from cona_cli.config import ModelConfig
from launch.models.shape import gpt_shape
from launch.models.spec import IGNORE_INDEX, ModelSpec, next_token_batch


@dataclass(frozen=True)
class GPTArgs:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    seq_len: int
    vocab_size: int
    dropout: float = 0.0
    rope_theta: float = 10000.0


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [batch, seq, heads, head_dim]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: GPTArgs) -> None:
        super().__init__()
        self.head_dim = a.d_model // a.n_heads
        self.wq = nn.Linear(a.d_model, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.d_model, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.d_model, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.d_model, bias=False)
        self.dropout = a.dropout

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


class MLP(nn.Module):
    def __init__(self, a: GPTArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.d_model, a.ffn, bias=False)
        self.w2 = nn.Linear(a.ffn, a.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, a: GPTArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.d_model)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.d_model)
        self.feed_forward = MLP(a)
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.attention_norm(x), cos, sin))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    def __init__(self, a: GPTArgs) -> None:
        super().__init__()
        self.args = a
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(a.vocab_size, a.d_model)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(a.d_model)
        self.output: nn.Linear | None = nn.Linear(a.d_model, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.d_model // a.n_heads, a.seq_len, a.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        """GPT-2 style init, seeded, identical whatever the layout (call before parallelising)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if p.dim() == 1:
                nn.init.ones_(p)
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * self.args.n_layers)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] -> logits [b, t, vocab]; a pipeline stage maps hidden -> hidden as it holds."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy summed over real targets and divided by all target positions.

    Without padding this is the mean; with padding, loss * targets.numel() is the exact sum.
    """
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    return ce / targets.numel()


def build(m: ModelConfig, vocab_size: int) -> GPT:
    return GPT(GPTArgs(m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn, m.seq_len, vocab_size, m.dropout))


def split_for_stage(model: GPT, pp_rank: int, pp: int) -> None:
    """Keep only this pipeline stage's layers (global indices kept as keys); drop ends it does not hold."""
    per_stage = len(model.layers) // pp
    owned = set(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    if pp_rank != 0:
        model.tok_embeddings = None
    if pp_rank != pp - 1:
        model.norm = None
        model.output = None


def tp_plan(model: GPT) -> dict[str, ParallelStyle]:
    """Megatron-style TP: column-parallel q/k/v and w1, row-parallel wo and w2, vocab-parallel ends."""
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for i in model.layers:
        plan |= {
            f"layers.{i}.attention.wq": ColwiseParallel(),
            f"layers.{i}.attention.wk": ColwiseParallel(),
            f"layers.{i}.attention.wv": ColwiseParallel(),
            f"layers.{i}.attention.wo": RowwiseParallel(),
            f"layers.{i}.feed_forward.w1": ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(),
        }
    return plan


SPEC = ModelSpec(
    family="gpt",
    build=build,
    tp_plan=tp_plan,
    pipeline_split=split_for_stage,
    loss=loss_fn,
    batch=next_token_batch,
    shape=gpt_shape,
)
