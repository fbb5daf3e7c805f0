"""The names a local farm gives: its agents' (unique to its state dir, valid agent names)
and this machine's device class."""

from __future__ import annotations

import hashlib
import platform
import re
import socket
from pathlib import Path
from typing import Any

from tunefarm.export import target_arch


def name_part(text: str) -> str:
    """`text` in the characters an agent's name may have (`wire.AGENT_NAME_RULE`): a state
    directory or class name with a space or another character becomes '-' there."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "farm"


def agent_base_name(state_dir: Path) -> str:
    """The name the farm's first agent registers with: the host's, the state dir's, and a
    digest of the state dir's path. Two farms started from `a/farm` and `b/farm` on one
    database have agents of their own (with the directory's name only, the second one's
    agent was refused the first's name, and its jobs waited for ever); the same state dir
    gets the same name at every start (`claim_agent_names` hands it to the new token)."""
    path = str(state_dir.resolve())
    digest = hashlib.sha256(path.encode()).hexdigest()[:6]
    return name_part(f"{socket.gethostname()}-{state_dir.resolve().name}")[:64] + f"-{digest}-agent"


def detected_class_name(target: dict[str, Any]) -> str:
    """This machine's class name, as an agent names it when given none
    (`services.agent.capabilities.default_device_class`): arch-cpu-cores."""
    arch = target_arch(target) or platform.machine()
    return f"{arch}-{target.get('mcpu', 'generic')}-{target.get('num-cores', 1)}c"
