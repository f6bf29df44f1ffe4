"""Where a corpus comes from: `data.path` (a folder, a file, a glob or a Megatron prefix) resolved to a
format and its train/valid inputs, and those inputs read one document at a time (never a whole corpus).

A document is a `str` (text, JSONL, a `datasets` text column) or a 1-D integer array of token ids
(nanoGPT .bin, .npy, Megatron .bin/.idx, a `datasets` input_ids column). See docs/data.md.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("auto", "text", "jsonl", "bin", "npy", "megatron", "hf")
EXTENSIONS = {
    "text": (".txt", ".text", ".raw"),
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "npy": (".npy",),
    "megatron": (".idx",),
    "bin": (".bin",),
}
TOKENIZED = ("bin", "npy", "megatron")
FLAT_DOC_TOKENS = 4096  # a flat token array (.bin, .npy) has no document boundaries: it splits in chunks of this
_VALID_WORDS = {"val", "valid", "validation", "dev"}
_SKIP_WORDS = {"test"}
_HF_VALID = ("validation", "valid", "val")


class DataError(ValueError):
    """A corpus problem; the message is one line naming the field, file or folder."""


@dataclass(frozen=True)
class Source:
    """A resolved `data.path`: its format and inputs. `valid` empty: the validation split is taken from
    `train` by document. For `hf`, the inputs are the save_to_disk folder and the split names."""

    format: str
    root: Path  # the folder the inputs live in (the cache goes beside them when it may)
    train: tuple[Path, ...]
    valid: tuple[Path, ...] = ()
    hf_splits: tuple[str | None, str | None] = (None, None)
    hf_tokens: bool = False  # an `hf` dataset of input_ids (else a text column)
    key_files: tuple[Path, ...] = field(default=())

    @property
    def tokenized(self) -> bool:
        return self.format in TOKENIZED or (self.format == "hf" and self.hf_tokens)


def _words(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower()))


def _format_of(path: Path) -> str | None:
    name = path.name.lower()
    for fmt, exts in EXTENSIONS.items():
        if name.endswith(exts):
            if fmt == "bin" and path.with_suffix(".idx").is_file():
                return None  # a Megatron .bin: its .idx names the dataset
            return fmt
    return None


def _is_hf_folder(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _expand(spec: str, where: str, fmt: str) -> tuple[Path, list[Path]]:
    """(root, inputs) of one `data.path` / `data.valid_path` value."""
    p = Path(spec).expanduser()
    if glob.has_magic(spec):
        found = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not found:
            raise DataError(f"{where}: {spec}: no file matches")
        return found[0].parent, found
    if p.is_dir():
        if fmt in ("auto", "hf") and _is_hf_folder(p):
            return p, [p]
        found = sorted(
            f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        return p, found
    if p.is_file():
        return p.parent, [p]
    if Path(f"{p}.idx").is_file():  # a Megatron prefix
        return p.parent, [Path(f"{p}.idx")]
    raise DataError(f"{where}: {p}: no such file or folder")


def _pick_format(files: list[Path], fmt: str, where: str, spec: str) -> tuple[str, list[Path]]:
    idx = [f.with_suffix(".idx") if f.suffix == ".bin" and f.with_suffix(".idx").is_file() else f for f in files]
    files = list(dict.fromkeys(idx))  # a Megatron dataset is named by its .idx
    if fmt != "auto":
        if len(files) == 1:
            return fmt, files
        typed = [f for f in files if _format_of(f) == fmt]
        if not typed:
            exts = ", ".join(EXTENSIONS.get(fmt, ()))
            raise DataError(f"{where}: {spec}: no {fmt} files ({exts})")
        return fmt, typed
    kinds: dict[str, list[Path]] = {}
    for f in files:
        k = _format_of(f)
        if k is not None:
            kinds.setdefault(k, []).append(f)
    if not kinds:
        raise DataError(f"{where}: {spec}: no data files (.txt, .jsonl, .npy, .bin, .idx or a datasets folder)")
    if len(kinds) > 1:
        raise DataError(f"{where}: {spec}: files of several formats ({', '.join(sorted(kinds))}); set data.format")
    ((k, typed),) = kinds.items()
    return k, typed


def resolve(data: Any) -> Source:
    """`data` (a DataConfig with a path) -> its Source. Files named with a word val/valid/validation/dev
    are the validation split, with test they are left out, the rest is training data."""
    if data.format not in FORMATS:
        raise DataError(f"data.format: must be one of {', '.join(FORMATS)}, got {data.format!r}")
    root, found = _expand(data.path, "data.path", data.format)
    if len(found) == 1 and found[0].is_dir():  # a datasets folder
        return _hf_source(found[0], data)
    fmt, files = _pick_format(found, data.format, "data.path", data.path)
    if fmt == "hf":
        raise DataError(f"data.path: {data.path}: not a datasets.save_to_disk folder (no dataset_info.json)")
    if data.valid_path is not None:
        _, vfound = _expand(data.valid_path, "data.valid_path", fmt)
        _, valid = _pick_format(vfound, fmt, "data.valid_path", data.valid_path)
        train = files
    else:
        many = len(files) > 1
        valid = [f for f in files if many and _words(f.name) & _VALID_WORDS]
        train = [f for f in files if f not in valid and not (many and _words(f.name) & _SKIP_WORDS)]
        if not train:
            raise DataError(f"data.path: {data.path}: no training files (all are named valid or test)")
    inputs = [*train, *valid]
    key = [q for f in inputs for q in ((f, f.with_suffix(".bin")) if fmt == "megatron" else (f,))]
    for f in key:
        if not f.is_file():
            raise DataError(f"{f}: missing")
        if f.stat().st_size == 0:
            raise DataError(f"{f}: empty")
    return Source(fmt, root, tuple(train), tuple(valid), key_files=tuple(key))


def _hf_source(folder: Path, data: Any) -> Source:
    ds = load_hf(folder)
    if hasattr(ds, "keys"):  # a DatasetDict
        splits = list(ds.keys())
        train_split = "train" if "train" in splits else splits[0]
        valid_split = next((s for s in _HF_VALID if s in splits), None)
        columns = ds[train_split].column_names
    else:
        train_split, valid_split, columns = None, None, ds.column_names
    if data.text_key in columns:
        tokens = False
    elif "input_ids" in columns:
        tokens = True
    else:
        raise DataError(f"{folder}: no {data.text_key!r} or 'input_ids' column (columns: {', '.join(columns)})")
    if data.valid_path is not None:
        raise DataError("data.valid_path: a datasets folder takes its validation split from its own splits")
    key = tuple(sorted(f for f in folder.rglob("*") if f.is_file() and not f.name.startswith(".")))
    return Source("hf", folder, (folder,), (), (train_split, valid_split), tokens, key)


def load_hf(folder: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.path: {folder}: a datasets folder needs the datasets package (pip install 'cona[hf]')"
        ) from None
    datasets.disable_progress_bars()
    try:
        return datasets.load_from_disk(str(folder))
    except Exception as e:
        raise DataError(f"{folder}: cannot load it with datasets.load_from_disk ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- reading documents


def text_documents(path: Path, separator: str) -> Iterator[str]:
    """The documents of a UTF-8 text file. `separator`: blank (a line of only whitespace ends a document),
    line (each non-blank line is one), file (the file is one), or a literal string between documents."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if separator == "file":
                text = f.read().strip("\n")
                if text.strip():
                    yield text
            elif separator == "line":
                for line in f:
                    if line.strip():
                        yield line.rstrip("\r\n")
            elif separator == "blank":
                lines: list[str] = []
                for line in f:
                    if line.strip():
                        lines.append(line)
                    elif lines:
                        yield "".join(lines).rstrip("\r\n")
                        lines = []
                if lines:
                    yield "".join(lines).rstrip("\r\n")
            else:
                rest = ""
                while chunk := f.read(1 << 20):
                    parts = (rest + chunk).split(separator)
                    rest = parts.pop()
                    yield from (p.strip("\n") for p in parts if p.strip())
                if rest.strip():
                    yield rest.strip("\n")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None


