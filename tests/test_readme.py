"""README.md cannot rot: every `cona ...` and `python scripts/...` command in its fenced shell blocks
parses against the current command line (subcommand, flags, the type of each value), every config and
script it names exists, and `make` targets are the Makefile's. Each `cona` command that needs no GPU
cluster also runs, in its shortest form (optional parts left out, `cona train` with --dry-run or
--sbatch, reports and exports on one tiny finished run; `cona tune-lr` in tests/test_tune_lr.py)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cona_cli.app import app
from tests.support import REPO, TINY, write_config

README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)  # every fenced block, in order, whatever its language
SHELL = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}

# A usage line's placeholders, replaced by values of the type the option takes ("" marks a path the test
# creates: a file, or a folder for the names ending in DIR).
# typer runs on its own copy of click (typer._click): its usage error is the base of typer.BadParameter.
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

PLACEHOLDERS = {
    "CONFIG": "",
    "FILE": "",
    "RUN_DIR": "",
    "DIR": "",
    "PATH": "",
    "N": "1",
    "K": "1",
    "X": "1.5",
    "NAME": "x",
}


def shell_commands() -> list[str]:
    """Each command of the README's fenced shell blocks (a line split at &&, ;, ||, and | outside [...])."""
    found = []
    for lang, block in FENCE.findall(README.read_text()):
        if lang not in SHELL:
            continue
        for line in block.splitlines():
            tokens, depth, current = shlex.split(line, comments=True), 0, []
            for tok in tokens:
                depth += tok.count("[") - tok.count("]")
                if tok in SEPARATORS and depth == 0:
                    found.append(shlex.join(current))
                    current = []
                else:
                    current.append(tok)
            if current:
                found.append(shlex.join(current))
    return found


COMMANDS = shell_commands()
CONA = [c for c in COMMANDS if c.startswith("cona ")]
SCRIPTS = [c for c in COMMANDS if c.startswith("python scripts/")]


def concrete(tokens: list[str], tmp: Path) -> tuple[list[str], list[str]]:
    """A usage line as arguments: brackets, `|` between alternatives and `...` dropped (every alternative
    kept), `a|b` values reduced to `a`, placeholders replaced. Also returns the options shown with `...`
    for their value (`[--set ...]`), taken out of the arguments: only their names can be checked."""
    out, unvalued = [], []
    for raw in tokens:
        tok = raw.strip("[]")
        if tok == "..." and out and out[-1].startswith("-"):
            unvalued.append(out.pop())
            continue
        if tok in ("", "|", "...") or tok.endswith("..."):
            tok = tok.removesuffix("...")
            if not tok or tok == "|":
                continue
        if re.fullmatch(r"[A-Z][A-Z_]*", tok):
            assert tok in PLACEHOLDERS, f"README placeholder {tok}: add its value to PLACEHOLDERS in this test"
            value = PLACEHOLDERS[tok]
            if not value:
                path = tmp / tok.lower()
                if tok.endswith("DIR"):
                    path.mkdir(exist_ok=True)
                else:
                    path.write_text("{}\n")
                value = str(path)
            tok = value
        elif "|" in tok and not tok.startswith("-"):
            tok = tok.split("|")[0]
        out.append(tok)
    return out, unvalued


def parse(args: list[str]) -> typer.core.TyperCommand:
    """Resolve the subcommand path and parse the rest with its own parser (types, required options and
    unknown flags checked; nothing runs). Returns the leaf command."""
    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("cona", [], resilient_parsing=True)
    while isinstance(cmd, typer.core.TyperGroup):
        assert args, f"{cmd.name}: no subcommand given"
        sub = cmd.get_command(ctx, args[0])
        assert sub is not None, f"`cona ... {args[0]}`: no such subcommand (have {', '.join(cmd.list_commands(ctx))})"
        cmd, args = sub, args[1:]
        ctx = cmd.make_context(cmd.name, [], parent=ctx, resilient_parsing=True)
    with cmd.make_context(cmd.name, list(args), parent=ctx.parent):
        pass
    return cmd


def test_the_readme_has_commands() -> None:
    assert len(CONA) >= 8, CONA  # the extraction still finds the README's blocks


