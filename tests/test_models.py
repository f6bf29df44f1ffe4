"""The three families: each maps onto its Hugging Face class with equal logits, masks the same sample the
same way whatever the batch, and describes itself to the planner."""

from __future__ import annotations

import pytest
import torch

from cona_core.config import ModelConfig
from cona_core.shape import model_shape
from launch.models import get_spec

VOCAB = 300
MODEL = {
    "gpt": ModelConfig(n_layers=2, d_model=32, n_heads=4, ffn=64, seq_len=16, family="gpt"),
    "llama": ModelConfig(n_layers=2, d_model=32, n_heads=4, ffn=64, seq_len=16, family="llama", n_kv_heads=2),
    "bert": ModelConfig(n_layers=2, d_model=32, n_heads=4, ffn=64, seq_len=16, family="bert"),
}


@pytest.mark.parametrize("family", sorted(MODEL))
def test_hf_mapping_gives_the_same_logits(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    m, spec = MODEL[family], get_spec(family)
    model = spec.build(m, VOCAB)
    model.init_weights(3)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped name shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    hf_cfg = getattr(transformers, spec.hf.architecture).config_class.from_dict(spec.hf.config(m, VOCAB))
    hf = getattr(transformers, spec.hf.architecture)(hf_cfg).eval()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(spec.hf.tensors(sd, m), strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    hf.tie_weights()
    tokens = torch.randint(0, VOCAB, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf(input_ids=tokens).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_bert_masks_by_global_sample_index() -> None:
    spec = get_spec("bert")
    batch = spec.batch(VOCAB)
    windows = torch.randint(0, VOCAB - 4, (64, 129), generator=torch.Generator().manual_seed(1))
    ids = torch.arange(1000, 1064)
    x, y = batch(windows, ids)
    x2, y2 = batch(windows[10:12], ids[10:12])  # the same samples in another batch: the same masks
    assert torch.equal(x[10:12], x2) and torch.equal(y[10:12], y2)
    targets = y != -100
    assert abs(targets.float().mean().item() - 0.15) < 0.02
    masked = x[targets] == VOCAB - 1
    kept = x[targets] == windows[:, :-1][targets]
    assert abs(masked.float().mean().item() - 0.8) < 0.05 and abs(kept.float().mean().item() - 0.1 - 0.1 / 296) < 0.04
    assert torch.equal(x[~targets], windows[:, :-1][~targets]) and (x < VOCAB).all()


@pytest.mark.parametrize("family", sorted(MODEL))
def test_planner_shape_counts_the_built_model(family: str) -> None:
    m = MODEL[family]
    model = get_spec(family).build(m, VOCAB)
    assert model_shape(m, VOCAB).total_params == sum(p.numel() for p in model.parameters())


def test_report_says_mlm_ppl_for_bert_runs() -> None:
    from pathlib import Path

    from cona_cli.commands.report_command import ttp_rows
    from cona_cli.report.build import build_report
    from cona_cli.report.runlog import RunLog

    def log(family: str) -> RunLog:
        return RunLog(Path(family), (), (), (), None, None, (), family=family)

    headers, _ = ttp_rows(build_report([log("bert")], targets=[20.0]), " ")
    assert "MLM ppl ≤ 20" in headers and "final MLM ppl" in headers
    assert "final ppl" in ttp_rows(build_report([log("gpt")], targets=[20.0]), " ")[0]
