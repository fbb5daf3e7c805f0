"""`--json [FILE]`, one meaning on every command that prints results: those results as
JSON, on stdout (the human lines left out), or written to FILE (the lines printed as
usual). The benchmarks' tables stay on stdout, so their `--json` takes a FILE."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STDOUT = "-"


def add_json_flag(parser, what: str) -> None:
    parser.add_argument(
        "--json", nargs="?", const=STDOUT, metavar="FILE",
        help=f"{what} as JSON: on stdout, or written to FILE",
    )  # fmt: skip


def only_json(args) -> bool:
    """The command prints its JSON alone (`--json` without a FILE)."""
    return getattr(args, "json", None) == STDOUT


def emit_json(args, data: Any) -> None:
    """The results as `--json` asks: nothing without it, stdout, or FILE (said on stdout)."""
    dest = getattr(args, "json", None)
    if not dest:
        return
    text = json.dumps(data, indent=1, default=str)
    if dest == STDOUT:
        sys.stdout.write(text + "\n")
        return
    path = Path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"json       {path}")