def jsonl_documents(path: Path, key: str) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise DataError(f"{path}:{n}: not a JSON object") from None
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise DataError(f"{path}:{n}: no {key!r} string field (data.text_key)")
                if row[key]:
                    yield row[key]
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except (OSError, EOFError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read ({e})") from None


def _chunks(tokens: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(tokens), FLAT_DOC_TOKENS):
        yield tokens[start : start + FLAT_DOC_TOKENS]


def bin_documents(path: Path, dtype: str | None) -> Iterator[np.ndarray]:
    if dtype is None:
        raise DataError(f"data.dtype: required for the raw tokens of {path} (uint16, uint32 or int32)")
    size = np.dtype(dtype).itemsize
    if path.stat().st_size % size:
        raise DataError(f"{path}: {path.stat().st_size} bytes is not a whole number of {dtype} tokens (data.dtype)")
    yield from _chunks(np.memmap(path, dtype=dtype, mode="r"))


def npy_documents(path: Path) -> Iterator[np.ndarray]:
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a .npy array ({e})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"{path}: a .npy of shape {tokens.shape} and dtype {tokens.dtype}; expected 1-D integer tokens")
    yield from _chunks(tokens)


def megatron_documents(idx: Path) -> Iterator[np.ndarray]:
    """A Megatron indexed dataset's documents (each the concatenation of its sequences), read with
    megatron-core's own `IndexedDataset`."""
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": not used here
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError:
        raise DataError(f"{idx}: Megatron datasets need megatron-core (pip install 'cona[megatron]')") from None
    prefix = str(idx)[: -len(".idx")]
    try:
        ds = IndexedDataset(prefix)
    except Exception as e:
        raise DataError(f"{idx}: not a Megatron indexed dataset ({type(e).__name__}: {e})") from None
    bounds = ds.document_indices
    for d in range(len(bounds) - 1):
        lo, hi = int(bounds[d]), int(bounds[d + 1])
        parts = [ds[i] for i in range(lo, hi)]
        if parts:
            yield parts[0] if len(parts) == 1 else np.concatenate(parts)


