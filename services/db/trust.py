"""Whose timings the farm believes: a confirmation's verdict, and an agent's standing.

An agent holds a valid token, and may still lie about its timings (or run on a broken
board). Two checks, by evidence the agent does not control:

- the timing floor (`services.db.timing_floor`): a time faster than the class's peak
  allows is refused (`Agent.below_floor` counts them);
- confirmations (`services.db.confirmations`): a measurement that becomes its task's best
  is measured again, by an agent of the class of another party that is not flagged when
  one is live (else by the same party, on a later lease), and counts as a best only when
  the two agree (`verdict`).

A *party* is whoever holds an agent token: the agents registered with the same token
(`same_party`, `same_party_clause`). One token may register several agents (names), so
agents of one token are one party: they may lie alike, and one's timing is no evidence
for or against another's, as an agent's second timing of its own kernel is none. An
agent without a token (none was given, or its token was deleted) is a party of its own.

An agent's standing follows from its counters (`standing`, and `flagged_clause` /
`good_standing_clause`, the same rules in SQL):

| standing | when | its measurements |
|---|---|---|
| quarantined | an operator said so (`tunefarm farm agent quarantine`) | no leases; its unconfirmed measurements count for nothing |
| flagged | a result below the floor, or at least as many timings disputed by other parties as confirmed | shown on the dashboard and in `tunefarm devices`; leased nothing (`leases.lease_withheld`) until an operator unflags it; train no model |
| unconfirmed | no timing of it confirmed yet | train no model, yet |
| trusted | otherwise | train the class's cost model |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import ColumnElement, and_, or_

from services.db.models import Agent
from services.db.states import ConfirmationState
from tunefarm.records import ErrorKind, MeasureRecord

CONFIRM_TOLERANCE = 1.0
"""A confirmation agrees with a claimed time when the kernel's fastest repeat on the
confirming agent is at most (1 + CONFIRM_TOLERANCE) x the claimed time. A false timing
is off by far more; two boards of a class, a loaded host, and a best that is the
luckiest of many measurements are off by less. Faster than claimed agrees too: the
kernel is at least as fast as its measurement said."""


class Standing(StrEnum):
    TRUSTED = "trusted"
    UNCONFIRMED = "unconfirmed"
    FLAGGED = "flagged"
    QUARANTINED = "quarantined"


@dataclass(frozen=True)
class AgentCounts:
    """What an agent's standing depends on (the `Agent` columns of the same names)."""

    below_floor: int
    confirmations_agreed: int
    confirmations_disputed: int
    quarantined: bool

    @staticmethod
    def of(agent: Agent) -> AgentCounts:
        return AgentCounts(
            int(agent.below_floor or 0),
            int(agent.confirmations_agreed or 0),
            int(agent.confirmations_disputed or 0),
            agent.quarantined_at is not None,
        )


def same_party(a: tuple[int, int | None], b: tuple[int, int | None]) -> bool:
    """Whether two agents, each `(agent id, token id)`, are one party: the same agent, or
    two registered with the same token."""
    return a[0] == b[0] or (a[1] is not None and a[1] == b[1])


def same_party_clause(agent_id: int, token_id: int | None) -> ColumnElement[bool]:
    """`same_party` of an `Agent` row and the agent `(agent_id, token_id)`, in SQL."""
    if token_id is None:
        return Agent.id == agent_id
    return or_(Agent.id == agent_id, Agent.token_id.is_not_distinct_from(token_id))  # never NULL: negatable


def verdict(claimed: float, confirmation: MeasureRecord, *, same_party: bool) -> ConfirmationState:
    """What a confirmation makes of a measured time `claimed` (seconds): confirmed when
    it agrees, or when its own party ran the kernel again (the only party of its class:
    the same agent, or another agent of the same token): a second time of its own is no
    evidence either way, and one slower than the first is noise on a loaded board, not a
    reason to drop a kernel whose output checked; disputed when another party timed it
    slower or found its output wrong; failed when it gave no comparable time (an error).
    A confirmation by the same party never makes a time count where another party was
    live to check it: such a batch is leased to the same party only when none is."""
    if confirmation.is_valid:
        if same_party or min(confirmation.costs) <= (1.0 + CONFIRM_TOLERANCE) * claimed:
            return ConfirmationState.CONFIRMED
        return ConfirmationState.DISPUTED
    if confirmation.error_kind is ErrorKind.WRONG_RESULT and not same_party:
        return ConfirmationState.DISPUTED
    return ConfirmationState.FAILED


def is_flagged(counts: AgentCounts) -> bool:
    """Its timings disagree with its class's physics or with its class's other agents."""
    disputed = counts.confirmations_disputed
    return counts.below_floor > 0 or (disputed > 0 and disputed >= counts.confirmations_agreed)


def standing(counts: AgentCounts) -> Standing:
    if counts.quarantined:
        return Standing.QUARANTINED
    if is_flagged(counts):
        return Standing.FLAGGED
    if counts.confirmations_agreed < 1:
        return Standing.UNCONFIRMED
    return Standing.TRUSTED


def flag_reasons(counts: AgentCounts) -> list[str]:
    """Why an agent is flagged, in words (empty: it is not)."""
    out = []
    if counts.below_floor:
        out.append(f"{counts.below_floor} result(s) below the timing floor")
    if is_flagged(counts) and counts.confirmations_disputed:
        out.append(
            f"{counts.confirmations_disputed} timing(s) disputed by other agents, "
            f"{counts.confirmations_agreed} confirmed"
        )
    return out


def flagged_clause() -> ColumnElement[bool]:
    """`is_flagged` of an `Agent` row, in SQL."""
    disputed = Agent.confirmations_disputed
    return or_(Agent.below_floor > 0, and_(disputed > 0, disputed >= Agent.confirmations_agreed))


def good_standing_clause() -> ColumnElement[bool]:
    """`standing(...) is TRUSTED` of an `Agent` row, in SQL: its measurements are
    vouched for (they train the class's cost model)."""
    return and_(Agent.quarantined_at.is_(None), Agent.confirmations_agreed >= 1, ~flagged_clause())


def may_confirm_clause() -> ColumnElement[bool]:
    """An agent whose timing may confirm another agent's: not quarantined, not flagged."""
    return and_(Agent.quarantined_at.is_(None), ~flagged_clause())


__all__ = [
    "CONFIRM_TOLERANCE",
    "AgentCounts",
    "Standing",
    "same_party",
    "same_party_clause",
    "verdict",
    "is_flagged",
    "standing",
    "flag_reasons",
    "flagged_clause",
    "good_standing_clause",
    "may_confirm_clause",
]
