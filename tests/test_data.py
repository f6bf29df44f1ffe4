"""Corpus preparation, tokenizer cache and global-sample-index batching (launch/data.py)."""

from __future__ import annotations

import collections
import itertools
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import launch.data.corpus as data_mod
from cona_core.config import DataConfig
from launch.data.corpus import CorpusInfo, prepare_corpus
from launch.data.prefetch import BatchKey, Prefetcher
from launch.data.sampling import TokenStream, eval_batches, replica_microbatches
from launch.data.sources import DataError
from launch.data.synthetic import synthetic_corpus

WIKITEXT = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "wikitext-2-raw"
)  # shared/ beside the repo
SEQ = 8


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("CONA_CACHE", str(root))
    return root


@pytest.fixture
def ramp(tmp_path: Path) -> str:
    """A token file whose token at position p is p, so a window's first token / SEQ is its index."""
    path = tmp_path / "ramp.npy"
    np.save(path, np.arange(SEQ * 50 + 1, dtype=np.uint16))
    return str(path)


def window_ids(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    return [int(k) for x, _ in batches for k in x[:, 0] // SEQ]


def step_ids(stream: TokenStream, consumed: int, gbs: int, dp: int, mbs: int) -> list[int]:
    return [k for r in range(dp) for k in window_ids(replica_microbatches(stream, consumed, gbs, dp, r, mbs))]


def test_synthetic_corpus_is_deterministic_and_structured() -> None:
    train, valid = synthetic_corpus(30_000, seed=3)
    assert (train, valid) == synthetic_corpus(30_000, seed=3)
    assert train != synthetic_corpus(30_000, seed=4)[0]
    words = train.lower().replace(",", " ").replace(".", " ").split()
    assert len(words) == 30_000 and 2_500 <= len(valid.split()) <= 3_500
    uni = collections.Counter(words)
    bi = collections.Counter(itertools.pairwise(words))
    n = len(words)
    h_uni = -sum(c / n * math.log2(c / n) for c in uni.values())
    h_bi = -sum(c / (n - 1) * math.log2(c / uni[a]) for (a, _), c in bi.items())
    assert 200 <= len(uni) <= 500
    assert h_bi < h_uni - 2.5, (h_uni, h_bi)  # the next word is far more predictable than the unigram


def test_synthetic_prepare_caches_and_round_trips(_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DataConfig(vocab_size=600, synthetic_tokens=20_000)
    info = prepare_corpus(cfg, seed=1)
    assert Path(info.train_path).parent.parent == _cache
    assert Path(info.train_path).parent.name == f"synthetic-{info.key}"
    assert 256 < info.vocab_size <= 600
    train = np.load(info.train_path, mmap_mode="r")
    assert train.dtype == np.uint16 and len(train) == info.n_train_tokens and train.max() < info.vocab_size
    assert CorpusInfo.from_json(info.to_json()) == info

    monkeypatch.setattr(data_mod, "_tokenize", lambda *a: pytest.fail("retrained on a cache hit"))
    assert prepare_corpus(cfg, seed=1) == info
    assert prepare_corpus(DataConfig(vocab_size=600, synthetic_tokens=20_000, tokenizer="bpe"), 1).key == info.key

    text = (Path(info.train_path).parent / "valid.txt").read_text()
    tok = Tokenizer.from_file(info.tokenizer_path)
    ids = np.load(info.valid_path)
    assert tok.decode(ids.tolist()) == text
    assert tok.decode(tok.encode("Ünïcode, tabs\tand\nnewlines.").ids) == "Ünïcode, tabs\tand\nnewlines."


def test_byte_tokenizer_and_folder_cache(tmp_path: Path, _cache: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("héllo world\n" * 50)
    (corpus / "valid.txt").write_text("hello again\n" * 5)
    info = prepare_corpus(DataConfig(path=str(corpus), tokenizer="byte"))
    assert info.vocab_size == 257 and info.eos_id == 256  # the bytes and GPT-2's <|endoftext|>
    assert Path(info.train_path).parent.parent == corpus / ".cona-cache"  # writable, not under shared/
    doc = ("héllo world\n" * 50).rstrip("\n").encode()  # one document (no blank line), then the EOS
    assert np.load(info.train_path).tolist() == [*doc, 256]
    tok = Tokenizer.from_file(info.tokenizer_path)  # the byte-level tokenizer.json `cona export` copies
    assert tok.encode("héllo").ids == list("héllo".encode()) and tok.token_to_id("<|endoftext|>") == 256
    (corpus / "valid.txt").write_text("changed\n" * 5)
    assert prepare_corpus(DataConfig(path=str(corpus), tokenizer="byte")).key != info.key

    shared = tmp_path / "shared" / "corpus"
    shutil.copytree(corpus, shared, ignore=shutil.ignore_patterns(".cona-cache"))
    assert Path(prepare_corpus(DataConfig(path=str(shared), tokenizer="byte")).train_path).parent.parent == _cache


def test_streamed_array_is_a_plain_npy(tmp_path: Path) -> None:
    from launch.data.tokenize import TokenWriter, token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    w = TokenWriter(tmp_path / "t.npy", np.dtype(np.uint32))
    for k in range(3):
        w.write(np.arange(k * 10, k * 10 + 10) + 70_000)
    assert w.close() == 30
    got = np.load(tmp_path / "t.npy", mmap_mode="r")
    assert got.dtype == np.uint32 and got.tolist() == list(range(70_000, 70_030))


def test_concurrent_prepare_builds_once(tmp_path: Path) -> None:
    code = (
        "import sys; from cona_core.config import DataConfig; from launch.data.corpus import prepare_corpus; "
        "print(prepare_corpus(DataConfig(vocab_size=400, synthetic_tokens=50_000, "
        f"cache_dir={str(tmp_path / 'c')!r}), seed=2).to_json())"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert [p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")] == [
        Path(CorpusInfo.from_json(outs[0]).train_path).parent.name
    ]


@pytest.mark.parametrize("gbs, dp, mbs", [(12, 1, 12), (12, 2, 3), (12, 3, 2), (12, 4, 1)])
def test_replicas_partition_the_global_batch(ramp: str, gbs: int, dp: int, mbs: int) -> None:
    stream = TokenStream(ramp, SEQ, seed=5)
    x, y = stream.samples(24, gbs)
    assert x.shape == (gbs, SEQ) and x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], x[:, -1] + 1)
    batches = [mb for r in range(dp) for mb in replica_microbatches(stream, 24, gbs, dp, r, mbs)]
    assert len(batches) == gbs // mbs and all(mb[0].shape == (mbs, SEQ) for mb in batches)
    assert torch.equal(torch.cat([mb[0] for mb in batches]), x)
    assert torch.equal(torch.cat([mb[1] for mb in batches]), y)


def test_layout_switch_continues_without_repeat_or_skip(ramp: str) -> None:
    stream = TokenStream(ramp, SEQ, seed=7)
    assert len(stream) == 50
    seen, consumed = [], 0
    for gbs, dp, mbs, steps in [(8, 2, 2, 3), (12, 3, 4, 2), (6, 1, 3, 3), (16, 4, 2, 2)]:
        for _ in range(steps):
            seen += step_ids(stream, consumed, gbs, dp, mbs)
            consumed += gbs
    assert consumed == 98 and len(seen) == 98
    epoch0, epoch1 = seen[:50], seen[50:]
    assert sorted(epoch0) == list(range(50)) and len(set(epoch1)) == 48  # every window once per epoch
    reference = window_ids([stream.samples(0, 98)])
    assert seen == reference  # the same stream regardless of layout
    assert epoch0 != list(range(50)) and epoch1 != epoch0[:48]  # shuffled, and a new order each epoch
    assert seen != window_ids([TokenStream(ramp, SEQ, seed=8).samples(0, 98)])


def test_prefetched_batches_are_the_steps_own_across_resizes_and_restores(ramp: str) -> None:
    """Built on the background thread: each step's micro-batches are the ones sampled directly, whether
    foreseen (the next step at the same batch sizes) or not (a resize, a restore to an earlier step)."""
    fetch = Prefetcher(TokenStream(ramp, SEQ, seed=7), torch.device("cpu"), background=True)
    direct = TokenStream(ramp, SEQ, seed=7)
    keys = [BatchKey(0, 8, 2, 1, 2), BatchKey(8, 8, 2, 1, 2), BatchKey(16, 16, 2, 1, 4), BatchKey(32, 16, 2, 1, 4)]
    keys += [BatchKey(8, 8, 2, 1, 2), BatchKey(48, 6, 3, 2, 1)]  # a restore to step 1, then a new epoch's
    try:
        for key in keys:
            got = fetch.take(key)
            want = replica_microbatches(direct, *key)
            assert len(got) == len(want) and all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    finally:
        fetch.close()
    assert fetch.hits == 2  # steps 2 and 4: the others were not the next step at the same sizes


def test_eval_batches_are_layout_independent(ramp: str) -> None:
    """The same fixed windows under every (gbs, dp, mbs), in order; the last step padded with IGNORE."""
    from launch.models.spec import IGNORE_INDEX as IGNORE

    def layout(gbs: int, dp: int, mbs: int) -> tuple[list[int], int]:
        per_rank = [eval_batches(ramp, SEQ, 24 * SEQ, gbs, dp, r, mbs) for r in range(dp)]
        ids, pads = [], 0
        for step in range(len(per_rank[0])):
            for r in range(dp):
                assert all(x.shape[0] == mbs for x, _ in per_rank[r][step])
                for x, y in per_rank[r][step]:
                    for row_x, row_y in zip(x, y):
                        if (row_y == IGNORE).all():
                            pads += 1
                        else:
                            ids.append(int(row_x[0]) // SEQ)
        return ids, pads

    for gbs, dp, mbs in ((24, 1, 24), (8, 2, 2), (16, 4, 2), (48, 3, 8), (20, 5, 1)):
        ids, pads = layout(gbs, dp, mbs)
        assert ids == list(range(24)) and pads == -24 % gbs, (gbs, dp, mbs)
    with pytest.raises(DataError, match="ramp.npy"):
        eval_batches(ramp, SEQ, 10_000, 8, 1, 0, 8)


def test_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"data.path: {tmp_path / 'nope'}: no such file or folder"):
        prepare_corpus(DataConfig(path=str(tmp_path / "nope")))
    (tmp_path / "train.txt").write_text("some text\n")
    (tmp_path / "valid.txt").write_text("")
    with pytest.raises(DataError, match=f"{tmp_path / 'valid.txt'}: empty"):
        prepare_corpus(DataConfig(path=str(tmp_path)))
    (tmp_path / "valid.txt").write_bytes(b"\xff\xfe bad\n")
    with pytest.raises(DataError, match="valid.txt: not UTF-8"):
        prepare_corpus(DataConfig(path=str(tmp_path)))
    np.save(tmp_path / "tiny.npy", np.arange(5, dtype=np.uint16))
    with pytest.raises(DataError, match="tiny.npy"):
        TokenStream(str(tmp_path / "tiny.npy"), SEQ, 0)
    assert issubclass(DataError, ValueError)


@pytest.mark.skipif(not WIKITEXT.is_dir(), reason="WikiText-2 not available")
def test_wikitext_bpe(tmp_path: Path) -> None:
    info = prepare_corpus(DataConfig(path=str(WIKITEXT), vocab_size=1024, cache_dir=str(tmp_path / "c")))
    assert info.vocab_size == 1024 and info.eos_id == 1023  # test.txt is not read
    tok = Tokenizer.from_file(info.tokenizer_path)
    valid = np.load(info.valid_path)
    assert valid[-1] == 1023 and 1000 < (valid == 1023).sum() < 2000  # an EOS after each paragraph and heading
    assert tok.decode(valid[:200].tolist()).startswith(" = Homarus gammarus = ")
    ratio = (WIKITEXT / "train.txt").stat().st_size / info.n_train_tokens
    assert 2.0 < ratio < 4.0, ratio  # ~2.6 bytes/token at 1024 (~4.0 at 8192)
    assert 0.08 < info.n_valid_tokens / info.n_train_tokens < 0.13
    assert not (WIKITEXT / ".cona-cache").exists()
