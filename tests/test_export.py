"""`cona export` on a real run that trained under TP and PP (dp1-tp2-pp2, one launch): transformers loads
the Hugging Face folder and its logits equal cona's, the torch file is the checkpoint, and a bad request
writes nothing. (Resharding between layouts is tests/test_layouts.py's.)"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support import REPO, TINY, write_config

pytestmark = pytest.mark.e2e

STRATEGY = "dp1-tp2-pp2-mbs2-gbs8"
MODEL = {"llama": {"n_kv_heads": 2}}  # per-family additions to the tiny model (GQA for llama)


def _families() -> list[str]:
    from launch.models import FAMILY_MODULES, get_spec

    return [f for f in FAMILY_MODULES if get_spec(f).hf is not None]


def _cona(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Every family's run folder: 4 steps under dp1-tp2-pp2, all trained at once on first use (each run
    waits mostly on its workers' start)."""
    futures: dict[str, Future[subprocess.CompletedProcess]] = {}

    def train(family: str, base: Path) -> subprocess.CompletedProcess:
        model = {**TINY["model"], "family": family, **MODEL.get(family, {})}
        doc = {**TINY, "model": model, "strategy": STRATEGY, "train": {**TINY["train"], "max_steps": 4}}
        cfg = write_config(base / "tiny.yaml", doc)
        return _cona("train", str(cfg), "--run-dir", str(base / "run"), timeout=300)

    with ThreadPoolExecutor(max_workers=len(_families())) as pool:

        def run(family: str) -> Path:
            if not futures:
                for f in _families():
                    futures[f] = pool.submit(train, f, tmp_path_factory.mktemp(f"run-{f}"))
            proc = futures[family].result()
            assert proc.returncode == 0, proc.stderr[-3000:]
            return Path(proc.args[proc.args.index("--run-dir") + 1])

        yield run


def _cona_logits(out: Path, tokens: torch.Tensor) -> torch.Tensor:
    """cona's own model, rebuilt from the torch export."""
    from cona_core.config import ModelConfig
    from launch.models import get_spec

    meta = json.loads((out / "cona.json").read_text())
    model = get_spec(meta["family"]).build(ModelConfig(**meta["model"]), meta["vocab_size"])
    model.load_state_dict(torch.load(out / "model.pt"))
    return model.eval()(tokens)