@pytest.mark.parametrize("command", CONA, ids=lambda c: c[:70])
def test_cona_command_parses(command: str, tmp_path: Path) -> None:
    """The subcommand exists and the current parser accepts every flag and value the README shows."""
    args, unvalued = concrete(shlex.split(command)[1:], tmp_path)
    try:
        leaf = parse(args)
    except UsageError as e:
        pytest.fail(f"README: `{command}`: {e.format_message()}")
    known = {opt for param in leaf.params for opt in param.opts}
    assert set(unvalued) <= known, f"README: `{command}`: no such option {sorted(set(unvalued) - known)}"


@pytest.mark.parametrize("command", SCRIPTS or [pytest.param("", marks=pytest.mark.skip("no script commands"))])
def test_script_command_answers_help(command: str) -> None:
    """`python scripts/X.py ARGS --help`: the script exists and its parser knows the flags before --help."""
    tokens = shlex.split(command)
    assert (REPO / tokens[1]).is_file(), f"README: `{command}`: {tokens[1]} does not exist"
    proc = subprocess.run([sys.executable, *tokens[1:], "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), f"README: `{command}`:\n{proc.stderr[-2000:]}"


def test_named_configs_and_scripts_exist() -> None:
    """Every configs/... and scripts/... path the README names (in code or prose) is in the repository."""
    named = set(re.findall(r"\b((?:configs|scripts)/[\w./-]+\.(?:ya?ml|py))\b", README.read_text()))
    assert named, "the README names no config or script"
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"README names files that do not exist: {missing}"


def test_make_targets_exist() -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    used = {shlex.split(c)[1] for c in COMMANDS if c.startswith("make ")}
    assert used and used <= targets, used - targets


def runnable(command: str, tiny: Path, run: Path, tmp: Path) -> list[str] | None:
    """The command's shortest form as arguments, run from `tmp`, or None where it needs what a test has not
    (a GPU cluster, an unfinished run to resume, data not on this machine) or another test runs it."""
    tokens, depth, args = shlex.split(command)[1:], 0, []
    for tok in tokens:  # leave out every optional [...] part
        opened, closed = tok.count("["), tok.count("]")
        if depth == 0 and not opened:
            args.append(tok)
        depth += opened - closed
    values = {"CONFIG": str(tiny), "RUN_DIR": str(run), "DIR": str(tmp / "out")}
    args = [values.get(a, a) for a in args]
    args = [a.split("|")[0] if "|" in a and not a.startswith("-") else a for a in args]
    args = [str(REPO / a) if (REPO / a).exists() and a.split("/")[0] in ("configs", "..") else a for a in args]
    if any(a.startswith("../") for a in args):
        return None  # data the README expects beside the clone: not here
    if args[0] == "report" or args[0] == "export":
        args[1] = str(run)  # a run folder the README's own `cona train` would have made
    if args[0] == "tune-lr":
        return None  # trains one run per LR: tests/test_tune_lr.py runs it, test_cona_command_parses its flags
    if args[0] == "train":
        if "--resume" in args:
            return None
        gpu_cluster = "a6000" in args[1] and "--sbatch" not in args
        if gpu_cluster:
            return None
        if "--sbatch" not in args and "--dry-run" not in args:
            args.append("--dry-run")
    return args


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny config and a finished 2-step run of it (one process)."""
    base = tmp_path_factory.mktemp("readme")
    doc = {**TINY, "cluster": {"procs_per_node": 1}, "strategy": "dp1-tp1-pp1-mbs2-gbs4"}
    tiny = write_config(base / "tiny.yaml", {**doc, "train": {**TINY["train"], "max_steps": 2, "eval_interval": 2}})
    result = CliRunner().invoke(app, ["train", str(tiny), "--run-dir", str(base / "run")])
    assert result.exit_code == 0, result.output
    return tiny, base / "run"


@pytest.mark.e2e
@pytest.mark.parametrize("command", CONA, ids=lambda c: c[:70])
def test_cona_command_runs(
    command: str, tiny_run: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = runnable(command, *tiny_run, tmp_path)
    if args is None:
        pytest.skip("needs a GPU cluster, a run to resume or data not on this machine, or another test runs it")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"README: `{command}` as `cona {shlex.join(args)}`: {result.output[-2000:]}"
    if "--sbatch" in args:
        assert (tmp_path / args[args.index("--sbatch") + 1]).is_file()
    if args[0] == "export":
        assert any((tmp_path / "out").iterdir())
