"""Where the operator's actions on the farm's database used to live (the `tunefarm farm`
commands): they are `services.db`'s now. Teams: `services.db.teams`; tokens, and agent
names handed to a new agent token: `services.db.tokens`; device classes:
`services.db.device_classes`.

Kept only while importers outside `services/api` still name this module
(`tunefarm_app/operator_commands.py`, `farm_local.py`, `bench/farm.py`, `bench/farm_load.py`,
`bench/farm_progress.py`; `tests/farm_state.py`, `test_farm.py`, `test_farm_isa.py`,
`test_isa.py`, `test_trust.py`); delete it once they import from `services.db`
(`admin.revoke_token` is `tokens.revoke_token_by_ref` there).
"""

from __future__ import annotations

from services.db.device_classes import ensure_device_class
from services.db.teams import ensure_team
from services.db.tokens import (
    AgentNamesInUse,
    agent_token_id,
    claim_agent_names,
    find_token,
    issue_agent_token,
    issue_team_token,
    list_tokens,
    register_token,
)
from services.db.tokens import revoke_token_by_ref as revoke_token

__all__ = [
    "AgentNamesInUse",
    "agent_token_id",
    "claim_agent_names",
    "ensure_device_class",
    "ensure_team",
    "find_token",
    "issue_agent_token",
    "issue_team_token",
    "list_tokens",
    "register_token",
    "revoke_token",
]