@pytest.mark.parametrize("family", _families())
@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")  # DCP read in one process, as meant
def test_hf_export_matches_cona(family: str, trained: Callable[[str], Path], tmp_path: Path) -> None:
    import transformers
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from cona_core.shape import SPECIAL_TOKENS
    from launch.models import get_spec

    run = trained(family)
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [0, 4]  # the run's end is evaluated
    for fmt in ("torch", "hf"):
        proc = _cona("export", str(run), "--format", fmt, "--out", str(tmp_path / fmt))
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "torch"]  # no temporary folder left

    # The torch file is the newest checkpoint, consolidated from its (dp2, pp2) shards.
    ckpt = run / "checkpoints" / "step_000004"
    saved = _load_state_dict_from_keys({"model"}, checkpoint_id=str(ckpt))["model"]
    exported = torch.load(tmp_path / "torch" / "model.pt")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert json.loads((tmp_path / "torch" / "cona.json").read_text())["step"] == 4

    hf = get_spec(family).hf
    model = getattr(transformers, hf.architecture).from_pretrained(tmp_path / "hf").float()
    vocab = json.loads((run / "corpus.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, TINY["model"]["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = _cona_logits(tmp_path / "torch", tokens)
        theirs = model.eval()(input_ids=tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{family}: max |logit diff| {diff:.3g}")
    assert diff < 1e-4

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    text = "tha brou, kai.\n"
    assert tok(text)["input_ids"] == list(text.encode())  # the byte-level run: one id per byte
    assert tok.decode(list(text.encode())) == text
    specials = SPECIAL_TOKENS[family]  # the ids after the corpus's, as in training
    assert tok.convert_tokens_to_ids(list(specials)) == list(range(vocab - len(specials), vocab))
    assert ("[MASK]" in specials) == (tok.mask_token == "[MASK]")


def test_export_refuses_and_writes_nothing(trained: Callable[[str], Path], tmp_path: Path) -> None:
    run = trained("gpt")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    for marker in (broken / "checkpoints").glob("step_*/COMMITTED"):
        marker.unlink()
    cases = {
        "exists and is not an empty folder": (run, ["--format", "torch", "--out", str(full)]),
        "--step 3: no checkpoint of that step": (run, ["--format", "hf", "--step", "3", "--out", str(tmp_path / "a")]),
        "no usable checkpoint": (broken, ["--format", "torch", "--out", str(tmp_path / "b")]),
        "not a run folder": (full, ["--format", "torch", "--out", str(tmp_path / "c")]),
        "--format: must be one of hf, torch": (run, ["--format", "onnx", "--out", str(tmp_path / "d")]),
    }
    for message, (folder, args) in cases.items():
        proc = _cona("export", str(folder), *args)
        assert proc.returncode == 2 and message in proc.stderr, (message, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "full"]
    assert [p.name for p in full.iterdir()] == ["x"]


WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw"


@pytest.mark.skipif(not WIKITEXT.is_dir(), reason="WikiText-2 not available")
@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
def test_tokenizer_json_above_65535_trains_and_exports(tmp_path: Path) -> None:
    """`cona train` on (the first 400 kB of) WikiText-2 with a tokenizer.json of 66003 ids whose high ids
    occur in the data; `cona export` gives transformers that tokenizer, and its perplexity on the run's
    evaluation windows is the run's own."""
    import numpy as np
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    data = tmp_path / "wiki"
    data.mkdir()
    for name in ("train.txt", "valid.txt"):
        (data / name).write_text((WIKITEXT / name).read_text()[:400_000])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((data / "train.txt").read_text().splitlines(), trainer)
    tok.add_tokens([f"<unused{i}>" for i in range(65_000)] + [" the", " of"])  # ids 66000, 66001
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))

    seq = TINY["model"]["seq_len"]
    doc = {
        **TINY,
        "model": {**TINY["model"], "family": "llama"},
        "data": {"path": str(data), "tokenizer": str(tmp_path / "tokenizer.json")},
        "cluster": {"procs_per_node": 2},
        "strategy": "dp2-tp1-pp1-mbs2-gbs8",
        "train": {**TINY["train"], "max_steps": 3, "eval_interval": 3, "eval_tokens": 16 * seq},
    }
    run = tmp_path / "run"
    proc = _cona("train", str(write_config(tmp_path / "c.yaml", doc)), "--run-dir", str(run), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    corpus = json.loads((run / "corpus.json").read_text())
    assert corpus["vocab_size"] == 66_003 and corpus["eos_id"] == 66_002
    valid = np.load(corpus["valid_path"])
    assert valid.dtype == np.uint32 and {66_000, 66_001} <= set(valid[: 16 * seq + 1].tolist())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ppl = next(r["val_ppl"] for r in rows if r["kind"] == "eval" and r["step"] == 3)

    proc = _cona("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    text = (data / "valid.txt").read_text()[:2000]
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids and hf_tok.eos_token == "<|endoftext|>"
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert model.config.vocab_size == 66_048  # padded to a multiple of 128
    windows = torch.from_numpy(valid[: 16 * seq + 1].astype(np.int64))
    x = torch.stack([windows[k * seq : (k + 1) * seq] for k in range(16)])
    y = torch.stack([windows[k * seq + 1 : (k + 1) * seq + 1] for k in range(16)])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert abs(math.exp(loss.item()) / ppl - 1) < 0.05, (math.exp(loss.item()), ppl)
