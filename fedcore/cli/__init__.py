"""The command line: ``fedcore run | validate | audit | server | client | kdc | checkpoint``,
with the progress display of a local run (``progress``)."""

from fedcore.cli.commands import main, role_main

__all__ = ["main", "role_main"]
