"""Slot domains: what values a sketch's open decisions may take, how to draw one at
random (Ansor §4.2, random annotation) and how to mutate one (Ansor §5.1).

Two kinds of slot:
- `TileDomain`: a perfect tiling of an extent into `parts` factors (product == extent,
  innermost <= `max_innermost`), drawn uniformly from all such factorizations as
  Ansor's InitFillTileSize does (the vectorized tile: half its draws among those that
  fill whole vectors of the target);
- `ChoiceDomain`: an index into `n` options (fusion level, compute location, parallel
  granularity, unroll depth).

`Decider` fills the slots while the loop-nest model is built: a value given in
`decisions` is used (and checked against its domain), a missing one is drawn. With
`refit`, a given value outside its domain (a program of another task of the same
structure, other extents) is moved to the domain's `nearest` value instead of drawn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tunefarm.records import DecisionValue


class InvalidDecision(Exception):
    """A given decision does not fit its slot's domain (after mutation or crossover)."""


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


@lru_cache(maxsize=4096)
def factorizations(extent: int, parts: int, max_innermost: int) -> tuple[tuple[int, ...], ...]:
    """Every ordered tuple of `parts` positive ints with product `extent`, innermost
    (last) <= max_innermost."""
    if parts == 1:
        return ((extent,),) if extent <= max_innermost else ()
    out = []
    for d in divisors(extent):
        for rest in factorizations(extent // d, parts - 1, max_innermost):
            out.append((d, *rest))
    return tuple(out)


@dataclass(frozen=True)
class TileDomain:
    extent: int
    parts: int
    max_innermost: int = 64
    min_innermost: int = 1  # e.g. 2 for a loop that is split off to be vectorized
    vector_lanes: int = 0  # the innermost loop is vectorized with this many lanes (0: no preference)

    def options(self) -> tuple[tuple[int, ...], ...]:
        return _tile_options(self.extent, self.parts, self.max_innermost, self.min_innermost)

    def sample(self, rng: random.Random) -> tuple[int, ...]:
        """Uniform over the tilings; with `vector_lanes`, every other draw (at random) is
        uniform over those whose innermost factor fills whole vectors, if there are any.
        Every tiling stays in the domain: mutation and given decisions are unaffected."""
        if self.vector_lanes > 1 and rng.random() < 0.5:
            whole = _whole_vector_options(self.extent, self.parts, self.max_innermost, self.min_innermost, self.vector_lanes)
            if whole:
                return rng.choice(whole)
        return rng.choice(self.options())

    def contains(self, value: DecisionValue) -> bool:
        if not isinstance(value, tuple) or len(value) != self.parts or any(v < 1 for v in value):
            return False
        prod = 1
        for v in value:
            prod *= v
        if prod != self.extent:
            return False
        if self.min_innermost <= value[-1] <= self.max_innermost:
            return True
        return value in self.options()  # the fallbacks of _tile_options

    def mutate(self, value: tuple[int, ...], rng: random.Random) -> tuple[int, ...] | None:
        """Ansor's MutateTileSize: move a divisor of one level's factor to another level."""
        if self.extent == 1 or self.parts == 1:
            return None
        for _ in range(8):
            src, dst = rng.sample(range(self.parts), 2)
            if value[src] == 1:
                continue
            d = rng.choice([x for x in divisors(value[src]) if x > 1])
            new = list(value)
            new[src] //= d
            new[dst] *= d
            out = tuple(new)
            if out != value and self.contains(out):
                return out
        return None

    def nearest(self, value: DecisionValue) -> tuple[int, ...] | None:
        """The tiling of this extent closest to `value`, a tiling of another extent into
        as many parts: least weighted sum of |log factor differences|, inner levels
        weighing more (the innermost, the vector or unrolled tile, double), so the outer
        loops take up a change of extent. None for a value of another shape."""
        if not isinstance(value, tuple) or len(value) != self.parts or any(v < 1 for v in value):
            return None
        logs = _option_logs(self.extent, self.parts, self.max_innermost, self.min_innermost)
        weights = 1.0 + np.arange(self.parts) / self.parts  # outer levels give way first
        weights[-1] = 2.0
        distance = np.abs(logs - np.log([float(v) for v in value])) @ weights
        return self.options()[int(np.argmin(distance))]

    def describe(self) -> str:
        return f"tile {self.extent} into {self.parts} (inner <= {self.max_innermost})"


@lru_cache(maxsize=1024)
def _option_logs(extent: int, parts: int, max_inner: int, min_inner: int) -> np.ndarray:
    return np.log(np.array(_tile_options(extent, parts, max_inner, min_inner), dtype=np.float64))


@lru_cache(maxsize=4096)
def _whole_vector_options(extent: int, parts: int, max_inner: int, min_inner: int, lanes: int) -> tuple[tuple[int, ...], ...]:
    return tuple(o for o in _tile_options(extent, parts, max_inner, min_inner) if o[-1] % lanes == 0)


@lru_cache(maxsize=4096)
def _tile_options(extent: int, parts: int, max_inner: int, min_inner: int) -> tuple[tuple[int, ...], ...]:
    opts = factorizations(extent, parts, max_inner)
    if not opts:  # a prime extent above max_innermost: only the trivial inner 1
        opts = factorizations(extent, parts, extent)
        opts = tuple(o for o in opts if o[-1] == 1) or opts
    if min_inner > 1:
        opts = tuple(o for o in opts if o[-1] >= min_inner) or opts
    return opts


@dataclass(frozen=True)
class IntRange:
    """An integer in [lo, hi]: e.g. how many outer loops to fuse into the parallel loop."""

    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def contains(self, value: DecisionValue) -> bool:
        return isinstance(value, int) and self.lo <= value <= self.hi

    def mutate(self, value: int, rng: random.Random) -> int | None:
        if self.hi <= self.lo:
            return None
        new = rng.randint(self.lo, self.hi - 1)
        return new if new < value else new + 1

    def nearest(self, value: DecisionValue) -> int | None:
        return min(max(value, self.lo), self.hi) if isinstance(value, int) else None

    def describe(self) -> str:
        return f"integer in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class ChoiceDomain:
    n: int

    def sample(self, rng: random.Random) -> int:
        return rng.randrange(self.n)

    def contains(self, value: DecisionValue) -> bool:
        return isinstance(value, int) and 0 <= value < self.n

    def mutate(self, value: int, rng: random.Random) -> int | None:
        if self.n <= 1:
            return None
        new = rng.randrange(self.n - 1)
        return new if new < value else new + 1

    def nearest(self, value: DecisionValue) -> int | None:
        return min(max(value, 0), self.n - 1) if isinstance(value, int) else None

    def describe(self) -> str:
        return f"choice of {self.n}"


Domain = TileDomain | ChoiceDomain | IntRange


class Decider:
    """Fills slots while a program is built: given values are used, missing ones drawn.

    After the build, `decisions` holds every slot the program used and `domains` their
    domains; slots given but not used are dropped (e.g. after a location change).
    """

    def __init__(
        self, given: dict[str, DecisionValue] | None = None, rng: random.Random | None = None, *, refit: bool = False
    ):
        self.given = given or {}
        self.rng = rng
        self.refit = refit
        self.decisions: dict[str, DecisionValue] = {}
        self.domains: dict[str, Domain] = {}

    def decide(self, slot: str, domain: Domain, default: DecisionValue | None = None) -> DecisionValue:
        """The slot's value. `default`: the value a slot added after some records were
        made takes when given decisions lack it (and nothing is drawn), so that those
        records still rebuild the program they measured."""
        if slot not in self.given and self.rng is None and default is not None:
            self.given = {**self.given, slot: default}
        if slot in self.given:
            value = self.given[slot]
            if not domain.contains(value):
                if self.rng is None:
                    raise InvalidDecision(f"{slot}={value!r} is outside {domain.describe()}")
                near = domain.nearest(value) if self.refit else None
                # repair, e.g. a location domain that shrank
                value = near if near is not None and domain.contains(near) else domain.sample(self.rng)
        elif self.rng is None:
            raise InvalidDecision(f"no value for slot {slot}")
        else:
            value = domain.sample(self.rng)
        self.decisions[slot] = value
        self.domains[slot] = domain
        return value
