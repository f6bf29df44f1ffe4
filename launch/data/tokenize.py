"""Tokenizers (`data.tokenizer: bpe | byte | PATH | hub name`) and the incremental writer of token arrays.

Every corpus with text gets a `tokenizer.json` in its cache folder (what `cona export` copies), and
its documents are separated by the tokenizer's end-of-document token: the tokenizer's own
post-processor runs on each document (e.g. Llama 3's `<|begin_of_text|>` before it, BERT's [CLS] ...
[SEP] around it) and the EOS follows unless the post-processor already ended the document with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cona_core.config import HUB_NAME
from launch.data.sources import DataError

# End-of-document tokens by their conventional text, in the order they are looked for.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
CONA_EOS = "<|endoftext|>"  # the EOS that `bpe` and `byte` get (GPT-2's), unless the family brings [SEP]
UINT16_MAX_VOCAB = 1 << 16


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_MAX_VOCAB else np.uint32)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what a byte-level BPE's vocabulary spells)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer(special_tokens: Iterable[str]) -> Tokenizer:
    """The `tokenizer: byte` encoding as a tokenizers JSON: token id = the UTF-8 byte, no merges; the
    special tokens take ids 256, 257, ... in their order."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    return tok


def vocab_of(tok: Tokenizer) -> int:
    """Ids in use: one more than the largest (a vocabulary may have holes)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


@dataclass
class TextTokenizer:
    """What turns documents into ids: the tokenizers object (None for `byte`), its vocabulary and EOS."""

    tok: Tokenizer | None
    vocab_size: int
    eos: int | None
    config: dict | None = None  # a tokenizer folder's tokenizer_config.json (kept for `cona export`)
    byte_specials: tuple[str, ...] = ()  # `byte`: the tokens after the 256 bytes

    def encode(self, docs: list[str]) -> list[np.ndarray]:
        """Each document's ids (the tokenizer's post-processing, then the EOS), in one parallel batch."""
        if self.tok is None:
            out = [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.int64) for d in docs]
        else:
            out = [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch_fast(docs)]
        if self.eos is None:
            return out
        return [ids if len(ids) and ids[-1] == self.eos else np.append(ids, self.eos) for ids in out]

    def save(self, folder: Path) -> None:
        tok = self.tok if self.tok is not None else byte_tokenizer(self.byte_specials)
        tok.save(str(folder / "tokenizer.json"))
        if self.config is not None:
            (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")


def cona_eos(special_tokens: tuple[str, ...]) -> tuple[str, ...]:
    """The tokens `bpe` and `byte` add before the family's: GPT-2's EOS, unless the family has [SEP]."""
    return () if "[SEP]" in special_tokens else (CONA_EOS,)


def byte(special_tokens: tuple[str, ...]) -> TextTokenizer:
    added = cona_eos(special_tokens) + special_tokens
    eos = 256 + added.index("[SEP]" if "[SEP]" in added else CONA_EOS)
    return TextTokenizer(None, 256 + len(added), eos, byte_specials=added)


def train_bpe(docs: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...]) -> TextTokenizer:
    """A byte-level BPE (GPT-2 pre-tokenization, lossless decoding) of `vocab_size` ids in all, trained
    on `docs` as they stream by; EOS and the family's specials take its last ids."""
    added = cona_eos(special_tokens) + special_tokens
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added), show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer)
    tok.add_special_tokens(list(added))
    return TextTokenizer(tok, vocab_of(tok), tok.token_to_id("[SEP]" if "[SEP]" in added else CONA_EOS))


def tokenizer_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())


def fingerprint(path: Path) -> str:
    """A content key of a tokenizer file or folder."""
    h = hashlib.sha256()
    for f in tokenizer_files(path):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


def tokenizer_location(spec: str) -> Path:
    """What `data.tokenizer` names: a local file or folder, else (a hub name `ORG/NAME`) the tokenizer.json
    of its snapshot in the hub cache, `models--ORG--NAME/snapshots/REV/` (REV: refs/main's, else the newest),
    offline. DataError naming the name and the folder searched when neither exists."""
    path = Path(spec).expanduser()
    if path.exists() or not HUB_NAME.fullmatch(spec):
        return path
    snapshots = hub_cache() / f"models--{spec.replace('/', '--')}" / "snapshots"
    main = snapshots.parent / "refs" / "main"
    revs = [snapshots / main.read_text().strip()] if main.is_file() else []
    if snapshots.is_dir():
        revs += sorted(snapshots.iterdir(), key=lambda d: d.stat().st_mtime, reverse=True)
    found = next((d / "tokenizer.json" for d in revs if (d / "tokenizer.json").is_file()), None)
    if found is None:
        raise DataError(
            f"data.tokenizer: {spec}: no such file or folder, nor a tokenizer.json of the hub model {spec} in "
            f"{snapshots} (HF_HOME's cache; nothing is downloaded: fetch it once, e.g. `hf download {spec} "
            "tokenizer.json`)"
        )
    return found


def load(spec: str, special_tokens: tuple[str, ...]) -> TextTokenizer:
    """`data.tokenizer: PATH`: a tokenizer.json (tokenizers) or a tokenizer folder (transformers, offline).
    The family's special tokens are added when missing; they must end up as the last ids."""
    path = Path(spec).expanduser()
    where = f"data.tokenizer: {spec}"
    if not path.exists():
        raise DataError(f"{where}: no such file or folder")
    config = None
    if path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DataError(f"{where}: cannot load it as a tokenizer.json ({_first_line(e)})") from None
        eos = next((tok.token_to_id(t) for t in EOS_TOKENS if tok.token_to_id(t) is not None), None)
    else:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"{where}: a tokenizer folder needs transformers (pip install 'cona[hf]')") from None
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise DataError(f"{where}: transformers cannot load it ({_first_line(e)})") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise DataError(f"{where}: transformers gives no fast tokenizer for it (a tokenizer.json is needed)")
        tok = Tokenizer.from_str(backend.to_str())
        eos = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = {k: v for k, v in json.loads(cfg_file.read_text()).items() if k != "added_tokens_decoder"}
    if special_tokens:
        missing = [t for t in special_tokens if tok.token_to_id(t) is None]
        tok.add_special_tokens(missing)
        vocab = vocab_of(tok)
        ids = [tok.token_to_id(t) for t in special_tokens]
        if ids != list(range(vocab - len(special_tokens), vocab)):
            raise DataError(
                f"{where}: the model family needs {', '.join(special_tokens)} as the last {len(special_tokens)} ids "
                f"of the vocabulary; they are {ids} of {vocab}"
            )
        if eos is None and "[SEP]" in special_tokens:
            eos = tok.token_to_id("[SEP]")
    return TextTokenizer(tok, vocab_of(tok), eos, config)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# --------------------------------------------------------------------------- writing


class TokenWriter:
    """A .npy token array written as it grows: a fixed-size header (rewritten at the end) and the ids
    appended in their dtype, so memory holds one batch at a time."""

    HEADER = 128

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.n = 0
        self.f = open(path, "wb")
        self.f.write(self._header(0))

    def _header(self, n: int) -> bytes:
        text = f"{{'descr': '{np.lib.format.dtype_to_descr(self.dtype)}', 'fortran_order': False, 'shape': ({n},), }}"
        text = text.ljust(self.HEADER - 10 - 1) + "\n"
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")

    def write(self, ids: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.n += len(ids)

    def close(self) -> int:
        self.f.seek(0)
        self.f.write(self._header(self.n))
        self.f.close()
        return self.n
