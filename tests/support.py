"""Helpers shared by the tests: the tiny config, config writing and a torchrun runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TINY = {
    "model": {"n_layers": 4, "d_model": 32, "n_heads": 4, "ffn": 64, "seq_len": 32},
    "data": {"tokenizer": "byte", "synthetic_tokens": 40000},
    "cluster": {"procs_per_node": 4},
    "train": {
        "lr": 0.003,
        "warmup_tokens": 2000,
        "seed": 7,
        "eval_interval": 10,
        "eval_tokens": 1024,
        "max_steps": 30,
        "grad_clip": 1.0,
    },
    "strategy": "dp4-tp1-pp1-mbs2-gbs16",
}


def write_config(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


class RecordedEvents:
    """A policy's `events` that keeps what it writes (decisions with their fields)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, kind: str, **fields: object) -> dict:
        self.rows.append({"kind": kind, **fields})
        return self.rows[-1]

    def decisions(self) -> list[dict]:
        return [e for e in self.rows if e["kind"] == "decision"]
