"""Secrets never on a command line: `ps` shows every process's arguments to every user.

A command that needs a token takes it from an environment variable or from a file
(`--token-file PATH`, `-` for stdin). A leftover `--token VALUE` is refused before
anything runs, with one line saying what to use instead:

    p.add_argument("--token-file", help="...")
    refuse_on_command_line(p, "--token", instead="TUNEFARM_TOKEN or --token-file PATH")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError


class _Refused(argparse.Action):
    """A flag that would carry a secret on the command line: exit 2 with one line."""

    def __init__(self, option_strings: list[str], dest: str, *, instead: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.exit(2, f"{parser.prog}: error: {option_string} would show the secret to anyone who runs ps; "
                       f"use {self.instead}\n")  # fmt: skip


def refuse_on_command_line(parser: argparse.ArgumentParser, flag: str, *, instead: str) -> None:
    """Make `flag` (e.g. --token) an error naming `instead` (hidden from --help)."""
    parser.add_argument(flag, action=_Refused, instead=instead, dest=f"refused_{flag.lstrip('-').replace('-', '_')}")


def read_secret_file(path: str | Path, what: str = "token") -> str:
    """The secret in a file (`-`: stdin), without surrounding whitespace; `UsageError`
    for a file that cannot be read or holds nothing."""
    try:
        text = sys.stdin.read() if str(path) == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"the {what} file {path} is not text") from None
    secret = text.strip()
    if not secret:
        raise UsageError(f"the {what} file {path} is empty")
    return secret
