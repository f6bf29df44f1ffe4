"""Checkpoint folders as the controller sees them: list, validate, quarantine (no torch at import).

A checkpoint `RUN/checkpoints/step_000120/` is usable when it has the `COMMITTED` marker, a readable
`trainer.json`, a readable DCP `.metadata`, every shard file the metadata points into, long enough
for the bytes it promises, and model tensors of the shapes the config builds. An unusable one is
renamed to `bad-step_000120` so that neither the controller nor the workers' pruning count it again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

MARKER = "COMMITTED"
TRAINER_STATE = "trainer.json"
BAD_CHECKPOINT_EXIT = 3  # a worker that cannot load its checkpoint exits with this code

Shapes = dict[str, tuple[int, ...]]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def committed(root: Path) -> list[Path]:
    """Folders with a COMMITTED marker, newest first."""
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.name.startswith("step_") and (d / MARKER).is_file()]
    return sorted(dirs, key=lambda d: d.name, reverse=True)


def candidates(root: Path) -> list[Path]:
    """Every `step_*` folder, committed or not, newest first."""
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.name.startswith("step_") and d.is_dir()),
                  key=lambda d: d.name, reverse=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer.json of a checkpoint; ValueError naming the folder if unreadable."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable {TRAINER_STATE} ({e})") from None


def checkpoint_step(path: Path) -> int:
    return int(read_trainer_state(path)["trainer"]["step"])


def model_shapes(n_layers: int, d_model: int, n_heads: int, kv_heads: int, ffn: int, seq_len: int,
                 vocab_size: int) -> Shapes:
    """Global shapes of the model tensors as DCP names them (`model.<fqn>`), built on the meta device."""
    import torch

    from launch.model import GPT, GPTArgs

    with torch.device("meta"):
        model = GPT(GPTArgs(n_layers, d_model, n_heads, kv_heads, ffn, seq_len, vocab_size, 0.0))
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
        saved = {k: tuple(getattr(v, "size", ())) for k, v in meta.state_dict_metadata.items()
                 if k.startswith("model.")}
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
