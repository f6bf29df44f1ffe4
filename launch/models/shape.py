"""What the planner's cost and memory models read of a model: sizes and counts, no torch.

Every function takes plain numbers or numpy arrays (micro-batch sizes) and works on either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cona_cli.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """A transformer's dimensions and the parts that differ between families."""

    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    vocab: int
    mlp_matrices: int = 2  # GELU MLP: up and down; SwiGLU: gate, up and down
    norms_per_layer: int = 2
    params_per_norm_channel: int = 1  # RMSNorm: weight; LayerNorm: weight and bias
    tied_embeddings: bool = False  # the output head reuses the input embedding

    @property
    def attention_matrix_params(self) -> int:
        """q, k, v (k and v at kv_heads) and the output projection."""
        h = self.d_model
        return h * (h + 2 * h * self.kv_heads // self.n_heads) + h * h

    @property
    def layer_params(self) -> int:
        mlp = self.mlp_matrices * self.d_model * self.ffn
        norms = self.norms_per_layer * self.params_per_norm_channel * self.d_model
        return self.attention_matrix_params + mlp + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model

    @property
    def head_params(self) -> int:
        """The output projection as a separate tensor (0 when tied) plus the final norm."""
        final_norm = self.params_per_norm_channel * self.d_model
        return (0 if self.tied_embeddings else self.vocab * self.d_model) + final_norm

    @property
    def total_params(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.head_params

    def layer_fwd_flops(self, mbs: Any) -> Any:
        """Forward FLOPs of one layer for a micro-batch of `mbs` sequences (all of tp)."""
        tokens = mbs * self.seq_len
        gemm = 2 * tokens * (self.attention_matrix_params + self.mlp_matrices * self.d_model * self.ffn)
        attention = 4 * tokens * self.seq_len * self.d_model  # QK^T and AV, causal mask not discounted
        return gemm + attention

    def head_fwd_flops(self, mbs: Any) -> Any:
        """Forward FLOPs of the output projection to the vocabulary."""
        return 2 * mbs * self.seq_len * self.d_model * self.vocab


def gpt_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """cona's GPT: RMSNorm (weight only), GELU MLP, untied output head."""
    return ModelShape(m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn, m.seq_len, vocab)
