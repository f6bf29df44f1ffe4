"""The `cona` command line: train, search, report, export."""

from __future__ import annotations

import typer

from cona_cli.commands.export_command import export_command
from cona_cli.commands.report_command import report_command
from cona_cli.commands.search_command import search_command
from cona_cli.commands.train_command import train_command

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Chain parallelism strategies while an LLM trains, to reach a target perplexity sooner.",
)
app.command("search")(search_command)
app.command("train")(train_command)
app.command("report")(report_command)
app.command("export")(export_command)


def main() -> None:
    app()
