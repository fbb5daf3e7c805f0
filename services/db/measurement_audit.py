"""Whether a job's measurements add up: every search candidate measured exactly once,
every best confirmed exactly once, no candidate proposed twice, every batch done.

What the farm promises a team ("a farm that loses nothing"), read back from the
database: the farm tests assert it after each job, and `tools/gpu_farm_check.py` after
the job it runs on a GPU machine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.db.models import Batch, BatchCandidate, Confirmation, Measurement
from services.db.states import BatchState


@dataclass(frozen=True)
class MeasurementAudit:
    job_id: int
    batch_states: dict[str, int]  # batch state -> batches of the job
    candidates: int  # search candidates (confirmation batches not counted)
    distinct_candidates: int  # (task, candidate key) pairs among them
    measurements_per_candidate: dict[int, int]  # measurements -> candidates with that many
    confirmations_per_best: dict[int, int]  # confirmations -> confirmation candidates with that many
    measurements: int  # the job's measurement rows

    def problems(self, trials: int) -> list[str]:
        """What is wrong with the job's measurements for a budget of `trials`; [] when none."""
        out = []
        if set(self.batch_states) != {BatchState.DONE.value}:
            out.append(f"batches not all done: {self.batch_states}")
        if set(self.measurements_per_candidate) - {1}:
            out.append(f"candidates by measurements taken (should all be 1): {self.measurements_per_candidate}")
        if not self.confirmations_per_best:
            out.append("no best was measured again (no confirmation batch)")
        elif set(self.confirmations_per_best) != {1}:
            out.append(f"bests by confirmations (should all be 1): {self.confirmations_per_best}")
        if self.distinct_candidates != self.candidates:
            out.append(f"{self.candidates - self.distinct_candidates} candidates proposed twice")
        if not self.candidates == self.measurements == trials:
            out.append(f"{self.candidates} candidates and {self.measurements} measurements for {trials} trials")
        return out


def measurement_audit(session: Session, job_id: int) -> MeasurementAudit:
    states = Counter(s.value for s in session.scalars(select(Batch.state).where(Batch.job_id == job_id)))
    rows = session.execute(
        select(Batch.job_task_id, BatchCandidate.candidate_key, func.count(Measurement.id))
        .join(Batch, Batch.id == BatchCandidate.batch_id)
        .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
        .where(Batch.job_id == job_id, Batch.confirms_measurement_id.is_(None))
        .group_by(BatchCandidate.id, Batch.job_task_id)
    ).all()
    confirmations = session.scalars(
        select(func.count(Confirmation.id))
        .select_from(BatchCandidate)
        .join(Batch, Batch.id == BatchCandidate.batch_id)
        .outerjoin(Confirmation, Confirmation.batch_candidate_id == BatchCandidate.id)
        .where(Batch.job_id == job_id, Batch.confirms_measurement_id.is_not(None))
        .group_by(BatchCandidate.id)
    ).all()
    measurements = session.scalar(select(func.count()).select_from(Measurement).where(Measurement.job_id == job_id))
    return MeasurementAudit(
        job_id=job_id,
        batch_states=dict(states),
        candidates=len(rows),
        distinct_candidates=len({(task, key) for task, key, _ in rows}),
        measurements_per_candidate=dict(Counter(n for _, _, n in rows)),
        confirmations_per_best=dict(Counter(confirmations)),
        measurements=int(measurements or 0),
    )
