"""Input formats, tokenizers and token storage (launch/data): each test writes small files in one format
and asserts the token ids the model sees, i.e. what `TokenStream` reads from the prepared corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from cona_core.config import ConfigError, DataConfig, config_from_dict
from cona_core.shape import padded_vocab
from launch.data.corpus import prepare_corpus
from launch.data.sampling import TokenStream
from launch.data.sources import FLAT_DOC_TOKENS, DataError
from tests.support import REPO, TINY, write_config

EOS = 256  # `byte` with a causal family: GPT-2's <|endoftext|> after the 256 bytes


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONA_CACHE", str(tmp_path / "cache"))


def seen(path: str) -> list[int]:
    """Every token id of a split as TokenStream serves it (seq_len 1: window k is tokens k, k + 1)."""
    stream = TokenStream(path, 1, seed=0)
    x, y = stream.windows(np.arange(len(stream)))
    return [*x[:, 0].tolist(), int(y[-1, 0])]


def byte_ids(*docs: str) -> list[int]:
    return [i for d in docs for i in [*d.encode(), EOS]]


def word_tokenizer(path: Path, n_words: int, bos: bool = False) -> Tokenizer:
    """A word-level tokenizer.json of n_words + 1 ids: w0 .. w{n-1} and <|endoftext|> (and <s> before
    each document when `bos`)."""
    vocab = {f"w{i}": i for i in range(n_words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"] + (["<s>"] if bos else []))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", n_words + 1)])
    tok.save(str(path))
    return tok


def test_text_shards_folder_with_byte_tokenizer(tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    (d / "shards").mkdir(parents=True)
    (d / "shards" / "train-000.txt").write_text("first doc\nline two\n\n  \nsecond doc\n")
    (d / "shards" / "train-001.txt").write_text("third\n")
    (d / "valid.txt").write_text("held out\n\nanother\n")
    (d / "test.txt").write_text("never read\n")
    (d / "README.md").write_text("not data\n")
    info = prepare_corpus(DataConfig(path=str(d), tokenizer="byte"))
    assert info.vocab_size == 257 and info.eos_id == EOS and Path(info.tokenizer_path).is_file()
    assert np.load(info.train_path).dtype == np.uint16
    assert seen(info.train_path) == byte_ids("first doc\nline two", "second doc", "third")
    assert seen(info.valid_path) == byte_ids("held out", "another")
    assert Path(info.train_path).parent.parent == d / ".cona-cache"
    assert prepare_corpus(DataConfig(path=str(d), tokenizer="byte")) == info  # content-keyed cache hit
    (d / "shards" / "train-001.txt").write_text("third!\n")
    assert prepare_corpus(DataConfig(path=str(d), tokenizer="byte")).key != info.key

    line = prepare_corpus(DataConfig(path=str(d), tokenizer="byte", doc_separator="line"))
    assert seen(line.train_path) == byte_ids("first doc", "line two", "second doc", "third!")
    (d / "x.txt").write_text("a<|doc|>b\nc<|doc|>")
    lit = prepare_corpus(DataConfig(path=str(d / "x.txt"), valid_path=str(d / "valid.txt"), doc_separator="<|doc|>",
                                    tokenizer="byte"))  # fmt: skip
    assert seen(lit.train_path) == byte_ids("a", "b\nc")
    # A family with [SEP] ends documents with it: bytes, then [PAD] [CLS] [SEP] [MASK] as the last ids.
    bert = prepare_corpus(
        DataConfig(path=str(d), tokenizer="byte"), special_tokens=("[PAD]", "[CLS]", "[SEP]", "[MASK]")
    )
    assert bert.vocab_size == 260 and bert.eos_id == 258 and seen(bert.valid_path)[:9] == [*b"held out", 258]


def test_glob_and_seeded_split_by_document(tmp_path: Path) -> None:
    docs = [f"document number {i}" for i in range(200)]
    for k in range(4):
        (tmp_path / f"part{k}.txt").write_text("\n\n".join(docs[k * 50 : (k + 1) * 50]) + "\n")
    cfg = DataConfig(path=str(tmp_path / "part*.txt"), tokenizer="byte", valid_fraction=0.2, valid_seed=3)
    info = prepare_corpus(cfg)

    def docs_of(path: str) -> list[str]:
        return bytes(t for t in seen(path) if t != EOS).decode().split("document number ")[1:]

    train, valid = docs_of(info.train_path), docs_of(info.valid_path)
    assert sorted(train + valid, key=int) == [str(i) for i in range(200)]  # a partition, each in order
    assert train == sorted(train, key=int) and 20 <= len(valid) <= 60
    other = prepare_corpus(DataConfig(path=str(tmp_path / "part*.txt"), tokenizer="byte", valid_fraction=0.2))
    assert docs_of(other.valid_path) != valid and prepare_corpus(cfg) == info  # seeded


def test_jsonl_with_a_tokenizer_json_above_65535_ids(tmp_path: Path) -> None:
    """A tokenizers-built vocabulary of 70001 ids whose high ids occur in the data: uint32 end to end."""
    tok = word_tokenizer(tmp_path / "tokenizer.json", 70_000)
    rows = [{"text": "w1 w69999 w65536"}, {"text": "w65535 w2", "id": 7}, {"text": ""}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data" / "val.jsonl").write_text(json.dumps({"text": "w69000 w3"}) + "\n")
    info = prepare_corpus(DataConfig(path=str(tmp_path / "data"), tokenizer=str(tmp_path / "tokenizer.json")))
    assert info.vocab_size == 70_001 and info.eos_id == 70_000 and padded_vocab(info.vocab_size) == 70_016
    assert np.load(info.train_path).dtype == np.uint32
    assert seen(info.train_path) == [1, 69999, 65536, 70000, 65535, 2, 70000]
    assert seen(info.valid_path) == [69000, 3, 70000]
    assert Tokenizer.from_file(info.tokenizer_path).to_str() == tok.to_str()  # what `cona export` copies

    (tmp_path / "data" / "val.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(DataError, match=r"val.jsonl:1: no 'text' string field"):
        prepare_corpus(DataConfig(path=str(tmp_path / "data"), tokenizer=str(tmp_path / "tokenizer.json")))


def test_bos_convention_and_tokenizer_folder(tmp_path: Path) -> None:
    """The tokenizer's post-processor adds its BOS (as Llama 3's does); a folder loads through transformers."""
    from transformers import PreTrainedTokenizerFast

    tok = word_tokenizer(tmp_path / "tokenizer.json", 10, bos=True)
    (tmp_path / "a.txt").write_text("w1 w2\n\nw3\n")
    (tmp_path / "v.txt").write_text("w4\n")
    cfg = DataConfig(
        path=str(tmp_path / "a.txt"), valid_path=str(tmp_path / "v.txt"), tokenizer=str(tmp_path / "tokenizer.json")
    )
    info = prepare_corpus(cfg)
    assert seen(info.train_path) == [11, 1, 2, 10, 11, 3, 10]

    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>").save_pretrained(folder)
    info2 = prepare_corpus(DataConfig(path=cfg.path, valid_path=cfg.valid_path, tokenizer=str(folder)))
    assert seen(info2.train_path) == [11, 1, 2, 10, 11, 3, 10] and info2.key != info.key
    kept = json.loads((Path(info2.tokenizer_path).parent / "tokenizer_config.json").read_text())
    assert kept["eos_token"] == "<|endoftext|>" and kept["bos_token"] == "<s>"


def test_nanogpt_bin_needs_its_dtype(tmp_path: Path) -> None:
    train, val = np.arange(3001, dtype=np.uint16) % 50257, np.array([5, 6, 50256], dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match=r"^data.dtype: required .*train.bin"):
        prepare_corpus(DataConfig(path=str(tmp_path), vocab_size=50257))
    info = prepare_corpus(DataConfig(path=str(tmp_path), vocab_size=50257, dtype="uint16"))
    assert seen(info.train_path) == train.tolist() and seen(info.valid_path) == val.tolist()
    assert info.vocab_size == 50257 and info.tokenizer_path is None
    with pytest.raises(DataError, match=r"token id 3000 outside the vocabulary of 2048.*data.vocab_size"):
        prepare_corpus(DataConfig(path=str(tmp_path), dtype="uint16"))
    with pytest.raises(DataError, match=r"train.bin: 6002 bytes is not a whole number of uint32"):
        prepare_corpus(DataConfig(path=str(tmp_path), vocab_size=50257, dtype="uint32"))


def test_npy_split_in_chunks(tmp_path: Path) -> None:
    tokens = (np.arange(FLAT_DOC_TOKENS * 40) * 7 % 100_000).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    info = prepare_corpus(DataConfig(path=str(tmp_path / "tokens.npy"), vocab_size=100_000, valid_fraction=0.25))
    train, valid = np.load(info.train_path), np.load(info.valid_path)
    assert train.dtype == np.uint32 and len(train) + len(valid) == len(tokens)
    chunks = {tuple(c) for c in tokens.reshape(40, FLAT_DOC_TOKENS).tolist()}
    got = [tuple(c) for a in (train, valid) for c in a.reshape(-1, FLAT_DOC_TOKENS).tolist()]
    assert set(got) == chunks and 4 <= len(valid) // FLAT_DOC_TOKENS <= 18
    np.save(tmp_path / "bad.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(DataError, match=r"bad.npy: a .npy of shape \(4, 4\)"):
        prepare_corpus(DataConfig(path=str(tmp_path / "bad.npy")))


@pytest.mark.filterwarnings("ignore")  # megatron-core: "Transformer Engine and Apex are not installed"
def test_megatron_indexed_dataset(tmp_path: Path) -> None:
    import torch

    pytest.importorskip("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    def build(prefix: Path, docs: list[list[int]]) -> None:
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
        for doc in docs:
            builder.add_document(torch.tensor(doc), [len(doc)])
        builder.finalize(f"{prefix}.idx")

    train_docs = [[1, 2, 3, 0], [70_000, 5, 0], [6, 0]]
    build(tmp_path / "corpus_text_document", train_docs)
    build(tmp_path / "held_text_document", [[9, 8, 0]])
    cfg = DataConfig(path=str(tmp_path / "corpus_text_document"), valid_path=str(tmp_path / "held_text_document.idx"),
                     vocab_size=70_001)  # fmt: skip
    info = prepare_corpus(cfg)
    assert seen(info.train_path) == [t for d in train_docs for t in d]  # as written: no EOS added
    assert seen(info.valid_path) == [9, 8, 0] and np.load(info.train_path).dtype == np.uint32
    many = [[i + 1, i + 2, 0] for i in range(30)]
    build(tmp_path / "many_text_document", many)
    split = prepare_corpus(
        DataConfig(path=str(tmp_path / "many_text_document.bin"), vocab_size=100, valid_fraction=0.3)
    )

    def docs(path: str) -> list[list[int]]:
        return [[*map(int, d.split()), 0] for d in " ".join(map(str, seen(path))).split(" 0") if d.strip()]

    train, valid = docs(split.train_path), docs(split.valid_path)
    assert sorted(train + valid) == many and train == sorted(train) and valid  # whole documents, in order


def test_hf_save_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["ab", "", "cd"], "n": [1, 2, 3]}),
            "validation": datasets.Dataset.from_dict({"text": ["ef"], "n": [4]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    info = prepare_corpus(DataConfig(path=str(tmp_path / "dd"), tokenizer="byte"))
    assert seen(info.train_path) == byte_ids("ab", "cd") and seen(info.valid_path) == byte_ids("ef")
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5, 6]] * 20}).save_to_disk(str(tmp_path / "ids"))
    ids = prepare_corpus(DataConfig(path=str(tmp_path / "ids"), format="hf", vocab_size=300, valid_fraction=0.3))
    assert sorted(seen(ids.train_path) + seen(ids.valid_path)) == sorted([1, 2, 3, 4, 5, 6] * 20)


def test_bad_input_is_one_line_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.npy").write_bytes(b"")
    cases = {
        f"data.path: {tmp_path / 'nope'}: no such file or folder": DataConfig(path=str(tmp_path / "nope")),
        "data.path: .*: no file matches": DataConfig(path=str(tmp_path / "*.jsonl")),
        "files of several formats .npy, text.; set data.format": DataConfig(path=str(tmp_path)),
        "data.tokenizer: .*missing.json: no such file": DataConfig(
            path=str(tmp_path / "a.txt"), tokenizer="./missing.json"
        ),
        "data.tokenizer: .*a.txt: cannot load it as a tokenizer.json": DataConfig(
            path=str(tmp_path / "a.txt"), tokenizer=str(tmp_path / "a.txt")
        ),
        "data.valid_fraction: no document drawn": DataConfig(path=str(tmp_path / "a.txt"), tokenizer="byte"),
    }
    for message, cfg in cases.items():
        with pytest.raises(DataError, match=message) as e:
            prepare_corpus(cfg)
        assert "\n" not in str(e.value)
    for raw, message in (
        ({"format": "parquet"}, "data.format: must be one of auto, text"),
        ({"dtype": "float32"}, "data.dtype: must be one of uint16"),
        ({"tokenizer": "my tokenizer"}, "data.tokenizer: must be one of bpe, byte, a path"),
        ({"vocab_size": 2**32}, "data.vocab_size: must be in"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_from_dict(
                {"model": {"n_layers": 1, "d_model": 8, "n_heads": 2, "ffn": 8, "seq_len": 8}, "data": raw}
            )
    assert DataConfig(vocab_size=128_256).vocab_size == 128_256


# -- `cona train` on each format ---------------------------------------------------------------------
# One process, 3 steps, from the config to metrics.jsonl. A text folder trains end to end in
# tests/test_export.py (test_tokenizer_json_above_65535_trains_and_exports); these are the other formats.

TRAIN_TOKENS, VALID_TOKENS, VOCAB = 3000, 600, 300


def _write_jsonl(d: Path) -> tuple[dict, list[int], list[int]]:
    train = [f"document {i}: {'word ' * (i % 7)}end" for i in range(120)]
    valid = [f"held out {i}" for i in range(30)]
    for name, docs in (("train.jsonl", train), ("val.jsonl", valid)):
        (d / name).write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)))
    return {"path": str(d), "tokenizer": "byte"}, byte_ids(*train), byte_ids(*valid)


def _flat_tokens() -> tuple[np.ndarray, np.ndarray]:
    return np.arange(TRAIN_TOKENS) * 7 % VOCAB, np.arange(VALID_TOKENS) * 11 % VOCAB


def _write_bin(d: Path) -> tuple[dict, list[int], list[int]]:
    train, valid = _flat_tokens()
    train.astype(np.uint16).tofile(d / "train.bin")
    valid.astype(np.uint16).tofile(d / "val.bin")
    return {"path": str(d), "dtype": "uint16", "vocab_size": VOCAB}, train.tolist(), valid.tolist()


def _write_npy(d: Path) -> tuple[dict, list[int], list[int]]:
    train, valid = _flat_tokens()
    np.save(d / "train.npy", train.astype(np.int32))
    np.save(d / "val.npy", valid.astype(np.int64))
    return {"path": str(d), "vocab_size": VOCAB}, train.tolist(), valid.tolist()


def _write_megatron(d: Path) -> tuple[dict, list[int], list[int]]:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    train, valid = _flat_tokens()
    for prefix, tokens in (("corpus_text_document", train), ("held_text_document", valid)):
        builder = IndexedDatasetBuilder(str(d / f"{prefix}.bin"), dtype=np.int32)
        for doc in np.array_split(tokens, 20):  # Megatron documents: kept as written, no EOS added
            builder.add_document(torch.tensor(doc), [len(doc)])
        builder.finalize(str(d / f"{prefix}.idx"))
    data = {"path": str(d / "corpus_text_document"), "valid_path": str(d / "held_text_document"), "vocab_size": VOCAB}
    return data, train.tolist(), valid.tolist()


def _write_hf(d: Path) -> tuple[dict, list[int], list[int]]:
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install -e '.[hf]')")
    train = [f"row {i} of the training split" for i in range(100)]
    valid = [f"validation row {i}" for i in range(25)]
    splits = {"train": train, "validation": valid}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(d / "dd")
    )
    return {"path": str(d / "dd"), "tokenizer": "byte"}, byte_ids(*train), byte_ids(*valid)


WRITERS = {"jsonl": _write_jsonl, "bin": _write_bin, "npy": _write_npy, "megatron": _write_megatron, "hf": _write_hf}


def _train(base: Path, data: dict, fmt: str) -> subprocess.CompletedProcess:
    """`cona train` of the tiny model on `data`: one process, 3 steps, an evaluation at the last."""
    seq = TINY["model"]["seq_len"]
    doc = {
        **TINY,
        "data": {**data, "format": fmt},
        "cluster": {"procs_per_node": 1},
        "strategy": "dp1-tp1-pp1-mbs2-gbs4",
        "train": {**TINY["train"], "max_steps": 3, "eval_interval": 3, "eval_tokens": 4 * seq},
    }
    cmd = [sys.executable, "-c", "from cona_cli.app import main; main()", "train"]
    cmd += [str(write_config(base / "c.yaml", doc)), "--run-dir", str(base / "run")]
    env = {**os.environ, "CONA_CACHE": str(base / "cache")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def format_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple]]:
    """Every format's files and its `cona train`, all at once (each run waits mostly on its worker's start):
    format -> (run folder, train ids, valid ids, future of the finished process), or the skip reason."""
    runs: dict[str, tuple] = {}
    with ThreadPoolExecutor(max_workers=len(WRITERS)) as pool:
        for fmt, write in WRITERS.items():
            base = tmp_path_factory.mktemp(f"train-{fmt}")
            (base / "data").mkdir()
            try:
                data, train, valid = write(base / "data")
            except pytest.skip.Exception as e:
                runs[fmt] = (str(e),)
                continue
            runs[fmt] = (base / "run", train, valid, pool.submit(_train, base, data, fmt))
        yield runs


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore")  # megatron-core: "Transformer Engine and Apex are not installed"
@pytest.mark.parametrize("fmt", WRITERS)
def test_cona_train_on_each_format(fmt: str, format_runs: dict[str, tuple]) -> None:
    """`cona train` exits 0 after its 3 steps, and the corpus it recorded is the one written in `fmt`:
    the token ids the model sees, its vocabulary, and whether the tokens came without a tokenizer."""
    if len(format_runs[fmt]) == 1:
        pytest.skip(format_runs[fmt][0])
    run, train, valid, future = format_runs[fmt]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in steps)
    assert [r["step"] for r in rows if r["kind"] == "eval"][-1] == 3
    corpus = json.loads((run / "corpus.json").read_text())
    assert seen(corpus["train_path"]) == train and seen(corpus["valid_path"]) == valid
    assert corpus["n_train_tokens"] == len(train) and corpus["n_valid_tokens"] == len(valid)
    if fmt in ("bin", "npy", "megatron"):  # token ids as given: the configured vocabulary, no tokenizer
        assert corpus["pretokenized"] and corpus["tokenizer_path"] is None and corpus["vocab_size"] == VOCAB
    else:  # text through the byte tokenizer, an EOS after each document
        assert not corpus["pretokenized"] and Path(corpus["tokenizer_path"]).is_file()
        assert corpus["vocab_size"] == 257 and corpus["eos_id"] == EOS