def hf_documents(folder: Path, split: str | None, key: str, tokens: bool) -> Iterator[str | np.ndarray]:
    ds = load_hf(folder)
    if split is not None:
        ds = ds[split]
    column = "input_ids" if tokens else key
    for batch in ds.select_columns([column]).iter(batch_size=1024):
        for doc in batch[column]:
            if tokens:
                yield np.asarray(doc, dtype=np.int64)
            elif doc:
                yield doc


def documents(src: Source, data: Any, split: str) -> Iterator[str | np.ndarray]:
    """The documents of `split` ("train" or "valid") of `src`, in order."""
    if src.format == "hf":
        name = src.hf_splits[0] if split == "train" else src.hf_splits[1]
        if split == "valid" and name is None:
            return
        yield from hf_documents(src.root, name, data.text_key, src.hf_tokens)
        return
    for path in src.train if split == "train" else src.valid:
        if src.format == "text":
            yield from text_documents(path, data.doc_separator)
        elif src.format == "jsonl":
            yield from jsonl_documents(path, data.text_key)
        elif src.format == "bin":
            yield from bin_documents(path, data.dtype)
        elif src.format == "npy":
            yield from npy_documents(path)
        else:
            yield from megatron_documents(path)


def has_valid(src: Source) -> bool:
    return bool(src.valid) if src.format != "hf" else src.hf_splits[1] is not None
