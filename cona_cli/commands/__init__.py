"""The `cona` subcommands (Typer): train, search, report. Thin: parse flags, call the packages."""
