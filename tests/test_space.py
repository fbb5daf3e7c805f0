"""Slot domains, sampling and mutation: pure Python, no TVM."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunefarm.search.space.slots import (
    ChoiceDomain,
    Decider,
    IntRange,
    InvalidDecision,
    TileDomain,
    divisors,
    factorizations,
)


def test_factorizations_are_complete_and_perfect():
    facts = factorizations(12, 3, 64)
    assert all(a * b * c == 12 for a, b, c in facts)
    # ordered factorizations of 12 = 2^2 * 3 into 3 parts: C(4,2) * C(3,2) = 18
    assert len(facts) == 18
    assert len(set(facts)) == len(facts)
    assert all(f[-1] <= 4 for f in factorizations(64, 2, 4))


def test_a_vectorized_tile_draws_whole_vectors_half_the_time_and_keeps_every_tiling():
    # 80 into 4 levels, innermost <= 64: 3 of the 139 tilings have a 16-wide innermost
    plain, vec = TileDomain(80, 4, 64), TileDomain(80, 4, 64, vector_lanes=16)
    rng = random.Random(0)
    whole = [vec.sample(rng)[-1] % 16 == 0 for _ in range(1000)]
    assert 0.4 < sum(whole) / len(whole) < 0.6
    assert sum(plain.sample(rng)[-1] % 16 == 0 for _ in range(1000)) < 100
    assert vec.options() == plain.options() and vec.contains((4, 2, 1, 10))
    # nothing fills a whole vector: the draws stay uniform
    assert TileDomain(12, 2, 64, vector_lanes=16).sample(rng) in TileDomain(12, 2, 64).options()


@given(extent=st.sampled_from([1, 2, 7, 12, 56, 64, 96, 1024, 3136]), parts=st.integers(1, 4), seed=st.integers(0, 10**6))
@settings(max_examples=80, deadline=None)
def test_tile_sample_and_mutate_stay_in_domain(extent, parts, seed):
    dom = TileDomain(extent, parts, 64)
    rng = random.Random(seed)
    v = dom.sample(rng)
    assert dom.contains(v)
    m = dom.mutate(v, rng)
    if m is not None:
        assert m != v and dom.contains(m)


def test_prime_extent_above_innermost_limit_still_has_a_tiling():
    dom = TileDomain(97, 2, 64)
    assert dom.options() == ((97, 1),)
    assert dom.contains((97, 1))


def test_choice_domain_mutation_changes_value():
    dom = ChoiceDomain(4)
    rng = random.Random(3)
    for v in range(4):
        for _ in range(20):
            m = dom.mutate(v, rng)
            assert m != v and dom.contains(m)
    assert ChoiceDomain(1).mutate(0, rng) is None


def test_decider_uses_given_values_and_rejects_bad_ones_without_rng():
    d = Decider({"a": (2, 3)})
    assert d.decide("a", TileDomain(6, 2)) == (2, 3)
    with pytest.raises(InvalidDecision):
        Decider({"a": (4, 3)}).decide("a", TileDomain(6, 2))
    with pytest.raises(InvalidDecision):
        Decider({}).decide("missing", ChoiceDomain(2))


def test_decider_draws_and_repairs_with_rng():
    d = Decider({"loc": 9}, random.Random(1))
    v = d.decide("loc", ChoiceDomain(3))
    assert 0 <= v < 3 and d.decisions == {"loc": v}
    assert isinstance(d.domains["loc"], ChoiceDomain)


def test_divisors():
    assert divisors(36) == (1, 2, 3, 4, 6, 9, 12, 18, 36)
    assert divisors(1) == (1,)


def test_int_range():
    dom = IntRange(2, 4)
    rng = random.Random(0)
    assert all(dom.contains(dom.sample(rng)) for _ in range(20))
    assert {dom.mutate(3, rng) for _ in range(30)} == {2, 4}
    assert IntRange(3, 3).mutate(3, rng) is None


def test_vector_split_prefers_real_vectors():
    dom = TileDomain(128, 2, 64, min_innermost=2)
    assert all(o[-1] >= 2 for o in dom.options())
    assert TileDomain(7, 2, 64, min_innermost=2).options() == ((1, 7),)


def test_parallel_range_gives_every_core_work_and_stops_at_16_jobs_per_core():
    from tunefarm.search.space.annotate import parallel_range

    # extents of the leading loops (e.g. a tiled conv: n0=1, f0=2, y0=7, x0=1, ...)
    assert parallel_range([1, 2, 7, 1, 1, 4], num_cores=2) == (2, 6)
    assert parallel_range([1, 1, 64], num_cores=2) == (3, 3)
    assert parallel_range([1, 1, 1], num_cores=2) == (3, 3)  # no parallelism to be had
