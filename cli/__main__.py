"""`python -m scorestack.cli`: the same command line as the `scorestack` entry point."""

from scorestack.cli import main

main()
