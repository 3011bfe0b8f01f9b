"""The ``mlcomp`` command line: one click group, commands registered lazily by name."""
from mlcomp.cli.main import main

__all__ = ["main"]
