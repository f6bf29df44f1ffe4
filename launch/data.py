"""Corpus preparation (synthetic or a train/valid folder), tokenization cache and sample indexing.

The controller calls `prepare_corpus` once; it writes memory-mapped uint16 token arrays into a
cache folder keyed by the corpus content and tokenizer. Workers read them with `TokenStream`.

Training samples are addressed by a *global sample index* i: epoch e = i // n, window
k = perm_e[i % n] of the n = (tokens - 1) // seq_len non-overlapping windows, perm_e a seeded
permutation. A step consumes indices [consumed, consumed + gbs), so any change of dp, mbs or gbs
continues at `consumed_samples` without repeating or skipping a sample.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cona_cli.config import DataConfig
from launch.models.spec import IGNORE_INDEX, Batch, BatchFn, next_token_batch

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1  # bump when the cache layout or tokenization changes
_SYNTHETIC_VERSION = 1  # bump when the synthetic language generator changes
_VALID_FRACTION = 0.1


class DataError(ValueError):
    """A corpus problem; the message is one line naming the file or folder."""


@dataclass(frozen=True)
class CorpusInfo:
    """A prepared corpus: token arrays (.npy, uint16), tokenizer JSON (None for bytes) and sizes."""

    train_path: str
    valid_path: str
    tokenizer_path: str | None
    vocab_size: int
    n_train_tokens: int
    n_valid_tokens: int
    key: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CorpusInfo:
        return cls(**json.loads(text))


def cache_root() -> Path:
    """The default cache root: $CONA_CACHE, else ~/.cache/cona."""
    return Path(os.environ.get("CONA_CACHE") or Path.home() / ".cache" / "cona")


# --------------------------------------------------------------------------- corpus preparation


def prepare_corpus(data: DataConfig, seed: int = 0, special_tokens: tuple[str, ...] = ()) -> CorpusInfo:
    """Runs once in the controller before launch (idempotent, cached). `special_tokens` (the model
    family's) get the ids after the corpus's own tokens and are part of the cache key (none: the key of
    a corpus without them). Raises DataError (a ValueError subclass, one-line message naming the
    file/folder) for a missing folder, missing train.txt/valid.txt, empty files."""
    vocab = 256 if data.tokenizer == "byte" else data.vocab_size
    recipe: dict[str, object] = {"format": _FORMAT_VERSION, "tokenizer": data.tokenizer, "vocab": vocab}
    if special_tokens:
        recipe["special_tokens"] = list(special_tokens)
    if data.path is None:
        recipe.update(synthetic=_SYNTHETIC_VERSION, words=data.synthetic_tokens, seed=seed)
        base = Path(data.cache_dir) if data.cache_dir else cache_root()
        label = "synthetic"

        def build(tmp: Path) -> dict[str, int]:
            t0 = time.perf_counter()
            train, valid = synthetic_corpus(data.synthetic_tokens, seed)
            (tmp / "train.txt").write_text(train, encoding="utf-8")
            (tmp / "valid.txt").write_text(valid, encoding="utf-8")
            log.info("synthetic corpus: %d words in %.1fs", data.synthetic_tokens, time.perf_counter() - t0)
            return _tokenize(tmp, tmp / "train.txt", tmp / "valid.txt", data.tokenizer, vocab, special_tokens)
    else:
        src = _check_source(Path(data.path).expanduser())
        recipe.update(train=_file_sha(src / "train.txt"), valid=_file_sha(src / "valid.txt"))
        if data.cache_dir:
            base = Path(data.cache_dir)
        elif os.access(src, os.W_OK) and "shared" not in src.resolve().parts:
            base = src / ".cona-cache"
        else:
            base = cache_root()
        label = src.resolve().name

        def build(tmp: Path) -> dict[str, int]:
            return _tokenize(tmp, src / "train.txt", src / "valid.txt", data.tokenizer, vocab, special_tokens)

    key = _digest(recipe)
    return _cached((base / f"{label}-{key}").expanduser().absolute(), key, build)


def _check_source(path: Path) -> Path:
    if not path.exists():
        raise DataError(f"data.path: {path}: no such folder")
    if not path.is_dir():
        raise DataError(f"data.path: {path}: not a folder")
    for name in ("train.txt", "valid.txt"):
        f = path / name
        if not f.is_file():
            raise DataError(f"{f}: missing")
        if f.stat().st_size == 0:
            raise DataError(f"{f}: empty")
    return path


def _digest(recipe: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cached(out: Path, key: str, build: Callable[[Path], dict[str, int]]) -> CorpusInfo:
    """Return the corpus in `out`, building it first (under a lock, into a temp folder renamed atomically)."""
    if not (out / "meta.json").exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            lock = open(out.parent / f".{out.name}.lock", "w")
        except OSError as e:
            raise DataError(f"{out.parent}: cannot write the corpus cache ({e.strerror})") from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "meta.json").exists():
                tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
                tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be readable
                try:
                    meta = build(tmp)
                    (tmp / "meta.json").write_text(json.dumps(meta))
                    if out.exists():  # an incomplete folder left by hand: replace it
                        shutil.rmtree(out)
                    os.replace(tmp, out)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    else:
        log.info("corpus cache hit: %s", out)
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = out / "tokenizer.json"
    return CorpusInfo(
        train_path=str(out / "train.npy"),
        valid_path=str(out / "valid.npy"),
        tokenizer_path=str(tokenizer) if tokenizer.exists() else None,
        vocab_size=meta["vocab_size"],
        n_train_tokens=meta["n_train_tokens"],
        n_valid_tokens=meta["n_valid_tokens"],
        key=key,
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None


def _tokenize(
    out: Path, train: Path, valid: Path, kind: str, vocab_size: int, special_tokens: tuple[str, ...] = ()
) -> dict[str, int]:
    """Write train.npy / valid.npy (uint16) and, for BPE, tokenizer.json into `out`; return the meta.
    Special tokens follow the corpus's ids (bytes: 256, 257, ...; BPE: after the trained vocabulary)."""
    counts = {}
    if kind == "byte":
        for split, src in (("train", train), ("valid", valid)):
            ids = np.fromfile(src, dtype=np.uint8).astype(np.uint16)
            np.save(out / f"{split}.npy", ids)
            counts[split] = len(ids)
        vocab = 256 + len(special_tokens)
    else:
        texts = {
            "train": _read_text(train).splitlines(keepends=True),
            "valid": _read_text(valid).splitlines(keepends=True),
        }
        t0 = time.perf_counter()
        tok = Tokenizer(models.BPE())  # byte-level: GPT-2 pre-tokenization, lossless decoding
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(texts["train"], trainer)
        tok.add_special_tokens(list(special_tokens))
        tok.save(str(out / "tokenizer.json"))
        vocab = tok.get_vocab_size()
        log.info("BPE (%d tokens) trained on %s in %.1fs", vocab, train, time.perf_counter() - t0)
        for split, lines in texts.items():
            ids = np.concatenate([np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch_fast(lines)])
            np.save(out / f"{split}.npy", ids)
            counts[split] = len(ids)
    return {"vocab_size": vocab, "n_train_tokens": counts["train"], "n_valid_tokens": counts["valid"]}


# --------------------------------------------------------------------------- synthetic language

_ONSETS = [
    "",
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "sh",
    "th",
    "ch",
    "br",
    "st",
    "tr",
    "kl",
    "gr",
]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "k"]


