"""A tuned model's runs on an agent of its class, read by the scheduler while it waits for
them (`services.scheduler.model_check`); creating, leasing and finishing them is
`model_runs`.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from services.db.models import ModelRun


def read_model_run(session: Session, *, model_run_id: int) -> ModelRun | None:
    """The model run's row (None: it is gone). A finished one (done or failed) is detached
    from the session: it stays readable, as it is, once the transaction ends."""
    row = session.get(ModelRun, model_run_id)
    if row is not None and row.state.is_terminal:
        session.expunge(row)
    return row
