"""Teams: `ensure_team`, and what a team has in progress (`lock_active_work`, for its quota).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.jobs import ACTIVE_JOB_STATES
from services.db.models import Job, Team


def ensure_team(session: Session, *, name: str) -> Team:
    """The team `name`, created if it does not exist."""
    session.execute(pg_insert(Team).values(name=name).on_conflict_do_nothing(index_elements=[Team.name]))
    return session.scalars(select(Team).where(Team.name == name)).one()


@dataclass(frozen=True)
class ActiveWork:
    """A team's jobs in progress (queued, running or finishing) and the trials they have
    still to run, together."""

    jobs: int
    trials: int


def lock_active_work(session: Session, *, team_id: int) -> ActiveWork:
    """The team's work in progress. Locks the team's row until the transaction ends, so two
    jobs created at once are counted one after the other."""
    session.execute(select(Team.id).where(Team.id == team_id).with_for_update())
    jobs, trials = session.execute(
        select(func.count(), func.coalesce(func.sum(func.greatest(Job.trial_budget - Job.trials_used, 0)), 0)).where(
            Job.team_id == team_id, Job.state.in_(ACTIVE_JOB_STATES)
        )
    ).one()
    return ActiveWork(jobs=jobs, trials=trials)
