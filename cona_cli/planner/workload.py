"""The workload the planner models: the model's torch-free shape and the training settings that
iteration time and memory depend on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cona_core.config import Config
from cona_core.shape import ModelShape, model_shape


@dataclass(frozen=True)
class Workload:
    """The model shape and training settings that T(s) and memory depend on."""

    shape: ModelShape
    precision: str = "auto"  # resolved against the hardware profile (planner.memory.compute_precision)
    recompute: bool = False
    pp_schedule: str = "1f1b"
    dp_impl: str = "ddp"
    nodes: int = 1
    procs_per_node: int = 1

    @classmethod
    def from_config(cls, cfg: Config, vocab: int | None = None) -> Workload:
        """`vocab`: the prepared corpus's vocabulary when known (else `data.vocab_size`)."""
        return cls(
            model_shape(cfg.model, vocab or cfg.data.vocab_size),
            cfg.search.precision,
            cfg.search.recompute,
            cfg.train.pp_schedule,
            cfg.train.dp_impl,
            cfg.cluster.nodes,
            cfg.cluster.procs_per_node,
        )

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def stage_params(self, tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
        """Parameters held by one device of the largest stage (layers plus embedding or head; a tied
        embedding is held by the first and the last stage)."""
        m = self.shape
        last = m.head_params + m.tied_copy_params
        ends = np.where(pp == 1, m.embedding_params + m.head_params, max(m.embedding_params, last))
        return (m.n_layers / pp * m.layer_params + ends) / tp
