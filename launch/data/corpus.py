"""Corpus preparation (synthetic, or `data.path` in one of the formats of docs/data.md), the
content-keyed token cache, and sample indexing.

The controller calls `prepare_corpus` once; it writes memory-mapped token arrays (.npy: uint16 while
the vocabulary fits, else uint32) into a cache folder keyed by the corpus content, the tokenizer and
the preparation settings. Documents stream through it in batches (never the whole corpus in
memory): tokenized in parallel (`encode_batch`) and appended to the arrays as they go. Workers read
the arrays with `TokenStream`.

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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cona_core.config import DataConfig
from cona_core.rundir import cache_root
from launch.data import sources, tokenize
from launch.data.sources import DataError
from launch.data.synthetic import synthetic_corpus

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1  # bump when the synthetic corpus's cache layout or tokenization changes
_SOURCE_VERSION = 2  # bump when the preparation of a `data.path` corpus changes
_SYNTHETIC_VERSION = 1  # bump when the synthetic language generator changes
_BATCH_CHARS = 1 << 22  # text per encode_batch call (~4 MB)
_BATCH_DOCS = 8192


@dataclass(frozen=True)
class CorpusInfo:
    """A prepared corpus: token arrays (.npy, uint16 or uint32), tokenizer JSON (None: bytes of the
    synthetic corpus, or pre-tokenized data without one) and sizes. `vocab_size` is the tokenizer's;
    the model pads its embedding to a multiple of 128 (`launch.models.padded_vocab`)."""

    train_path: str
    valid_path: str
    tokenizer_path: str | None
    vocab_size: int
    n_train_tokens: int
    n_valid_tokens: int
    key: str
    eos_id: int | None = None
    pretokenized: bool = False  # token ids given (bin, npy, megatron, hf input_ids), no tokenizer of their own

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CorpusInfo:
        return cls(**json.loads(text))


# --------------------------------------------------------------------------- corpus preparation


def prepare_corpus(data: DataConfig, seed: int = 0, special_tokens: tuple[str, ...] = ()) -> CorpusInfo:
    """Runs once in the controller before launch (idempotent, cached). `special_tokens` (the model
    family's) take the last ids of the vocabulary and are part of the cache key. Raises DataError (a
    ValueError subclass, one-line message naming the field, file or folder) for bad input."""
    if data.path is None:
        return _prepare_synthetic(data, seed, special_tokens)
    src = sources.resolve(data)
    recipe: dict[str, object] = {
        "source": _SOURCE_VERSION,
        "format": src.format,
        "files": [
            [str(f.relative_to(src.root)) if f.is_relative_to(src.root) else f.name, _file_sha(f)]
            for f in src.key_files
        ],
        "valid_files": len(src.valid),
        "special_tokens": list(special_tokens),
    }
    if not sources.has_valid(src):
        recipe.update(valid_fraction=data.valid_fraction, valid_seed=data.valid_seed)
    if src.format == "text":
        recipe["separator"] = data.doc_separator
    if src.format in ("jsonl", "hf"):
        recipe["text_key"] = data.text_key
    if src.format == "bin":
        recipe["dtype"] = data.dtype
    text_tok: tokenize.TextTokenizer | None = None
    if data.tokenizer in ("bpe", "byte"):
        recipe["tokenizer"] = data.tokenizer
        if data.tokenizer == "bpe":
            recipe["vocab"] = data.vocab_size
    else:
        text_tok = tokenize.load(data.tokenizer, special_tokens)
        recipe["tokenizer"] = tokenize.fingerprint(Path(data.tokenizer).expanduser())
    if data.cache_dir:
        base = Path(data.cache_dir)
    elif os.access(src.root, os.W_OK) and "shared" not in src.root.resolve().parts:
        base = src.root / ".cona-cache"
    else:
        base = cache_root()
    key = _digest(recipe)

    def build(tmp: Path) -> dict[str, int | None]:
        return _build(tmp, src, data, text_tok, special_tokens)

    return _cached((base / f"{src.root.resolve().name}-{key}").expanduser().absolute(), key, build)


def _build(
    out: Path,
    src: sources.Source,
    data: DataConfig,
    tok: tokenize.TextTokenizer | None,
    special_tokens: tuple[str, ...],
) -> dict[str, int | None]:
    t0 = time.perf_counter()
    split = _Splitter(data.valid_fraction, data.valid_seed) if not sources.has_valid(src) else None

    def split_docs(which: str) -> Iterator[tuple[int, str | np.ndarray]]:
        """(0 train | 1 valid, document) of one input split, the validation split drawn by document."""
        for i, doc in enumerate(sources.documents(src, data, which)):
            yield (split(i) if split else int(which == "valid")), doc

    if src.tokenized:
        if tok is not None:
            vocab, eos = tok.vocab_size, tok.eos
        else:  # no tokenizer: data.vocab_size (bpe) or the bytes say how many ids there are
            vocab, eos = (256 if data.tokenizer == "byte" else data.vocab_size) + len(special_tokens), None
    else:
        if tok is None and data.tokenizer == "byte":
            tok = tokenize.byte(special_tokens)
        elif tok is None:
            train_docs = (d for which in ("train", "valid") for s, d in split_docs(which) if s == 0)
            tok = tokenize.train_bpe(train_docs, data.vocab_size, special_tokens)
            log.info("BPE (%d tokens) trained in %.1fs", tok.vocab_size, time.perf_counter() - t0)
        vocab, eos = tok.vocab_size, tok.eos
    if tok is not None:
        tok.save(out)
    dtype = tokenize.token_dtype(vocab)
    writers = [tokenize.TokenWriter(out / "train.npy", dtype), tokenize.TokenWriter(out / "valid.npy", dtype)]
    with _progress(src) as advance:
        for which in ("train", "valid"):
            batch: list[tuple[int, str]] = []
            chars = 0
            for s, doc in split_docs(which):
                if isinstance(doc, str):
                    if tok is None:
                        raise DataError(f"data.tokenizer: {data.tokenizer}: cannot tokenize text")
                    batch.append((s, doc))
                    chars += len(doc)
                    if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
                        _write_text(batch, tok, writers, advance)
                        batch, chars = [], 0
                else:
                    _write_tokens(doc, s, vocab, writers, src, advance)
            if batch:
                _write_text(batch, tok, writers, advance)
    n_train, n_valid = (w.close() for w in writers)
    if n_train == 0:
        raise DataError(f"data.path: {data.path}: no training tokens (empty documents, or all drawn for validation)")
    if n_valid == 0:
        why = "no validation documents" if split is None else "no document drawn for validation"
        raise DataError(f"data.valid_fraction: {why} in {data.path}; raise it or give data.valid_path")
    log.info(
        "corpus %s (%s): %d + %d tokens (%s) in %.1fs",
        data.path, src.format, n_train, n_valid, dtype.name, time.perf_counter() - t0,
    )  # fmt: skip
    meta = {"vocab_size": vocab, "n_train_tokens": n_train, "n_valid_tokens": n_valid, "eos_id": eos}
    return {**meta, "pretokenized": tok is None}


def _write_text(
    batch: list[tuple[int, str]], tok: tokenize.TextTokenizer, writers: list, advance: Callable[[int], None]
) -> None:
    for (s, _), ids in zip(batch, tok.encode([d for _, d in batch])):
        writers[s].write(ids)
    advance(sum(len(d) for _, d in batch))


def _write_tokens(doc: np.ndarray, s: int, vocab: int, writers: list, src: sources.Source, advance) -> None:
    if len(doc) == 0:
        return
    hi, lo = int(doc.max()), int(doc.min())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise DataError(
            f"data.path: {src.root}: token id {bad} outside the vocabulary of {vocab} "
            "(set data.tokenizer to the data's tokenizer, or data.vocab_size)"
        )
    writers[s].write(doc)
    advance(doc.nbytes)


class _Splitter:
    """Seeded draw of the validation documents: document i is validation with probability `fraction`,
    from a stream that depends on i only (so two passes over the documents agree)."""

    BLOCK = 4096

    def __init__(self, fraction: float, seed: int) -> None:
        self.fraction, self.seed = fraction, seed
        self.block, self.u = -1, np.empty(0)

    def __call__(self, i: int) -> int:
        b, j = divmod(i, self.BLOCK)
        if b != self.block:
            self.block, self.u = b, np.random.Generator(np.random.PCG64([self.seed, b])).random(self.BLOCK)
        return int(self.u[j] < self.fraction)


class _progress:
    """A rich progress bar over the input bytes, on a terminal only."""

    def __init__(self, src: sources.Source) -> None:
        self.total = sum(f.stat().st_size for f in src.key_files)
        self.bar = None

    def __enter__(self) -> Callable[[int], None]:
        if not sys.stderr.isatty():
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        self.bar = Progress(
            "preparing the corpus", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=True,
        )  # fmt: skip
        task = self.bar.add_task("prepare", total=self.total)
        self.bar.start()
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _digest(recipe: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cached(out: Path, key: str, build: Callable[[Path], dict[str, int | None]]) -> CorpusInfo:
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
        eos_id=meta.get("eos_id"),
        pretokenized=meta.get("pretokenized", False),
    )


# --------------------------------------------------------------------------- the synthetic corpus


def _prepare_synthetic(data: DataConfig, seed: int, special_tokens: tuple[str, ...]) -> CorpusInfo:
    """The synthetic language, tokenized as it always was (no EOS: its text has no documents)."""
    vocab = 256 if data.tokenizer == "byte" else data.vocab_size
    recipe: dict[str, object] = {"format": _FORMAT_VERSION, "tokenizer": data.tokenizer, "vocab": vocab}
    if special_tokens:
        recipe["special_tokens"] = list(special_tokens)
    recipe.update(synthetic=_SYNTHETIC_VERSION, words=data.synthetic_tokens, seed=seed)
    base = Path(data.cache_dir) if data.cache_dir else cache_root()
    if data.tokenizer not in ("bpe", "byte"):
        raise DataError("data.tokenizer: the synthetic corpus (no data.path) takes bpe or byte")

    def build(tmp: Path) -> dict[str, int | None]:
        t0 = time.perf_counter()
        train, valid = synthetic_corpus(data.synthetic_tokens, seed)
        (tmp / "train.txt").write_text(train, encoding="utf-8")
        (tmp / "valid.txt").write_text(valid, encoding="utf-8")
        log.info("synthetic corpus: %d words in %.1fs", data.synthetic_tokens, time.perf_counter() - t0)
        return _tokenize(tmp, tmp / "train.txt", tmp / "valid.txt", data.tokenizer, vocab, special_tokens)

    key = _digest(recipe)
    return _cached((base / f"synthetic-{key}").expanduser().absolute(), key, build)


def _tokenize(
    out: Path, train: Path, valid: Path, kind: str, vocab_size: int, special_tokens: tuple[str, ...] = ()
) -> dict[str, int | None]:
    """The synthetic corpus's train.npy / valid.npy (uint16) and, for BPE, tokenizer.json in `out`.
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
            "train": train.read_text(encoding="utf-8").splitlines(keepends=True),
            "valid": valid.read_text(encoding="utf-8").splitlines(keepends=True),
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
