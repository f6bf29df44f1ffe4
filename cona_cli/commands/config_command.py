"""`cona config show CONFIG` (the resolved config with every default) and `cona config docs`
(regenerate docs/config.md)."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from cona_cli.commands.errors import fail
from cona_cli.overrides import parse_sets
from cona_cli.run_config import load_config
from cona_core.config import ConfigError

config_app = typer.Typer(no_args_is_help=True, help="Show a resolved config, or regenerate docs/config.md.")


@config_app.command("show")
def show_command(
    config: Path = typer.Argument(..., help="YAML run config."),
    sets: list[str] | None = typer.Option(
        None, "--set", metavar="SECTION.KEY=VALUE", help="Override one config value (YAML), e.g. train.lr=3e-4."
    ),
) -> None:
    """Print the config as `cona train` reads it: every key of every section, defaults filled in (YAML)."""
    from cona_cli.control.run_setup import complete_schedule

    try:
        cfg = complete_schedule(load_config(config, parse_sets(sets)))
    except ConfigError as e:
        raise fail("cona config show", str(e)) from None
    typer.echo(yaml.safe_dump(cfg.to_raw(), sort_keys=False, allow_unicode=True), nl=False)


@config_app.command("docs")
def docs_command(
    out: Path | None = typer.Option(None, "--out", help="Where to write it (default: docs/config.md)."),
) -> None:
    """Regenerate the configuration reference (docs/config.md) from cona_core/config.py."""
    from cona_cli import config_docs

    config_docs.main([str(out)] if out else [])
