"""Where measurements are kept. An interface, so the farm can swap files for Postgres.

`JsonlRecordStore` appends one `MeasureRecord` JSON line per measurement and flushes it
to disk at once, so a killed tuner loses nothing it had measured.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from tunefarm.errors import RecordError
from tunefarm.records import MeasureRecord


class RecordStore(ABC):
    """Append-only store of measurements."""

    @abstractmethod
    def append(self, records: Iterable[MeasureRecord]) -> None:
        """Called after every measured batch; must be durable when it returns."""

    @abstractmethod
    def load(self, task: str | None = None) -> list[MeasureRecord]:
        """All records (of one task when `task` is given), oldest first."""


class JsonlRecordStore(RecordStore):
    """A JSON-lines file. Unreadable lines (say, a line cut short by a crash) are skipped
    and counted in `skipped_lines`, never rewritten or dropped from the file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.skipped_lines = 0

    def append(self, records: Iterable[MeasureRecord]) -> None:
        lines = [r.to_json() + "\n" for r in records]
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            # A file that ends without a newline (a torn write) must not glue onto ours.
            if f.tell() > 0 and not self._ends_with_newline():
                f.write("\n")
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def load(self, task: str | None = None) -> list[MeasureRecord]:
        if not self.path.exists():
            return []
        if self.path.is_dir():
            raise RecordError(f"{self.path} is a directory, not a records file")
        out: list[MeasureRecord] = []
        self.skipped_lines = 0
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = MeasureRecord.from_json(line)
                except (ValueError, KeyError, TypeError):
                    self.skipped_lines += 1
                    continue
                if task is None or rec.task == task:
                    out.append(rec)
        return out
