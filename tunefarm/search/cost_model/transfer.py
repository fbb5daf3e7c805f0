"""Which device class a new class's cost model starts from (tune on one device, transfer
to another).

A class with no cost model of its own starts from the latest model of its *nearest*
class (`XGBCostModel.transferred`: the same trees, and that class's measurements as prior
data whose weight fades as the new class measures). Nearest, from the two targets:

1. the same target kind only (an `llvm` CPU model never ranks GPU programs: other features);
2. the same architecture family first (x86 before arm for an x86 class: `tunefarm.isa`);
3. then the larger overlap of instruction-set extensions (Jaccard index of the extensions
   LLVM enables for each target's mcpu/mattr: `haswell` is nearer to `znver2` than to
   `x86-64-v2`, and nearer to `x86-64-v2` than to an AVX-512 class);
4. then the closer core count (ratio), and last the name (a deterministic choice).

`similarity` gives the sort key, `nearest` the best candidate (None when no candidate has
the same kind).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tunefarm.isa import TargetISA, target_isa


@dataclass(frozen=True)
class Similarity:
    """How near a candidate target is to the new one (larger tuples are nearer)."""

    same_family: bool
    isa_overlap: float  # Jaccard index of the two extension sets (1.0 when both are empty)
    core_closeness: float  # -|log2(cores ratio)|: 0 for the same core count

    def key(self) -> tuple[bool, float, float]:
        return (self.same_family, self.isa_overlap, self.core_closeness)

    def describe(self) -> str:
        family = "same architecture family" if self.same_family else "another architecture family"
        return f"{family}, ISA overlap {self.isa_overlap:.2f}, core-count distance {-self.core_closeness:.2f}"


def similarity(target: dict[str, Any], other: dict[str, Any], isa: TargetISA, other_isa: TargetISA) -> Similarity:
    """How near `other` is to `target` (their `target_isa`s given)."""
    union = isa.extensions | other_isa.extensions
    overlap = len(isa.extensions & other_isa.extensions) / len(union) if union else 1.0
    cores, other_cores = int(target.get("num-cores") or 1), int(other.get("num-cores") or 1)
    closeness = -abs(math.log2(max(cores, 1) / max(other_cores, 1)))
    return Similarity(isa.family == other_isa.family, overlap, closeness)


@dataclass(frozen=True)
class Choice:
    """The nearest candidate: its name and how near it is."""

    name: str
    similarity: Similarity


def nearest(target: dict[str, Any], candidates: Sequence[tuple[str, dict[str, Any]]]) -> Choice | None:
    """The candidate (name, target) nearest to `target` (module doc); None when none has
    the same kind."""
    same_kind = [(name, t) for name, t in candidates if t.get("kind") == target.get("kind")]
    if not same_kind:
        return None
    isa = target_isa(target)
    scored = [(similarity(target, t, isa, target_isa(t)), name) for name, t in same_kind]
    best_sim, best_name = min(scored, key=lambda pair: (tuple(-x for x in pair[0].key()), pair[1]))
    return Choice(best_name, best_sim)
