"""`model.init_from`: the shape from a model folder's config.json (a stated field must agree), the weights of
a transformers GPT-2, Llama and BERT loaded into cona's model (same logits), the folder's tokenizer, the
refusals; and end to end, a run exported with `cona export` and started again from it under TP x PP
evaluates at step 0 what the exported run evaluated last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cona_core.config import ConfigError, config_from_dict
from tests.support import REPO, TINY, write_config

transformers = pytest.importorskip("transformers")

VOCAB = 300  # the tokenizer's ids: cona pads the embedding to 384 rows
SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 4, "ffn": 64, "seq_len": 64}


def _hf_folder(family: str, path: Path) -> Path:
    """A tiny randomly initialised transformers model of `family`, saved with a tokenizer.json."""
    from launch.data.tokenize import byte_tokenizer

    torch.manual_seed(0)
    if family == "gpt":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new"
        )  # n_inner unset: 4 x n_embd
        model = transformers.GPT2LMHeadModel(config)
    elif family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        model = transformers.BertForMaskedLM(config)
    model.save_pretrained(path)
    byte_tokenizer(()).save(str(path / "tokenizer.json"))
    return path


def _config(model: dict, data: dict | None = None):
    return config_from_dict({**TINY, "model": model, "data": data or {}, "strategy": None}, "test")


def test_the_shape_and_tokenizer_come_from_config_json(tmp_path: Path) -> None:
    gpt = _hf_folder("gpt", tmp_path / "gpt")
    m = _config({"init_from": str(gpt)}).model
    assert (m.family, m.n_layers, m.d_model, m.n_heads, m.ffn, m.seq_len) == ("gpt", 2, 32, 4, 128, 64)
    assert _config({"init_from": str(gpt)}).data.tokenizer == str(gpt / "tokenizer.json")
    assert _config({"init_from": str(gpt)}, {"tokenizer": "bpe"}).data.tokenizer == "bpe"  # a stated one wins

    llama = _config({"init_from": str(_hf_folder("llama", tmp_path / "llama"))}).model  # transformers 5's format
    assert (llama.family, llama.n_kv_heads, llama.ffn, llama.rope_theta, llama.seq_len) == ("llama", 2, 64, 1e4, 64)
    bert = _config({"init_from": str(_hf_folder("bert", tmp_path / "bert"))}).model
    assert (bert.family, bert.n_layers, bert.ffn) == ("bert", 2, 64)

    # Stated fields that agree are kept; a shorter context than the model's is a choice, not a mismatch.
    assert _config({"init_from": str(gpt), "n_layers": 2, "family": "gpt", "seq_len": 32}).model.seq_len == 32


@pytest.mark.parametrize(
    ("stated", "message"),
    [
        ({"n_layers": 3}, "model.n_layers: 3 differs from model.init_from's config.json n_layer 2"),
        ({"family": "llama"}, "model.family: llama differs from model.init_from's config.json model_type gpt"),
        ({"seq_len": 128}, "model.seq_len: 128 differs from model.init_from's config.json n_positions 64"),
    ],
)
def test_a_stated_field_that_differs_is_refused(stated: dict, message: str, tmp_path: Path) -> None:
    gpt = _hf_folder("gpt", tmp_path / "gpt")
    with pytest.raises(ConfigError) as e:
        _config({"init_from": str(gpt), **stated})
    assert str(e.value) == message


def test_the_refusal_exits_2_naming_the_field(tmp_path: Path) -> None:
    gpt = _hf_folder("gpt", tmp_path / "gpt")
    doc = {**TINY, "model": {"init_from": str(gpt), "d_model": 64}}
    cfg = write_config(tmp_path / "c.yaml", doc)
    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", "train", str(cfg), "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "model.d_model: 64 differs from model.init_from's config.json n_embd 32" in proc.stderr


def test_folders_it_cannot_build_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model.init_from: .*empty: no config.json .* or cona.json"):
        _config({"init_from": str(tmp_path / "empty")})
    llama = _hf_folder("llama", tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_type 'llama3' is not supported"):
        _config({"init_from": str(llama)})
    with pytest.raises(ConfigError, match=r"model.n_layers: required \(or model.init_from\)"):
        _config({k: v for k, v in SHAPE.items() if k != "n_layers"})


def _logit_diff(family: str, folder: Path) -> float:
    """Max |logit difference| of cona's model loaded from `folder` and transformers' (the tokenizer's ids)."""
    from launch.materialise import build_unallocated
    from launch.models import get_spec

    m = _config({"init_from": str(folder)}).model
    whole = build_unallocated(get_spec(family), m, VOCAB, seed=0, pretrained=True)
    whole.materialise(whole.model, torch.device("cpu"))
    hf = getattr(transformers, get_spec(family).hf.architecture).from_pretrained(folder).eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = whole.model.eval()(tokens)
        theirs = hf(input_ids=tokens).logits
    assert ours.shape[-1] == 384  # padded rows: the mean of the model's rows
    diff = (ours[..., :VOCAB] - theirs).abs().max().item()
    print(f"{family} ({folder.name}): max |logit diff| {diff:.3g}")
    return diff


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_transformers_weights_give_cona_the_same_logits(family: str, tmp_path: Path) -> None:
    assert _logit_diff(family, _hf_folder(family, tmp_path / family)) < 1e-4


def test_other_spellings_of_the_weights_load(tmp_path: Path) -> None:
    """GPT-2's original files (names without `transformer.`), and a Llama whose head is its embedding (stored
    once, `tie_word_embeddings`)."""
    from safetensors.torch import load_file, save_file

    gpt = _hf_folder("gpt", tmp_path / "gpt-original")
    tensors = load_file(gpt / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, gpt / "model.safetensors")
    assert _logit_diff("gpt", gpt) < 1e-4

    llama = _hf_folder("llama", tmp_path / "llama-tied")
    tensors = load_file(llama / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, llama / "model.safetensors")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert _logit_diff("llama", llama) < 1e-4


def test_a_cona_torch_export_loads(tmp_path: Path) -> None:
    """`cona export --format torch`: cona.json gives the shape, model.pt the weights in cona's names."""
    from launch.export import write_torch
    from launch.materialise import build_model, build_unallocated
    from launch.models import get_spec

    spec, m = get_spec("llama"), _config({**SHAPE, "family": "llama", "n_kv_heads": 2}).model
    saved = build_model(spec, m, VOCAB, seed=3, device=torch.device("cpu"))
    (tmp_path / "torch").mkdir()
    write_torch(saved.state_dict(), m, VOCAB, 7, tmp_path / "torch")
    loaded = _config({"init_from": str(tmp_path / "torch"), "seq_len": 32}).model
    assert (loaded.family, loaded.n_kv_heads, loaded.n_layers, loaded.seq_len) == ("llama", 2, 2, 32)
    whole = build_unallocated(spec, loaded, VOCAB, seed=0, pretrained=True)
    whole.materialise(whole.model, torch.device("cpu"))
    names = saved.state_dict().keys()
    assert all(torch.equal(whole.model.state_dict()[k], saved.state_dict()[k]) for k in names)


def test_weights_that_do_not_fit_are_refused_before_launch(tmp_path: Path) -> None:
    from launch.pretrained import PretrainedError, check_pretrained

    m = _config({"init_from": str(_hf_folder("gpt", tmp_path / "gpt"))}).model
    check_pretrained(m, VOCAB)
    fewer = "tok_embeddings.weight has rows for 300 token ids, the tokenizer has 301"
    with pytest.raises(PretrainedError, match=fewer):
        check_pretrained(m, VOCAB + 1)
    (tmp_path / "gpt" / "model.safetensors").unlink()
    with pytest.raises(PretrainedError, match="no model.safetensors, pytorch_model.bin or model.pt"):
        check_pretrained(m, VOCAB)


def _cona(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _evals(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if r["kind"] == "eval"}


@pytest.mark.e2e
def test_an_exported_run_starts_a_new_one_under_tp_and_pp(tmp_path: Path) -> None:
    train = {**TINY["train"], "max_steps": 4, "eval_interval": 4}
    first = write_config(tmp_path / "first.yaml", {**TINY, "train": train})
    _cona("train", str(first), "--run-dir", str(tmp_path / "first"))
    _cona("export", str(tmp_path / "first"), "--format", "hf", "--out", str(tmp_path / "hf"))

    # Only init_from and the data's tokenizer (the synthetic corpus takes bpe or byte): the shape is the folder's.
    model = {"init_from": str(tmp_path / "hf")}
    doc = {**TINY, "model": model, "strategy": "dp1-tp2-pp2-mbs2-gbs8", "train": {**train, "max_steps": 1}}
    second = write_config(tmp_path / "second.yaml", doc)
    _cona("train", str(second), "--run-dir", str(tmp_path / "second"))
    resolved = yaml.safe_load((tmp_path / "second" / "config.resolved.json").read_text())["model"]
    assert {k: resolved[k] for k in TINY["model"]} == TINY["model"]
    last = _evals(tmp_path / "first")
    start = _evals(tmp_path / "second")[0]
    print(f"exported run's last val_loss {last[4]!r}, the new run's at step 0 {start!r}")
    assert sorted(last) == [0, 4] and last[0] - last[4] > 0.1  # it trained (its start is not the new one's)
    assert start == pytest.approx(last[4], rel=1e-5)
