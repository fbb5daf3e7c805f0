"""Evolutionary search on the loop-nest model with stand-in cost models (no compiler)."""

from __future__ import annotations

import random

import numpy as np

from tunefarm.search.config import SearchConfig
from tunefarm.search.cost_model import RandomCostModel
from tunefarm.search.cost_model.base import CostModel
from tunefarm.search.evolution import EvolutionarySearch
from tunefarm.search.features import FEATURE_NAMES
from tunefarm.search.space.program_space import ProgramSpace
from tunefarm.search.task import make_task
from tunefarm.workloads import registry

SMALL_SEARCH = SearchConfig(population=64, generations=2)


class PreferVectorized(CostModel):
    """Scores programs by their vector length: a deterministic, learnable stand-in."""

    col = FEATURE_NAMES.index("vec_prod")

    def update(self, features, costs, groups):
        pass

    def predict(self, features):
        return np.array([f[:, self.col].sum() if len(f) else -np.inf for f in features])

    def save(self, path):
        pass

    @classmethod
    def load(cls, path):
        return cls()

    @property
    def num_samples(self):
        return 0


def _space(op="matmul_relu", params=None) -> ProgramSpace:
    wl = registry.make(op, params or {"M": 64, "N": 64, "K": 64})
    return make_task(wl, {"kind": "llvm", "num-cores": 2}).space


def test_evolution_never_proposes_a_measured_program():
    space = _space()
    search = EvolutionarySearch(space, SMALL_SEARCH, random.Random(5))
    measured: set[str] = set()
    for model, ready in [(RandomCostModel(1), False), (PreferVectorized(), True), (PreferVectorized(), True)]:
        picks, stats = search.next_batch(model, 16, measured, [], model_ready=ready)
        keys = [b.candidate.key for b in picks[:16]]
        assert len(keys) == 16
        assert len(set(keys)) == len(keys)
        assert not measured & set(keys)
        measured |= set(keys)
        if ready:
            assert stats.generations == SMALL_SEARCH.generations and stats.scored > 0


def test_evolution_follows_the_cost_model():
    space = _space()
    rng = random.Random(11)
    model = PreferVectorized()
    randoms = space.sample_many(64, rng)
    picks, _ = EvolutionarySearch(space, SMALL_SEARCH, rng).next_batch(model, 16, set(), [], model_ready=True)
    pick_scores = model.predict(space.features(picks[:16]))
    random_scores = model.predict(space.features(randoms))
    assert np.median(pick_scores) > np.median(random_scores)


def test_best_measured_programs_seed_the_population():
    space = _space()
    rng = random.Random(2)
    best = [b.candidate for b in space.sample_many(8, rng)]
    measured = {c.key for c in best}
    picks, _ = EvolutionarySearch(space, SMALL_SEARCH, rng).next_batch(
        PreferVectorized(), 8, measured, best, True
    )
    assert not measured & {b.candidate.key for b in picks}


def test_mutation_changes_one_slot_and_stays_valid():
    space = _space()
    rng = random.Random(4)
    weights = SearchConfig().mutation_weights
    changed = 0
    for parent in space.sample_many(40, rng):
        child = space.mutate(parent, rng, weights)
        if child is None:
            continue
        a, b = parent.candidate.as_dict(), child.candidate.as_dict()
        diff = [k for k in a if a.get(k) != b.get(k)] + [k for k in b if k not in a]
        assert diff, "a mutation must change the program"
        assert child.candidate.sketch == parent.candidate.sketch
        assert space.program(child.candidate) is not None
        changed += 1
    assert changed >= 30


def test_crossover_takes_each_block_from_a_parent():
    space = _space("conv2d", {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16})
    rng = random.Random(9)
    pop = space.sample_many(60, rng)
    made = 0
    for a, b in zip(pop, pop[1:]):
        child = space.crossover(a, b, rng)
        if child is None:
            continue
        made += 1
        da, db, dc = a.candidate.as_dict(), b.candidate.as_dict(), child.candidate.as_dict()
        for slot, v in dc.items():
            assert v in (da.get(slot), db.get(slot)) or slot.endswith(("location", "parallel", "vector"))
    assert made > 0


