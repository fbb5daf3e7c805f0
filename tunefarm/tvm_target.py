"""TVM's `Target` from a target as tunefarm keeps it (a JSON dict), with a `TargetError` naming
the dict when TVM refuses it.
"""

from __future__ import annotations

import json
from typing import Any

from tunefarm.errors import TargetError


def to_tvm_target(data: dict[str, Any]):
    import tvm

    try:
        return tvm.target.Target(data)
    except Exception as exc:  # TVM raises ValueError / TVMError with long texts
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(f"TVM rejects the target {json.dumps(data)}: {first}") from None
