"""The `specdecode` command line (commands.py: its parser and commands; importing it imports no torch)."""

from .commands import main

__all__ = ["main"]
