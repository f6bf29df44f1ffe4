"""Everything `cona train` checks before its first launch; `cona train --dry-run` runs the same and stops.

In order: the policy and its first strategy (`make_policy`), the nodes as the controller resolves them (a
GPU per rank under a local GPU backend, the Slurm allocation and its node count, an address to listen on),
the run folder, the packages of the metric sinks asked for (TensorBoard, W&B), the tokenizer (loaded as
preparation loads it, a hub name from the local Hugging Face cache, and tried on a text), and the data
(every file opened, enough validation tokens for one evaluation). Each refusal is a ConfigError of one
line naming the key or file; nothing is written or started.

The corpus is not prepared here, so its validation tokens are counted up to what one evaluation needs:
with the run's tokenizer, or in bytes where a BPE is yet to be trained on the corpus (a byte-level BPE
token spans at least one byte), and over all the training documents where the validation documents are
to be drawn from them. Both of the last two are upper bounds; `prepare_run_dir` checks the exact count
once the corpus is prepared, before anything launches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cona_cli.cluster.nodes import free_port, head_address, resolve_nodes
from cona_cli.cluster.slurm import SlurmError
from cona_cli.control.metric_sinks import check_installed
from cona_cli.control.policies import Policy
from cona_cli.control.run_setup import check_eval_tokens, check_run_dir, eval_tokens_needed, make_policy
from cona_core.config import Config, ConfigError
from cona_core.rundir import RunDir
from cona_core.shape import SPECIAL_TOKENS

if TYPE_CHECKING:
    from launch.data.tokenize import TextTokenizer

PROBE_TEXT = "Hello, world! 3.14 café"  # what the tokenizer is tried on


@dataclass(frozen=True)
class Checked:
    """A run that passed every check: its config completed by the policy, the policy, and the data found."""

    cfg: Config
    policy: Policy
    data: str  # one line: the format, files and tokenizer


def preflight(cfg: Config, run_dir: Path) -> Checked:
    """Run every check of a first launch into `run_dir`; ConfigError (one line) at the first that fails."""
    cfg, policy = make_policy(cfg)
    check_clock(cfg, policy, run_dir)
    check_nodes(cfg)
    check_run_dir(run_dir)
    check_installed(cfg.train)
    tok, where = load_tokenizer(cfg)
    return Checked(cfg, policy, f"{check_data(cfg, tok)}, tokenizer {where}")


def check_clock(cfg: Config, policy: Policy, run_dir: Path) -> None:
    """Under the virtual clock, its table times every strategy the policy may run."""
    if cfg.train.clock == "virtual":
        from cona_cli.control.clock_table import clock_spec  # the planner's cost model: numpy

        clock_spec(cfg, RunDir(run_dir), policy.strategies())


def check_nodes(cfg: Config) -> None:
    """The nodes resolved as the controller resolves them, and this machine's address for them bound."""
    try:
        nodes = resolve_nodes(cfg.cluster)
    except SlurmError as e:
        raise ConfigError(f"cluster.launcher: slurm: {e}") from None
    host = head_address(cfg.cluster, nodes)
    try:
        free_port(host)
    except OSError as e:
        raise ConfigError(f"cluster.head_addr: cannot listen on {host} ({e.strerror or e})") from None


def load_tokenizer(cfg: Config) -> tuple[TextTokenizer | None, str]:
    """The run's tokenizer (None for bpe: trained on the corpus when it is prepared), tried on a text, and
    where it was found."""
    from launch.data import tokenize
    from launch.data.sources import DataError

    spec, specials = cfg.data.tokenizer, SPECIAL_TOKENS[cfg.model.family]
    if spec == "bpe":
        return None, spec
    if spec == "byte":
        return tokenize.byte(specials), spec
    try:
        path = tokenize.tokenizer_location(spec)
        hub = path != Path(spec).expanduser()
        tok = tokenize.load(str(path) if hub else spec, specials)
    except DataError as e:
        raise ConfigError(str(e)) from None
    try:
        tok.encode([PROBE_TEXT])
    except Exception as e:
        raise ConfigError(f"data.tokenizer: {spec}: cannot encode text ({type(e).__name__}: {e})") from None
    return tok, f"{spec} ({path})" if hub else spec


def check_data(cfg: Config, tok: TextTokenizer | None) -> str:
    """The data's files opened and their validation tokens counted (module docstring); what was found."""
    from launch.data import sources, tokenize

    data = cfg.data
    if data.path is None:
        return check_synthetic(cfg)
    counter = tok or tokenize.byte(SPECIAL_TOKENS[cfg.model.family])
    try:
        src = sources.resolve(data)
        open_files(src.key_files or (src.root,))
        split = "valid" if sources.has_valid(src) else "train"
        n = count_tokens(sources.documents(src, data, split), counter, eval_tokens_needed(cfg))
    except sources.DataError as e:
        raise ConfigError(str(e)) from None
    check_eval_tokens(cfg, n, at_most=tok is None or split == "train")
    valid = f"{len(src.valid)} valid file(s)" if src.valid else f"valid split {data.valid_fraction:g} of the documents"
    return f"{src.format} at {data.path}: {len(src.train)} train file(s), {valid}"


def check_synthetic(cfg: Config) -> str:
    """The synthetic corpus (no data.path): its tokenizer, and its validation text's bytes (bpe: at most)."""
    from launch.data.synthetic import synthetic_corpus

    data = cfg.data
    if data.tokenizer not in ("bpe", "byte"):
        raise ConfigError("data.tokenizer: the synthetic corpus (no data.path) takes bpe or byte")
    valid = synthetic_corpus(data.synthetic_tokens, cfg.train.seed)[1]
    check_eval_tokens(cfg, len(valid.encode("utf-8")), at_most=data.tokenizer == "bpe")
    return f"synthetic corpus ({data.synthetic_tokens} tokens)"


def open_files(files: Iterable[Path]) -> None:
    """Read a byte of each file (the first entry of each folder); ConfigError naming the one that fails."""
    for f in files:
        try:
            if f.is_file():
                with f.open("rb") as fh:
                    fh.read(1)
            else:
                next(iter(f.iterdir()), None)
        except OSError as e:
            raise ConfigError(f"data.path: {f}: cannot read ({e.strerror})") from None


def count_tokens(docs: Iterable[str | Sized], tok: TextTokenizer, need: int) -> int:
    """Tokens of `docs` (text encoded by `tok`, token arrays as they are), counted until `need`."""
    n = 0
    for doc in docs:
        n += len(tok.encode([doc])[0]) if isinstance(doc, str) else len(doc)
        if n >= need:
            break
    return n
