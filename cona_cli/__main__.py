"""`python -m cona_cli` runs the `cona` command line (as an sbatch script does)."""

from cona_cli.app import main

main()
