"""`cona report`: the command and its output formats (rich table, markdown, csv, json)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cona_cli.commands.errors import fail
from cona_cli.report.build import Report, RunReport, Segment, TargetResult, build_report
from cona_cli.report.runlog import NotARunError, RunLog, read_run

FORMATS = ("table", "markdown", "csv", "json")
Rows = tuple[list[str], list[list[str]]]


def _num(x: float | None, spec: str = ".4g", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _count(n: int) -> str:
    """1234 -> 1.23k, 2500000 -> 2.5M."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _amount(tokens: int | None, samples: int | None) -> str:
    """Tokens when seq_len is known, else samples."""
    if tokens is not None:
        return f"{_count(tokens)} tok"
    return "-" if samples is None else f"{_count(samples)} samples"


def _target_cell(t: TargetResult, sep: str) -> str:
    if t.reached:
        return f"{t.time_s:.1f} s{sep}step {t.step}{sep}{_amount(t.tokens, t.samples)}"
    if t.best_ppl is None:
        return "not reached"
    return f"not reached{sep}best {t.best_ppl:.4g} @ {t.best_time_s:.1f} s"


def ttp_rows(report: Report, sep: str) -> Rows:
    """The time-to-perplexity table: one row per run, one column per target (and speed-up)."""
    ppl = report.ppl_label
    headers = ["run", "policy"] + [f"{ppl} ≤ {t:.4g}" for t in report.targets]
    if report.baseline:
        headers += [f"speed-up ≤ {t:.4g}" for t in report.targets]
    headers += ["clock", "time", "steps", "tokens", "switches", "switch overhead", f"final {ppl}", "exit"]
    rows = []
    for r in report.runs:
        row = [r.name, r.policy or "-"] + [_target_cell(t, sep) for t in r.targets]
        if report.baseline:
            row += [_num(t.speedup, ".2f", "×") for t in r.targets]
        overhead = f"{r.switch_overhead_s:.1f} s ({_num(r.switch_overhead_pct, '.1f', '%')})"
        row += [
            r.clock,
            f"{r.wall_s:.1f} s",
            str(r.steps),
            _amount(r.tokens, r.samples),
            str(r.switches),
            overhead,
            _num(r.final_ppl),
            r.exit_reason or "no exit event",
        ]
        rows.append(row)
    return headers, rows


def _steps_cell(s: Segment) -> str:
    return "0" if s.first_step is None else f"{s.first_step}–{s.last_step} ({s.steps})"


def timeline_rows(run: RunReport) -> Rows:
    """One row per stage of a run's chain."""
    headers = [
        "#",
        "strategy",
        "start",
        "end",
        "steps",
        "s/iter",
        "predicted",
        "GNS in",
        "GNS out",
        "switch",
        "ended by",
    ]
    rows = [
        [
            str(i),
            str(s.strategy),
            f"{s.start_s:.1f} s",
            f"{s.end_s:.1f} s",
            _steps_cell(s),
            _num(s.median_iter_s, ".3g"),
            _num(s.predicted_iter_s, ".3g"),
            _num(s.gns_entry, ".4g"),
            _num(s.gns_exit, ".4g"),
            _num(s.switch_s, ".1f", " s"),
            s.end_reason,
        ]
        for i, s in enumerate(run.timeline, 1)
    ]
    return headers, rows


def _caption(report: Report) -> str:
    if not report.targets:
        return f"target {report.ppl_label}: none (no evaluations yet)"
    targets = ", ".join(f"{t:.4g}" for t in report.targets)
    base = f"; speed-up against {report.baseline}" if report.baseline else ""
    return f"target {report.ppl_label}: {targets} ({report.target_source}){base}"


