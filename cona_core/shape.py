"""What both sides know of a model family without torch: the shape the planner's cost and memory models
read (sizes and counts), the vocabulary padding and the special tokens the family's tokenizer adds.
`launch.models` builds the modules (torch); its specs' `shape` is the same `ModelShape`.

Every function takes plain numbers or numpy arrays (micro-batch sizes) and works on either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cona_core.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """A transformer's dimensions and the parts that differ between families.

    Attention FLOPs count the whole score matrix: exact for BERT's bidirectional attention, and for
    causal attention the mask is not discounted (the CPU kernels the cost model was fitted on compute
    it whole)."""

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
    linear_biases: bool = False  # every projection has a bias (GPT-2, BERT)
    position_rows: int = 0  # learned position (and token type) embedding rows
    embedding_norm: bool = False  # a norm after the embeddings (BERT)
    final_norm: bool = True  # a norm before the head (pre-LN models)
    mlm_head: bool = False  # BERT's MLM transform (dense, GELU, LayerNorm) and output bias

    @property
    def attention_matrix_params(self) -> int:
        """q, k, v (k and v at kv_heads) and the output projection."""
        h = self.d_model
        return h * (h + 2 * h * self.kv_heads // self.n_heads) + h * h

    @property
    def norm_params(self) -> int:
        return self.params_per_norm_channel * self.d_model

    @property
    def layer_params(self) -> int:
        mlp = self.mlp_matrices * self.d_model * self.ffn
        norms = self.norms_per_layer * self.norm_params
        biases = 0
        if self.linear_biases:  # one per output channel: q, k, v, o; the MLP's up (and gate) and down
            biases = 2 * self.d_model + 2 * self.d_model * self.kv_heads // self.n_heads
            biases += (self.mlp_matrices - 1) * self.ffn + self.d_model
        return self.attention_matrix_params + mlp + norms + biases

    @property
    def embedding_params(self) -> int:
        """What the first stage holds besides layers: token and position embeddings, their norm."""
        return (self.vocab + self.position_rows) * self.d_model + (self.norm_params if self.embedding_norm else 0)

    @property
    def head_params(self) -> int:
        """What only the last stage holds: the final norm, an MLM transform, the output matrix if untied."""
        final_norm = self.norm_params if self.final_norm else 0
        mlm = self.d_model * self.d_model + self.d_model + self.norm_params + self.vocab if self.mlm_head else 0
        return (0 if self.tied_embeddings else self.vocab * self.d_model) + final_norm + mlm

    @property
    def tied_copy_params(self) -> int:
        """The last stage's copy of a tied embedding under pipeline parallelism."""
        return self.vocab * self.d_model if self.tied_embeddings else 0

    @property
    def largest_param(self) -> int:
        """The largest single parameter: the embedding (or output) matrix, an MLP or attention matrix, or the
        position rows, each d_model wide."""
        return max(self.vocab, self.ffn, self.d_model, self.position_rows) * self.d_model

    @property
    def total_params(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.head_params

    def layer_fwd_flops(self, mbs: Any) -> Any:
        """Forward FLOPs of one layer for a micro-batch of `mbs` sequences (all of tp)."""
        tokens = mbs * self.seq_len
        gemm = 2 * tokens * (self.attention_matrix_params + self.mlp_matrices * self.d_model * self.ffn)
        attention = 4 * tokens * self.seq_len * self.d_model  # QK^T and AV over the whole score matrix
        return gemm + attention

    def head_fwd_flops(self, mbs: Any) -> Any:
        """Forward FLOPs of the output projection to the vocabulary (and an MLM transform before it)."""
        transform = self.d_model if self.mlm_head else 0
        return 2 * mbs * self.seq_len * self.d_model * (self.vocab + transform)


def gpt_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """GPT-2/GPT-3: LayerNorm with biases, biased projections, learned positions, tied embeddings."""
    return ModelShape(
        m.n_layers,
        m.d_model,
        m.n_heads,
        m.kv_heads,
        m.ffn,
        m.seq_len,
        vocab,
        params_per_norm_channel=2,
        tied_embeddings=True,
        linear_biases=True,
        position_rows=m.seq_len,
    )


def llama_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """Llama 3: RMSNorm (weight only), SwiGLU's three matrices, grouped-query K/V, untied head."""
    return ModelShape(m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn, m.seq_len, vocab, mlp_matrices=3)


def bert_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """BERT: post-LayerNorm (no final norm), biases, positions and two token types, MLM head tied."""
    return ModelShape(
        m.n_layers,
        m.d_model,
        m.n_heads,
        m.kv_heads,
        m.ffn,
        m.seq_len,
        vocab,
        params_per_norm_channel=2,
        tied_embeddings=True,
        linear_biases=True,
        position_rows=m.seq_len + 2,
        embedding_norm=True,
        final_norm=False,
        mlm_head=True,
    )


SHAPES: dict[str, Callable[[ModelConfig, int], ModelShape]] = {
    "gpt": gpt_shape,
    "llama": llama_shape,
    "bert": bert_shape,
}
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "gpt": (),
    "llama": (),
    "bert": ("[PAD]", "[CLS]", "[SEP]", "[MASK]"),  # [MASK] last: id vocab_size - 1
}
"""Tokens each family's tokenizer adds after the corpus's own (the corpus cache key includes them): the
controller prepares the corpus with them, without importing torch."""

VOCAB_MULTIPLE = 128  # Megatron's make-vocab-size-divisible-by: tp 1, 2, 4, 8 (any power of two to 128) divide it


def padded_vocab(vocab: int) -> int:
    """The model's embedding rows for a tokenizer of `vocab` ids: rounded up to a multiple of 128, the same
    under every layout (so checkpoints move between strategies); the extra rows are never targets."""
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_shape(m: ModelConfig, vocab: int) -> ModelShape:
    """The planner's view of the configured model, its vocabulary padded as the engine's."""
    return SHAPES[m.family](m, padded_vocab(vocab))
