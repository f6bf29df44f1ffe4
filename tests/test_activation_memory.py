"""The memory model's activation term against the bytes autograd actually saves, and activation
recompute giving the same gradients (single process, fp32)."""

from __future__ import annotations

import pytest
import torch

from cona_cli.planner.memory import layer_activation_bytes
from cona_core.config import config_from_dict
from cona_core.shape import model_shape
from launch.models import get_spec
from launch.recompute import recompute_blocks
from tests.support import TINY

VOCAB, SEQ, MBS = 256, 64, 2


def _model(family: str, n_layers: int, recompute: bool = False) -> tuple[torch.nn.Module, object]:
    m = {**TINY["model"], "family": family, "n_layers": n_layers, "d_model": 64, "ffn": 256, "seq_len": SEQ}
    cfg = config_from_dict({**TINY, "model": m}, "t")
    model = get_spec(family).build(cfg.model, VOCAB)
    model.init_weights(0)
    if recompute:
        recompute_blocks(model)
    return model, model_shape(cfg.model, VOCAB)


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_activation_bytes_per_layer_match_saved_tensors(family: str) -> None:
    tokens = torch.randint(0, VOCAB, (MBS, SEQ))
    (small, shape), (large, _) = _model(family, 2), _model(family, 4)
    per_layer = (saved_bytes(large, tokens) - saved_bytes(small, tokens)) / 2  # embedding and head cancel
    modelled = layer_activation_bytes(shape, MBS, 1, 4)
    assert abs(modelled / per_layer - 1) < 0.10, (family, modelled, per_layer)
    (small, _), (large, _) = _model(family, 2, recompute=True), _model(family, 4, recompute=True)
    kept = (saved_bytes(large, tokens) - saved_bytes(small, tokens)) / 2
    assert kept == MBS * SEQ * shape.d_model * 4  # recompute: only each block's input


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_recompute_gives_equal_gradients(family: str) -> None:
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1))
    spec = get_spec(family)
    grads = []
    for recompute in (False, True):
        model, _ = _model(family, 2, recompute)
        spec.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