def format_table(report: Report, console: Console) -> None:
    """Rich tables on `console`."""
    headers, rows = ttp_rows(report, "\n")
    table = Table(title="Time to perplexity", caption=_caption(report))
    for h in headers:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for run in report.runs:
        headers, rows = timeline_rows(run)
        table = Table(title=f"Chain timeline: {run.name}")
        for h in headers:
            table.add_column(h, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def format_markdown(report: Report) -> str:
    """GitHub markdown: the time-to-perplexity table, then each run's timeline."""
    parts = ["## Time to perplexity", "", _caption(report), "", _markdown_table(*ttp_rows(report, " · "))]
    for run in report.runs:
        parts += ["", f"### Chain timeline: {run.name}", "", _markdown_table(*timeline_rows(run))]
    return "\n".join(parts) + "\n"


CSV_FIELDS = (
    "run",
    "policy",
    "target_ppl",
    "reached",
    "time_to_target_s",
    "steps_to_target",
    "samples_to_target",
    "tokens_to_target",
    "best_ppl",
    "best_ppl_time_s",
    "speedup",
    "baseline",
    "clock",
    "wall_s",
    "steps",
    "samples",
    "tokens",
    "switches",
    "switch_overhead_s",
    "switch_overhead_pct",
    "final_ppl",
    "exit_reason",
)


def _csv_target(t: TargetResult) -> dict[str, Any]:
    return {
        "target_ppl": t.target_ppl,
        "reached": int(t.reached),
        "time_to_target_s": t.time_s,
        "steps_to_target": t.step,
        "samples_to_target": t.samples,
        "tokens_to_target": t.tokens,
        "best_ppl_time_s": t.best_time_s,
        "speedup": t.speedup,
    }


def format_csv(report: Report) -> str:
    """One row per run × target; empty cells where a value does not exist (e.g. not reached)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in report.runs:
        run = {
            "run": r.name,
            "policy": r.policy,
            "best_ppl": r.best_ppl,
            "baseline": report.baseline,
            "clock": r.clock,
            "wall_s": r.wall_s,
            "steps": r.steps,
            "samples": r.samples,
            "tokens": r.tokens,
            "switches": r.switches,
            "switch_overhead_s": r.switch_overhead_s,
            "switch_overhead_pct": r.switch_overhead_pct,
            "final_ppl": r.final_ppl,
            "exit_reason": r.exit_reason,
        }
        for fields in [_csv_target(t) for t in r.targets] or [{}]:
            writer.writerow({k: "" if v is None else v for k, v in {**run, **fields}.items()})
    return out.getvalue()


def _finite(x: Any) -> Any:
    """Non-finite floats become null so the output is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def format_json(report: Report) -> str:
    """Everything: targets, baseline, and per run its results per target and its timeline."""
    return json.dumps(_finite(dataclasses.asdict(report)), indent=2) + "\n"


def _read(path: Path) -> RunLog:
    try:
        return read_run(path)
    except NotARunError as e:
        raise fail("cona report", str(e)) from None


def _load(run_dirs: list[Path], baseline: Path | None) -> tuple[list[RunLog], int | None]:
    """Read the runs (and the baseline, appended unless it is one of them) and the baseline's index."""
    logs = [_read(p) for p in run_dirs]
    if baseline is None:
        return logs, None
    paths = [p.resolve() for p in run_dirs]
    if baseline.resolve() in paths:
        return logs, paths.index(baseline.resolve())
    return logs + [_read(baseline)], len(logs)


def report_command(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN_DIR", show_default=False, help="Run directories written by `cona train`."),
    ],
    target_ppl: Annotated[
        list[float] | None,
        typer.Option(
            "--target-ppl",
            help="Target perplexity (repeatable). Default: the config's train.target_ppl, "
            "else the best perplexity every run reached.",
        ),
    ] = None,
    baseline: Annotated[
        Path | None, typer.Option(help="Run to compute speed-ups against. Default: the only run with policy static.")
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, markdown, csv or json.")] = "table",
    plot: Annotated[Path | None, typer.Option(help="Also write a PNG figure here.")] = None,
) -> None:
    """Time to target perplexity and the chain timeline of one or more runs (running or crashed too)."""
    if fmt not in FORMATS:
        raise fail("cona report", f"--format: must be one of {', '.join(FORMATS)}, got {fmt!r}") from None
    for t in target_ppl or []:
        if not (math.isfinite(t) and t > 1):
            raise fail("cona report", f"--target-ppl: must be a number > 1, got {t}") from None
    logs, base_index = _load(run_dirs, baseline)
    for log in logs:
        for warning in log.warnings:
            typer.echo(f"cona report: warning: {warning}", err=True)
    report = build_report(logs, target_ppl or (), base_index)
    if fmt == "table":
        format_table(report, Console(width=None if sys.stdout.isatty() else 200))
    else:
        formatter = {"markdown": format_markdown, "csv": format_csv, "json": format_json}[fmt]
        sys.stdout.write(formatter(report))
    if plot is not None:
        from cona_cli.report.plot import plot_report  # matplotlib only when asked for

        try:
            plot.parent.mkdir(parents=True, exist_ok=True)
            plot_report(logs, report, plot)
        except OSError as e:
            typer.echo(f"cona report: cannot write {plot}: {e}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"cona report: wrote {plot}", err=True)