def test_a_small_batch_gets_a_random_program():
    """5% of a batch of 4 rounds to no random pick; the floor gives it one (exploration)."""
    from tunefarm.search.evolution import random_picks

    space = _space()
    rng = random.Random(3)
    pool = space.sample_many(40, rng)
    ranked, randoms = pool[:20], pool[20:]
    search = EvolutionarySearch(space, SMALL_SEARCH, rng)
    picks = search._eps_greedy(ranked, randoms, 4)
    random_keys = {b.candidate.key for b in randoms}
    assert sum(b.candidate.key in random_keys for b in picks[:4]) == 1
    assert [b.candidate.key for b in picks[:3]] == [b.candidate.key for b in ranked[:3]]
    assert random_picks(1, SMALL_SEARCH) == 0  # a single pick stays guided
    assert random_picks(64, SMALL_SEARCH) == 3  # large batches keep the 5% share
    off = SearchConfig(population=64, generations=2, min_random_per_batch=0)
    assert (
        not {b.candidate.key for b in EvolutionarySearch(space, off, rng)._eps_greedy(ranked, randoms, 4)[:4]}
        & random_keys
    )


def test_best_ranked_keeps_the_best_in_entry_order_and_ties_to_the_earlier():
    from tunefarm.search.evolution import _best_ranked

    best = {k: (s, None) for k, s in [("a", 1.0), ("b", 3.0), ("c", 2.0), ("d", 3.0), ("e", 2.0)]}
    kept = _best_ranked(best, 3)
    assert list(kept) == ["b", "c", "d"]  # "e" ties "c" and came later
    assert sorted(kept.values(), key=lambda t: -t[0]) == sorted(best.values(), key=lambda t: -t[0])[:3]
    assert _best_ranked(best, 9) is best


def test_proposing_leaves_the_garbage_collector_as_it_found_it():
    import gc

    from tunefarm.search.collector import collector_paused

    space = _space()
    search = EvolutionarySearch(space, SMALL_SEARCH, random.Random(5))
    assert gc.isenabled()
    search.next_batch(PreferVectorized(), 4, set(), [], model_ready=True)
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_random_batch_draws_twice_the_batch_not_a_population():
    """Before the cost model ranks, a round draws twice its batch (a population would only
    cost its sampling), and more when the draws were mostly measured already."""
    space = _space()
    search = EvolutionarySearch(space, SearchConfig(population=512, generations=2), random.Random(3))
    picks, stats = search.next_batch(RandomCostModel(1), 8, set(), [], model_ready=False)
    assert stats.sampled == 16 and len(picks) == 16 and stats.scored == 0
    # the same draws again, all measured already: the round draws on to fill its batch
    first = {b.candidate.key for b in space.sample_many(16, random.Random(3))}
    assert first == {b.candidate.key for b in picks}
    search = EvolutionarySearch(space, SearchConfig(population=512, generations=2), random.Random(3))
    picks, stats = search.next_batch(RandomCostModel(1), 8, first, [], model_ready=False)
    assert stats.sampled > 16 and len(picks) >= 8 and not first & {b.candidate.key for b in picks}


def test_crossover_draws_the_same_children_in_every_process():
    """A seed gives the same crossovers whatever Python's string hashing (the blocks are
    visited in a fixed order while drawing)."""
    import os
    import subprocess
    import sys

    code = (
        "import random\n"
        "from tunefarm.search.task import make_task\n"
        "from tunefarm.workloads import registry\n"
        "space = make_task(registry.make('conv2d_nhwc', {'C': 16, 'H': 8, 'W': 8, 'F': 16}), "
        "{'kind': 'llvm', 'num-cores': 2}).space\n"
        "rng = random.Random(7)\n"
        "pop = space.sample_many(40, rng)\n"
        "kids = [space.crossover(pop[i], pop[j], rng) for i in range(10) for j in range(10, 20)]\n"
        "print(sorted(k.candidate.key for k in kids if k is not None))\n"
    )
    outs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout  # fmt: skip
        for seed in ("1", "2", "3")
    ]
    assert outs[0] != "[]\n" and outs[0] == outs[1] == outs[2]
