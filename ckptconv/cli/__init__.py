"""The command line: flags, rendering, exit codes (`ckptconv.cli:run` is the entry point)."""

from ckptconv.cli.app import app, main, run

__all__ = ["app", "main", "run"]