def synthetic_corpus(n_words: int, seed: int, vocab: int = 500, branching: int = 8) -> tuple[str, str]:
    """A seeded pseudo-language: (train text of ~n_words words, valid text of ~n_words/10 words).

    `vocab` syllable-built words (frequent ones shorter) follow a sparse Markov chain: each word has
    `branching` possible successors drawn from a Zipf prior, picked with Zipf-decaying weights; each
    word has its own chance of ending the sentence or taking a comma. So a bigram model predicts much
    better than word frequencies alone, and word frequencies come out roughly Zipfian.
    """
    rng = np.random.Generator(np.random.PCG64([seed, 0]))
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < vocab:
        n_syl = 1 + min(2, int(rng.exponential(0.3 + 1.2 * len(words) / vocab)))
        w = "".join(str(rng.choice(_ONSETS)) + str(rng.choice(_NUCLEI)) + str(rng.choice(_CODAS)) for _ in range(n_syl))
        if len(w) > 1 and w not in seen:
            seen.add(w)
            words.append(w)
    prior = 1.0 / np.arange(1, vocab + 1) ** 0.8
    prior /= prior.sum()
    succ = np.stack([rng.choice(vocab, branching, replace=False, p=prior) for _ in range(vocab + 1)])
    slot_p = 1.0 / np.arange(1, branching + 1) ** 1.2
    slot_p /= slot_p.sum()
    end_p = rng.beta(1.5, 12.0, vocab)  # sentences of about ten words
    comma_p = rng.beta(1.0, 25.0, vocab)
    lang = (words, succ.tolist(), slot_p, end_p.tolist(), comma_p.tolist())
    valid_words = max(1, round(n_words * _VALID_FRACTION))
    return (
        _generate(lang, n_words, np.random.Generator(np.random.PCG64([seed, 1]))),
        _generate(lang, valid_words, np.random.Generator(np.random.PCG64([seed, 2]))),
    )


