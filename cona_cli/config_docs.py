"""docs/config.md, generated from the config's own fields: every field of every section, its type, default,
range or choices and meaning. Run `python -m cona_cli.config_docs` (or `cona config docs`) after changing
cona_core/config.py; tests/test_cli.py checks the committed file is current.

A field's meaning is its `help` metadata if it has one, else its comment in cona_core/config.py: the
comment lines right above the field and the comment at the end of its line(s)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from cona_core import config

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "python -m cona_cli.config_docs"

# Probes for a field's check: the first value it refuses gives its range (the check's message).
_PROBES: dict[Any, tuple[Any, ...]] = {
    int: (-(10**18), -1, 0, 1, 2, 10**18),
    float: (-1e30, -1.0, 0.0, 0.5, 1.0, 1e30),
    str: ("\x00not a choice", ""),
}

_TOP_LEVEL = [
    (
        "policy",
        "str",
        "chain if `chain` is set, static if `strategy` is, else cona",
        f"one of {', '.join(config.POLICIES)}",
        "How strategies are chosen while training: cona (the online controller), static (one strategy), "
        "chain (the stages of `chain`), ramp (Megatron's batch ramp-up, `train.rampup_batch_size`).",
    ),
    (
        "strategy",
        "str \\| mapping",
        "null",
        "dp2-tp1-pp2-mbs2-gbs16, {dp, tp, pp, mbs, gbs}, or auto",
        "The fixed strategy of policy static or ramp; auto: the planner's fastest at search.gbs_static.",
    ),
    (
        "chain",
        "list of mappings",
        "null",
        "stages {dp, tp, pp, mbs, gbs, steps}",
        "The stages of policy chain; each but the last needs steps (the last runs until the stop rule).",
    ),
]


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comments in the class's source (above and at the end of its lines)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    text = "".join(lines)
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    code = text.splitlines()
    out: dict[str, str] = {}
    (node,) = ast.parse(text).body
    for stmt in node.body:  # type: ignore[attr-defined]
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, n = [], stmt.lineno - 1
        while n in by_line and code[n - 1].lstrip().startswith("#"):
            above.insert(0, by_line[n])
            n -= 1
        trailing = [by_line[i] for i in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if i in by_line]
        out[stmt.target.id] = " ".join(trailing or above)  # with its own comment, the lines above head a group
    return out


def _type(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return text.replace("typing.", "").replace("cona_core.config.", "").replace("|", "\\|")


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    return json.dumps(v)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{_value(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{_value(f.default_factory())}`"
    return "**required**"


def _range(f: dataclasses.Field, hint: Any) -> str:
    check = f.metadata.get("check")
    if hint is bool or str(hint) == "bool":
        return "true, false"
    if check is None:
        return ""
    args = [hint, *get_args(hint)]
    items = [get_args(a)[0] for a in args if get_origin(a) is list]  # a list's check applies to each item
    base = next((t for t in (int, float, str) if t in (items or args)), None)
    for probe in _PROBES.get(base, ()):
        try:
            msg = check(probe)
        except Exception:  # a check that only takes its own type
            continue
        if msg:
            text = msg.removeprefix("must be ").removeprefix("must ").replace("not be ", "not ")
            return ("each " if items else "") + text.replace("|", "\\|")
    return ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections() -> dict[str, type]:
    """The config's sections (the typed fields of Config), in order."""
    hints = get_type_hints(config.Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(config.Config) if dataclasses.is_dataclass(hints[f.name])}


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from cona_core/config.py; do not edit by hand. -->",
        "",
        "A run's YAML config has the sections below and three top-level keys. Every key may also be given on",
        "the command line: `cona train CONFIG --set train.lr=3e-4 --set search.mbs=[1,2]` (values are YAML).",
        "`cona config show CONFIG` prints a config with every default filled in. A bad value is refused",
        "before anything launches, in one line naming the key.",
        "",
        "## Top-level keys",
        "",
        "| key | type | default | range / choices | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    out += [f"| `{k}` | {t} | {d} | {r} | {_cell(m)} |" for k, t, d, r, m in _TOP_LEVEL]
    for name, cls in sections().items():
        hints = get_type_hints(cls)
        notes = _comments(cls)
        doc = inspect.getdoc(cls) or ""
        out += ["", f"## `{name}`", "", _cell(doc), "", "| key | type | default | range / choices | meaning |"]
        out.append("| --- | --- | --- | --- | --- |")
        for f in dataclasses.fields(cls):
            if not f.metadata.get("yaml", True):
                continue
            meaning = f.metadata.get("help") or notes.get(f.name, "")
            row = [f"`{f.name}`", _type(hints[f.name]), _default(f), _range(f, hints[f.name]), _cell(meaning)]
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/config.md (or the path given)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DOC
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
