"""`cona export`: a run's checkpoint as one torch state dict or a Hugging Face model folder.

The command picks the checkpoint (the newest usable one, or `--step N`) and writes into a temporary
folder next to `--out`, renamed to `--out` at the end, so a failed export leaves nothing behind.
The consolidation itself (torch, imported only here) is `launch.export`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from cona_cli.commands.errors import fail
from cona_cli.control import usable_checkpoints as checkpoints
from cona_core.config import config_from_json
from cona_core.rundir import RunDir, step_dir

FORMATS = ("hf", "torch")


def choose_checkpoint(run: RunDir, shapes: checkpoints.Shapes, step: int | None) -> Path:
    """The checkpoint of `step` (else the newest usable one); ValueError with a one-line reason."""
    found = checkpoints.candidates(run.checkpoints)
    if step is None:
        usable = next((p for p in found if checkpoints.problem(p, shapes) is None), None)
        if usable is None:
            raise ValueError(f"no usable checkpoint in {run.checkpoints} ({len(found)} unusable)")
        return usable
    path = step_dir(run.checkpoints, step)
    if path not in found:
        steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in reversed(found)) or "none"
        raise ValueError(f"--step {step}: no checkpoint of that step in {run.checkpoints} (steps: {steps})")
    why = checkpoints.problem(path, shapes)
    if why is not None:
        raise ValueError(f"--step {step}: checkpoint {path} is unusable ({why})")
    return path


def export_command(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", show_default=False, help="A run folder.")],
    fmt: Annotated[str, typer.Option("--format", show_default=False, help="hf (transformers folder) or torch.")],
    out: Annotated[Path, typer.Option("--out", show_default=False, help="Folder to create (absent or empty).")],
    step: Annotated[int | None, typer.Option("--step", help="Checkpoint step (default: the newest usable).")] = None,
) -> None:
    """Consolidate a run's DCP checkpoint (any layout) into one state dict or a Hugging Face model folder."""
    if fmt not in FORMATS:
        raise fail("cona export", f"--format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise fail("cona export", f"--out {out}: exists and is not an empty folder")
    run = RunDir(run_dir)
    if not run.resolved_config.is_file() or not run.corpus.is_file():
        raise fail("cona export", f"{run_dir}: not a run folder (no {run.resolved_config.name} and {run.corpus.name})")
    from launch.export import export  # torch

    try:
        cfg = config_from_json(run.resolved_config.read_text(), str(run.resolved_config))
        corpus = json.loads(run.corpus.read_text())
        ckpt = choose_checkpoint(run, checkpoints.expected_shapes(cfg, run), step)
        written = checkpoints.checkpoint_step(ckpt)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private
            tokenizer, pretokenized = corpus.get("tokenizer_path"), bool(corpus.get("pretokenized"))
            export(ckpt, cfg.model, int(corpus["vocab_size"]), tokenizer, written, fmt, tmp, pretokenized)
            os.replace(tmp, out)  # onto nothing, or an empty folder
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (ValueError, KeyError, OSError) as e:  # ConfigError and ExportError are ValueErrors
        raise fail("cona export", str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    note = "" if tokenizer or not pretokenized else "; no tokenizer: the run's data was pre-tokenized"
    typer.echo(f"cona export: wrote {out} ({fmt}, step {written} of {run_dir}{note})", err=True)
