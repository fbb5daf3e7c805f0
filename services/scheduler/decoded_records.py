"""Measurement records decoded once per scheduler process.

A measurement reaches two readers in the scheduler: the job that proposed it (its
`FarmMeasurer` polls the job's new measurements and hands them to the tuner) and, once
its agent is vouched for, the class's shared cost model (`ClassModels.catch_up`). Both
take the record from `DecodedRecords` by measurement id: the first one decodes the stored
JSON into a `MeasureRecord`, the second gets that same immutable record (and the class
model then reads only the records no job of this process has seen). Records are kept for
the most recent `capacity` measurements.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from services.db.codec import record_from_json
from tunefarm.records import MeasureRecord

DECODED_RECORDS_KEPT = 20_000
"""Records kept in a scheduler process: enough for the measurements of every running job
between their poll and their agent's confirmation; a record evicted before the class
model reads it is read and decoded again, nothing more."""


class DecodedRecords:
    def __init__(self, capacity: int = DECODED_RECORDS_KEPT):
        self.capacity = capacity
        self._records: OrderedDict[int, MeasureRecord] = OrderedDict()
        self._lock = threading.Lock()  # jobs poll on the service's thread, finishing jobs on theirs
        self.decoded = 0  # records decoded here (for tests and metrics)

    def decode(self, measurement_id: int, stored: Mapping[str, Any]) -> MeasureRecord:
        """The measurement's record: the one decoded before, or `stored` decoded now."""
        with self._lock:
            known = self._records.get(measurement_id)
            if known is not None:
                self._records.move_to_end(measurement_id)
                return known
        record = record_from_json(stored)
        with self._lock:
            self.decoded += 1
            self._records[measurement_id] = record
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        return record

    def known(self, measurement_ids: Iterable[int]) -> dict[int, MeasureRecord]:
        """The records of these measurements decoded before (those still kept)."""
        with self._lock:
            return {i: self._records[i] for i in measurement_ids if i in self._records}
