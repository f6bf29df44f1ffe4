"""Benchmark: preparing a large text corpus, streamed: peak memory and tokens/s against the tokenizer's own.

Builds a corpus of `--mb` megabytes by repeating a text folder's `train.txt` (WikiText-2 by default), gets
a BPE trained on the folder's own training text (`data.tokenizer: bpe` on the original, a few seconds),
then times `cona`'s preparation of the large corpus with that `tokenizer.json` (`data.tokenizer: PATH`) in
a child process, and prints its peak RSS, its tokens/s and, on the first `--raw-mb` megabytes of the same
text, the raw rate of `tokenizers`' `encode_batch_fast` over the same 4 MB batches with all cores: the
ratio shows what reading, splitting and writing cost beside tokenizing.

    python scripts/bench_prepare.py [--data ../shared/data/wikitext-2-raw] [--mb 500] [--raw-mb 100]
        [--vocab 8192] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BATCH_CHARS = 1 << 22  # what the preparation hands encode_batch at once (launch.data.corpus)

CHILD = """
import json, sys, time
from cona_core.config import DataConfig
from launch.data.corpus import prepare_corpus
t0 = time.perf_counter()
info = prepare_corpus(DataConfig(path=sys.argv[1], tokenizer=sys.argv[2], valid_path=sys.argv[3]))
print(json.dumps({"seconds": time.perf_counter() - t0, "train_tokens": info.n_train_tokens,
                  "valid_tokens": info.n_valid_tokens, "vocab": info.vocab_size}))
"""


def build_corpus(source: Path, out: Path, mb: int) -> int:
    """`out/train.txt` of at least `mb` MB from repeats of `source`/train.txt; returns its bytes."""
    text = (source / "train.txt").read_bytes()
    target = mb * 1_000_000
    written = 0
    with open(out / "train.txt", "wb") as f:
        while written < target:
            f.write(text)
            written += len(text)
    return written


def trained_tokenizer(source: Path, vocab: int, cache: Path) -> Path:
    """The BPE that `data.tokenizer: bpe` trains on the source folder, saved as tokenizer.json."""
    from cona_core.config import DataConfig
    from launch.data.corpus import prepare_corpus

    info = prepare_corpus(DataConfig(path=str(source), vocab_size=vocab, cache_dir=str(cache)))
    assert info.tokenizer_path is not None  # a BPE was trained
    return Path(info.tokenizer_path)


def raw_rate(tokenizer: Path, text_file: Path, mb: int) -> tuple[float, int]:
    """Tokens/s of encode_batch_fast over the first `mb` MB of the file, in the preparation's batches."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tokens, seconds, read = 0, 0.0, 0
    with open(text_file, encoding="utf-8") as f:
        while read < mb * 1_000_000:
            lines = f.readlines(BATCH_CHARS)
            if not lines:
                break
            read += sum(len(line) for line in lines)
            t0 = time.perf_counter()
            tokens += sum(len(e.ids) for e in tok.encode_batch_fast(lines))
            seconds += time.perf_counter() - t0
    return tokens / seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "wikitext-2-raw")
    ap.add_argument("--mb", type=int, default=500, help="size of the corpus to prepare, MB")
    ap.add_argument("--raw-mb", type=int, default=100, help="MB of it that the raw tokenizer rate is taken on")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--keep", type=Path, help="build the corpus and the cache here and keep them")
    args = ap.parse_args()
    if not (args.data / "train.txt").is_file() or not (args.data / "valid.txt").is_file():
        sys.exit(f"bench_prepare.py: --data {args.data}: needs train.txt and valid.txt")
    if args.mb < 1 or args.raw_mb < 1:
        sys.exit("bench_prepare.py: --mb and --raw-mb must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        corpus = root / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        size = build_corpus(args.data, corpus, args.mb)
        tokenizer = trained_tokenizer(args.data, args.vocab, root / "bpe-cache")
        env = {**os.environ, "PYTHONPATH": str(REPO), "CONA_CACHE": str(root / "cache")}
        child = [sys.executable, "-c", CHILD, str(corpus), str(tokenizer), str(args.data / "valid.txt")]
        proc = subprocess.run(child, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench_prepare.py: the preparation failed:\n{proc.stderr[-3000:]}")
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the one child: the preparation
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        rate = got["train_tokens"] / got["seconds"]
        raw, raw_tokens = raw_rate(tokenizer, corpus / "train.txt", min(args.raw_mb, args.mb))
        print(f"corpus: {size / 1e6:.0f} MB of text ({args.data.name} train.txt repeated), {os.cpu_count()} cores")
        print(f"tokenizer: BPE vocab {got['vocab']} trained on {args.data.name} ({tokenizer.name})")
        print(
            f"prepared: {got['train_tokens']:,} train + {got['valid_tokens']:,} valid tokens in "
            f"{got['seconds']:.1f} s = {rate:,.0f} tokens/s"
        )
        print(f"peak RSS of the preparing process: {peak_kib / 1024:.0f} MiB (target <= 2048 MiB)")
        raw_mb = min(args.raw_mb, args.mb)
        print(f"raw encode_batch_fast on the first {raw_mb} MB: {raw:,.0f} tokens/s ({raw_tokens:,} tokens)")
        print(f"preparation / raw tokenizer rate: {rate / raw:.2f} (target >= 0.70)")


if __name__ == "__main__":
    main()