def _generate(lang: tuple, n: int, rng: np.random.Generator) -> str:
    """Walk the chain for `n` words; row `vocab` of the successor table holds the sentence starters."""
    words, succ, slot_p, end_p, comma_p = lang
    start = len(words)
    slots = rng.choice(len(slot_p), n, p=slot_p).tolist()
    u = rng.random(n).tolist()
    v = rng.random(n).tolist()
    parts = []
    w = succ[start][slots[0]]
    cap = True
    for t in range(n):
        s = words[w].capitalize() if cap else words[w]
        if u[t] < end_p[w]:
            parts.append(s + (".\n" if v[t] < 0.15 else ". "))
            w, cap = succ[start][slots[t]], True
        else:
            parts.append(s + (", " if v[t] < comma_p[w] else " "))
            w, cap = succ[w][slots[t]], False
    return "".join(parts).rstrip(" ,.\n") + ".\n"


# --------------------------------------------------------------------------- sampling


class TokenStream:
    """One split, memory-mapped: seq_len + 1 token windows addressed by global sample index."""

    def __init__(self, path: str, seq_len: int, seed: int, batch: BatchFn = next_token_batch) -> None:
        self.path = path
        self.batch = batch  # the model family's (windows, sample ids) -> (inputs, targets)
        self.seq_len = seq_len
        self.seed = seed
        self.tokens = np.load(path, mmap_mode="r")
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"{path}: {len(self.tokens)} tokens, too few for one window of {seq_len + 1}")
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Windows per epoch."""
        return self.n

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n)
        return self._perms[epoch]

    def windows(self, ks: np.ndarray, ids: np.ndarray | None = None) -> Batch:
        """Windows `ks` (positions in the unpermuted split) as the family's inputs and targets, e.g.
        LongTensor [len(ks), seq_len] each; `ids` are the samples' global indices (default `ks`)."""
        ks = np.asarray(ks, dtype=np.int64)
        offsets = ks[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        w = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return self.batch(w, torch.from_numpy(ks if ids is None else ids))

    def samples(self, start: int, count: int) -> Batch:
        """Global sample indices [start, start + count): inputs [count, seq_len], targets shifted by one."""
        idx = np.arange(start, start + count, dtype=np.int64)
        epochs, js = np.divmod(idx, self.n)
        ks = np.empty_like(idx)
        for e in np.unique(epochs):
            sel = epochs == e
            ks[sel] = self._perm(int(e))[js[sel]]
        return self.windows(ks, idx)


def _split(batch: Batch, mbs: int) -> list[Batch]:
    return list(zip(batch[0].split(mbs), batch[1].split(mbs)))


def replica_microbatches(stream: TokenStream, consumed: int, gbs: int, dp: int, dp_rank: int, mbs: int) -> list[Batch]:
    """Replica `dp_rank`'s micro-batches of the step whose global batch is samples [consumed, consumed + gbs):
    the contiguous slice [consumed + r*gbs/dp, consumed + (r+1)*gbs/dp) in gbs/(dp*mbs) micro-batches of mbs."""
    if gbs % (dp * mbs):
        raise ValueError(f"gbs {gbs} is not a multiple of dp*mbs = {dp * mbs}")
    per = gbs // dp
    return _split(stream.samples(consumed + dp_rank * per, per), mbs)


def eval_batches(
    path: str,
    seq_len: int,
    eval_tokens: int,
    gbs: int,
    dp: int,
    dp_rank: int,
    mbs: int,
    batch: BatchFn = next_token_batch,
) -> list[list[Batch]]:
    """The fixed validation slice (the first max(1, eval_tokens // seq_len) windows, the same under every
    layout) cut into steps of gbs samples; each step is replica `dp_rank`'s micro-batches of mbs, like a
    training step. The last step is padded: inputs with token 0, targets with IGNORE_INDEX (no loss)."""
    stream = TokenStream(path, seq_len, seed=0, batch=batch)
    n = max(1, eval_tokens // seq_len)
    if len(stream) < n:
        raise DataError(f"{path}: {len(stream)} windows of {seq_len + 1} tokens, eval_tokens needs {n}")
    x, y = stream.windows(np.arange(n))
    pad = -n % gbs
    if pad:
        x = torch.cat([x, torch.zeros(pad, seq_len, dtype=x.dtype)])
        y = torch.cat([y, torch.full((pad, seq_len), IGNORE_INDEX, dtype=y.dtype)])
    per = gbs // dp
    steps = []
    for start in range(0, n + pad, gbs):
        lo = start + dp_rank * per
        steps.append(_split((x[lo : lo + per], y[lo : lo + per]), mbs))
    return steps
