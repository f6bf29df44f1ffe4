"""The `cona` command line: train, search, report, export, simulate, tune-lr, config."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import typer

from cona_cli.commands.config_command import config_app
from cona_cli.commands.export_command import export_command
from cona_cli.commands.report_command import report_command
from cona_cli.commands.search_command import search_command
from cona_cli.commands.simulate_command import simulate_command
from cona_cli.commands.train_command import train_command
from cona_cli.commands.tune_lr_command import tune_lr_command

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Chain parallelism strategies while an LLM trains, to reach a target perplexity sooner.",
)
app.command("search")(search_command)
app.command("train")(train_command)
app.command("report")(report_command)
app.command("export")(export_command)
app.command("simulate")(simulate_command)
app.command("tune-lr")(tune_lr_command)
app.add_typer(config_app, name="config")


def package_version() -> str:
    try:
        return version("cona")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cona {package_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    _: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the package version and exit."
    ),
) -> None:
    """Chain parallelism strategies while an LLM trains, to reach a target perplexity sooner."""


def main() -> None:
    app()
