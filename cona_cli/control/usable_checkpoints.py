"""Checkpoint folders as the controller sees them: list, validate, quarantine (no torch at import).

A checkpoint `RUN/checkpoints/step_000120/` is usable when it has the `COMMITTED` marker, a readable
`trainer.json`, a readable DCP `.metadata`, every shard file the metadata points into, long enough
for the bytes it promises, and model tensors of the shapes the config builds. An unusable one is
renamed to `bad-step_000120` so that neither the controller nor the workers' pruning count it again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cona_core.config import Config, ModelConfig
from cona_core.rundir import MARKER, TRAINER_STATE, RunDir, read_trainer_state, step_of

Shapes = dict[str, tuple[int, ...]]


def expected_shapes(cfg: Config, run: RunDir) -> Shapes:
    """Model tensor shapes a checkpoint of this run must have (vocabulary from corpus.json)."""
    return model_shapes(cfg.model, run.vocab_size())


def candidates(root: Path) -> list[Path]:
    """Every `step_*` folder, committed or not, highest step first (by the number in the name: `step_1000000`
    is newer than `step_999999`; a name without a number comes last)."""
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.name.startswith("step_") and d.is_dir()), key=step_of, reverse=True)


def checkpoint_step(path: Path) -> int:
    return int(read_trainer_state(path)["trainer"]["step"])


def model_shapes(m: ModelConfig, vocab_size: int) -> Shapes:
    """Global shapes of the model tensors as DCP names them (`model.<fqn>`), built on the meta device."""
    import torch

    from launch.models import get_spec

    with torch.device("meta"):
        model = get_spec(m.family).build(m, vocab_size)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def problem(path: Path, shapes: Shapes | None) -> str | None:
    """Why the checkpoint cannot be used, or None if it looks complete and fits the model."""
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker"
    try:
        state = read_trainer_state(path)
        int(state["trainer"]["step"]), int(state["trainer"]["consumed_samples"])
    except (ValueError, KeyError, TypeError) as e:
        return f"bad {TRAINER_STATE} ({str(e).split(': ')[-1]})"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a torn or foreign pickle raises anything
        return f"unreadable .metadata ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"missing shard {name}"
        if f.stat().st_size < size:
            return f"truncated shard {name} ({f.stat().st_size} of {size} bytes)"
    if shapes is not None:
        saved = {
            k: tuple(getattr(v, "size", ())) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")
        }
        for key, shape in shapes.items():
            if key not in saved:
                return f"model tensor {key} missing"
            if saved[key] != shape:
                return f"model tensor {key} has shape {list(saved[key])}, the config builds {list(shape)}"
        extra = sorted(set(saved) - set(shapes))
        if extra:
            return f"unexpected model tensor {extra[0]}"
    return None


def quarantine(path: Path) -> Path:
    """Rename an unusable checkpoint to `bad-<name>` (suffixed if taken); returns the new path."""
    target = path.with_name(f"bad-{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"bad{n}-{path.name}")
    path.rename(target)
    return target


def newest_usable(root: Path, shapes: Shapes | None, warn: Callable[[str], None]) -> tuple[Path | None, int]:
    """The newest usable checkpoint, quarantining (with a warning) newer unusable ones.

    Returns (path or None, how many unusable folders were skipped)."""
    skipped = 0
    for path in candidates(root):
        why = problem(path, shapes)
        if why is None:
            return path, skipped
        skipped += 1
        moved = quarantine(path)
        warn(f"checkpoint {path} is unusable ({why}); skipped (moved to {moved.name})")
    return None, skipped
