"""A task's search space: its sketches and the programs they give.

`ProgramSpace` turns decisions into programs (via the loop-nest model) and back:
sampling draws every slot at random (Ansor §4.2), mutation changes one slot, crossover
mixes two parents' blocks (§5.1), and every program is identified by its `Candidate`
(sketch index + decisions). Feature matrices are cached by candidate key, so a program
the evolution meets again costs nothing. Pure Python: no TVM here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tunefarm.records import Candidate, DecisionValue
from tunefarm.search.features import batch_features, feature_width
from tunefarm.search.space.dag import ComputeDag
from tunefarm.search.space.program import InvalidProgram, Program
from tunefarm.search.space.rule_set import RuleSet
from tunefarm.search.space.sketch import Sketch
from tunefarm.search.space.slots import ChoiceDomain, Decider, Domain, IntRange, InvalidDecision, TileDomain

MUTATION_TRIES = 8
"""New values of the chosen slot a mutation tries when a value breaks a limit that no
repair around it mends (a tile whose own thread or vthread factor is past the GPU's)."""


@lru_cache(maxsize=4096)
def slot_kind(slot: str) -> str:
    """Which mutation rule a slot belongs to (see SearchConfig.mutation_weights)."""
    tail = slot.rsplit(".", 1)[-1]
    if ".tile." in slot or tail in ("rfactor", "vector", "inner_axis"):
        return "tile"
    if tail == "unroll":
        return "unroll"
    if tail in ("location", "fuse_level"):
        return "location"
    if tail == "parallel":
        return "parallel"
    if tail == "threads":
        return "threads"
    if tail == "pipeline":
        return "pipeline"
    return "other"


def slot_block(slot: str, blocks: set[str]) -> str:
    """The block a slot belongs to (block names may contain dots, slots add one or two)."""
    for cut in (slot.rsplit(".", 1)[0], slot.rsplit(".", 2)[0]):
        if cut in blocks:
            return cut
    return slot.rsplit(".", 1)[0]


@dataclass
class Built:
    candidate: Candidate
    program: Program
    domains: dict[str, Domain]


class ProgramSpace:
    def __init__(self, dag: ComputeDag, sketches: list[Sketch], rules: RuleSet):
        if not sketches:
            raise ValueError("a program space needs at least one sketch")
        self.dag = dag
        self.sketches = sketches
        self.rules = rules
        self.empty_features = np.zeros((0, feature_width(rules.feature_version)), dtype=np.float32)
        self._features: dict[str, np.ndarray] = {}
        self._domains: dict[str, dict[str, Domain]] = {}
        self.invalid_draws = 0

    # -- building
    def build(
        self, sketch: int, decisions: dict[str, DecisionValue], rng: random.Random | None = None, *, refit: bool = False
    ) -> Built:
        """The program of a sketch and decisions; with `rng`, slots missing or outside
        their domain are drawn at random (with `refit`, moved to their domain's nearest
        value where it has one). Raises InvalidProgram."""
        decider = Decider(decisions, rng, refit=refit)
        try:
            prog = self.rules.build(self.dag, self.sketches[sketch], decider)
        except InvalidDecision as exc:
            raise InvalidProgram(str(exc)) from None
        cand = Candidate.make(sketch, decider.decisions)
        self._domains.setdefault(cand.key, decider.domains)
        return Built(cand, prog, decider.domains)

    def program(self, cand: Candidate) -> Program:
        return self.build(cand.sketch, cand.as_dict()).program

    def sample(self, rng: random.Random) -> Built | None:
        sketch = rng.randrange(len(self.sketches))
        try:
            return self.build(sketch, {}, rng)
        except InvalidProgram:
            self.invalid_draws += 1
            return None

    def sample_many(self, n: int, rng: random.Random, max_invalid: int = 200) -> list[Built]:
        out: list[Built] = []
        seen: set[str] = set()
        invalid_streak = 0
        while len(out) < n and invalid_streak < max_invalid:
            b = self.sample(rng)
            if b is None or b.candidate.key in seen:
                invalid_streak += 1
                continue
            invalid_streak = 0
            seen.add(b.candidate.key)
            out.append(b)
        return out

    # -- evolution operators
    def mutate(self, parent: Built, rng: random.Random, weights: dict[str, float]) -> Built | None:
        """Change one slot, chosen by mutation kind weight (Ansor's mutation rules). A
        new value that breaks a limit is repaired around (`_repair`); where no repair
        keeps it, another new value of the same slot is tried (`MUTATION_TRIES`)."""
        by_kind: dict[str, list[str]] = {}
        for slot, dom in parent.domains.items():
            if isinstance(dom, TileDomain) and (dom.extent == 1 or dom.parts == 1):
                continue
            if isinstance(dom, ChoiceDomain) and dom.n <= 1:
                continue
            if isinstance(dom, IntRange) and dom.hi <= dom.lo:
                continue
            by_kind.setdefault(slot_kind(slot), []).append(slot)
        kinds = [k for k in by_kind if weights.get(k, 0) > 0]
        if not kinds:
            return None
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        slot = rng.choice(by_kind[kind])
        for _ in range(MUTATION_TRIES):
            decisions = parent.candidate.as_dict()
            new = parent.domains[slot].mutate(decisions[slot], rng)
            if new is None:
                return None
            decisions[slot] = new
            try:
                return self.build(parent.candidate.sketch, decisions, rng)
            except InvalidProgram:
                pass
            repaired = self._repair(parent.candidate.sketch, decisions, slot, rng)
            if repaired is not None:
                return repaired
        self.invalid_draws += 1
        return None

    def _repair(self, sketch: int, decisions: dict[str, DecisionValue], kept: str, rng: random.Random) -> Built | None:
        """A mutated program that broke a limit, made valid again: the mutated tile slot
        is kept and the block's other tile slots are drawn anew around it (a GPU block's
        threads, vthreads and registers depend on all its tile sizes together, so moving
        one factor usually breaks them only with the others as they were; the draw is
        conditioned on the kept slot). A deeper software pipeline that no longer fits
        the shared memory: the block's tiles drawn anew around it. None for a slot of
        another kind, or when no valid program keeps it."""
        kind = slot_kind(kept)
        if kind == "tile":
            block_tiles = kept.rsplit(".", 1)[0] + "."
        elif kind == "pipeline":
            block_tiles = kept.rsplit(".", 1)[0] + ".tile."
        else:
            return None
        trimmed = {s: v for s, v in decisions.items() if s == kept or not s.startswith(block_tiles)}
        if len(trimmed) == len(decisions):
            return None
        try:
            return self.build(sketch, trimmed, rng)
        except InvalidProgram:
            return None

    def crossover(self, a: Built, b: Built, rng: random.Random) -> Built | None:
        """Take each block's decisions from one parent or the other (same sketch only)."""
        if a.candidate.sketch != b.candidate.sketch:
            return None
        blocks = set(self.dag_blocks())
        da, db = a.candidate.as_dict(), b.candidate.as_dict()
        owners = {slot_block(s, blocks) for s in set(da) | set(db)}
        take_b = {blk for blk in sorted(owners) if rng.random() < 0.5}  # sorted: the same draws in every process
        if not take_b or take_b == owners:
            return None
        mixed = {s: (db if slot_block(s, blocks) in take_b else da).get(s) for s in set(da) | set(db)}
        mixed = {s: v for s, v in mixed.items() if v is not None}
        try:
            return self.build(a.candidate.sketch, mixed, rng)
        except InvalidProgram:
            self.invalid_draws += 1
            return None

    def dag_blocks(self) -> list[str]:
        names = [b.name for b in self.dag.blocks]
        return names + [f"{n}_rf" for n in names] + [f"{b.write.buffer}_global" for b in self.dag.blocks]

    def domains_of(self, cand: Candidate) -> dict[str, Domain]:
        if cand.key not in self._domains:
            self.build(cand.sketch, cand.as_dict())
        return self._domains[cand.key]

    def transfer(self, signature: str, decisions: dict[str, DecisionValue], rng: random.Random) -> Built | None:
        """A program of this space made from another task's program of the sketch with the
        same `signature` (same structure, other extents): its decisions, tile sizes refit
        to this task's extents, slots it lacks drawn at random. None when no sketch here
        has that signature or the program is invalid."""
        index = next((i for i, s in enumerate(self.sketches) if s.signature == signature), None)
        if index is None:
            return None
        try:
            return self.build(index, decisions, rng, refit=True)
        except InvalidProgram:
            self.invalid_draws += 1
            return None

    def rebuild(self, cand: Candidate) -> Built | None:
        try:
            return self.build(cand.sketch, cand.as_dict())
        except InvalidProgram:
            return None

    # -- features
    def features(self, built: list[Built]) -> list[np.ndarray]:
        """Feature matrices (cached by candidate key)."""
        missing = [b for b in built if b.candidate.key not in self._features]
        if missing:
            uniq: dict[str, Built] = {b.candidate.key: b for b in missing}
            mats = batch_features([b.program for b in uniq.values()], self.rules.feature_version, self.rules.gpu_limits)
            for key, m in zip(uniq, mats):
                self._features[key] = m
        return [self._features[b.candidate.key] for b in built]

    def features_of(self, cands: list[Candidate]) -> list[np.ndarray]:
        """Features of candidates given by decisions (e.g. from records); invalid ones
        (say, records of another sketch set) get an empty matrix."""
        built, idx = [], []
        out = [self.empty_features] * len(cands)
        for i, c in enumerate(cands):
            if c.key in self._features:
                out[i] = self._features[c.key]
                continue
            if not 0 <= c.sketch < len(self.sketches):
                continue
            b = self.rebuild(c)
            if b is not None:
                built.append(b)
                idx.append(i)
        for i, m in zip(idx, self.features(built)):
            out[i] = m
        return out

    def forget_features(self, keep: set[str]) -> None:
        """Drop cached features except `keep` (bounds memory across rounds)."""
        self._features = {k: v for k, v in self._features.items() if k in keep}
        self._domains = {k: v for k, v in self._domains.items() if k in keep}
