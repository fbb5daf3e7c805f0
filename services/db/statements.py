"""Small helpers the database operations share: the clock (`db_now`) and locked row reads.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

Now = datetime | ColumnElement[Any]


def db_now(now: datetime | None) -> Now:
    """`now`, or the database's clock (`now()`, the transaction's start) when None: hosts with
    skewed clocks agree; tests pass explicit times."""
    return now if now is not None else func.now()


def get_row(session: Session, entity: Any, row_id: int, *, lock: bool) -> Any:
    """A row read fresh, locked FOR UPDATE (`lock`: the caller changes it) or FOR SHARE."""
    return session.scalars(
        select(entity)
        .where(entity.id == row_id)
        .with_for_update(read=not lock)
        .execution_options(populate_existing=True)
    ).one_or_none()
