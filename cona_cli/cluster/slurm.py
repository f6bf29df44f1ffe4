"""Slurm's side of a cluster: the hosts of the allocation this process runs in (no config needed), and
putting a batch job back in the queue."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping

_BRACKET = re.compile(r"\[([^\]]*)\]")


class SlurmError(ValueError):
    """The Slurm allocation is missing or does not match the config; the message is one line."""


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, e.g. `gpu[01-02,07],login1` -> gpu01, gpu02, gpu07, login1."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        hosts.extend(_expand_one(part))
    if not hosts:
        raise SlurmError(f"empty node list {text!r}")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(part: str) -> list[str]:
    m = _BRACKET.search(part)
    if m is None:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    out = []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SlurmError(f"cannot read node range {item!r} in {part!r}")
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{len(lo)}d}{tail}"))
    return out


def allocation_hosts(environ: Mapping[str, str] | None = None) -> list[str]:
    """The hosts of the Slurm allocation this process runs in."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("not inside a Slurm allocation (SLURM_JOB_NODELIST is not set)")
    return expand_nodelist(nodelist)


def requeue(environ: Mapping[str, str] | None = None) -> str | None:
    """Put this batch job back in Slurm's queue (`scontrol requeue $SLURM_JOB_ID`: its script runs again,
    and resumes its run folder); the reason in one line if it could not be, else None."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "not inside a Slurm job (no SLURM_JOB_ID): nothing to requeue"
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol requeue {job}: {e}"
    if proc.returncode != 0:
        return f"scontrol requeue {job}: {' '.join(proc.stderr.split()) or f'exit {proc.returncode}'}"
    return None
