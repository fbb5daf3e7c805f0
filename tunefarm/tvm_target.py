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


def llvm_cpus(data: dict[str, Any]) -> list[str]:
    """The CPU names LLVM knows for an LLVM target's triple, sorted (empty: LLVM cannot list
    them for it)."""
    import tvm

    triple = {k: v for k, v in data.items() if k in ("kind", "mtriple")}  # an unknown mcpu makes LLVM log an error
    return sorted(str(c) for c in tvm.target.codegen.llvm_get_cpu_archlist(to_tvm_target(triple)))


def check_llvm_cpu(data: dict[str, Any]) -> None:
    """Raise `TargetError` when an LLVM target's `mcpu` is a name LLVM does not know for
    its triple: LLVM would take it as a generic CPU without a word, and every kernel would
    be built for that."""
    mcpu = data.get("mcpu")
    if data.get("kind") != "llvm" or not mcpu:
        return
    known = llvm_cpus(data)
    if known and mcpu not in known:
        raise TargetError(f"LLVM knows no CPU {mcpu!r} for this target (e.g. {', '.join(known[:6])}, ...)")
