"""Where measurements are kept. An interface, so the farm can swap files for Postgres.

`JsonlRecordStore` appends one `MeasureRecord` JSON line per measurement and flushes it
to disk at once, so a killed tuner loses nothing it had measured.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from tunefarm.errors import RecordError
from tunefarm.records import MeasureRecord


class RecordStore(ABC):
    """Append-only store of measurements, and of the workloads they measured (so a
    record can be rebuilt without the file or registry it came from)."""

    @abstractmethod
    def put_workload(self, task: str, name: str, workload_json: str) -> None:
        """Called once per task when tuning starts; a task already stored is kept."""

    @abstractmethod
    def get_workload(self, task: str) -> tuple[str, str] | None:
        """(name, workload IRModule JSON) of a task, or None."""

    @abstractmethod
    def append(self, records: Iterable[MeasureRecord]) -> None:
        """Called after every measured batch; must be durable when it returns."""

    @abstractmethod
    def load(self, task: str | None = None) -> list[MeasureRecord]:
        """All records (of one task when `task` is given), oldest first."""


class JsonlRecordStore(RecordStore):
    """A JSON-lines file of `MeasureRecord`s, plus a sidecar `<file>.workloads` with one
    line `{"task": key, "name": name, "mod": tvm.ir.save_json(IRModule)}` per task.
    Unreadable lines (say, a line cut short by a crash) are skipped and counted in
    `skipped_lines`, never rewritten or dropped from the file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.workloads_path = self.path.with_name(self.path.name + ".workloads")
        self.skipped_lines = 0

    def put_workload(self, task: str, name: str, workload_json: str) -> None:
        if self.get_workload(task) is not None:
            return
        self.workloads_path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"task": task, "name": name, "mod": workload_json}, separators=(",", ":"))
        with open(self.workloads_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get_workload(self, task: str) -> tuple[str, str] | None:
        if not self.workloads_path.exists():
            return None
        with open(self.workloads_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(d, dict) and d.get("task") == task:
                    return str(d["name"]), str(d["mod"])
        return None

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
