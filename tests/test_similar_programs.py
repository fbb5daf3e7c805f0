"""Seeding a task from its similar tasks' best programs: decisions carried over, tile
sizes refit to the new extents, and the result in the first round's population (the
loop-nest model only, no compiler)."""

from __future__ import annotations

import math
import random

import numpy as np

from tunefarm.records import ErrorKind, MeasureRecord
from tunefarm.search.config import SearchConfig, TuneConfig
from tunefarm.search.cost_model.base import CostModel
from tunefarm.search.similar_programs import SimilarPrograms
from tunefarm.search.space.slots import ChoiceDomain, TileDomain
from tunefarm.search.task import make_task
from tunefarm.search.tuner import TaskTuner
from tunefarm.workloads import registry

TARGET = {"kind": "llvm", "num-cores": 2}


def _task(m: int, n: int, k: int):
    return make_task(registry.make("matmul_relu", {"M": m, "N": n, "K": k}), TARGET)


def _record(task, built, cost: float) -> MeasureRecord:
    c = built.candidate
    return MeasureRecord(
        task=task.key, workload=task.workload.name, target=TARGET, sketch=c.sketch,
        sketch_sig=task.sketch_signature(c.sketch), decisions=c.decisions, trace=[], costs=(cost,),
        error_kind=ErrorKind.NONE, error_msg="", build_secs=0.0, run_secs=0.0, verified=True, timestamp=0.0,
    )  # fmt: skip


def test_nearest_tiling_keeps_the_inner_factor_and_fits_the_extent():
    assert TileDomain(128, 4).nearest((2, 4, 2, 4)) == (4, 4, 2, 4)  # 64 -> 128: the outer factor grows
    assert TileDomain(96, 3).nearest((2, 2, 16)) in {(3, 2, 16), (2, 3, 16)}
    assert TileDomain(64, 4).nearest((1, 2)) is None  # another shape: drawn instead
    assert ChoiceDomain(3).nearest(7) == 2


def test_a_program_moves_to_a_task_of_the_same_structure_with_its_tiles_refit():
    small, large = _task(64, 64, 64), _task(128, 96, 64)
    rng = random.Random(4)
    moved = 0
    for donor in small.space.sample_many(20, rng):
        sig = small.sketch_signature(donor.candidate.sketch)
        built = large.space.transfer(sig, donor.candidate.as_dict(), rng)
        assert built is not None
        assert large.sketch_signature(built.candidate.sketch) == sig
        old, new = donor.candidate.as_dict(), built.candidate.as_dict()
        for slot, dom in built.domains.items():
            if isinstance(dom, TileDomain) and slot in old:
                assert math.prod(new[slot]) == dom.extent
                if dom.contains(old[slot]):  # K = 64 in both: taken as it was
                    assert new[slot] == old[slot]
                elif dom.extent % old[slot][-1] == 0:  # the inner (vector) factor survives
                    assert new[slot][-1] == old[slot][-1]
                moved += 1
    assert moved > 20


class PreferExactly(CostModel):
    """Scores 1 for one program, 0 for every other: a model that knows the answer."""

    def __init__(self, key_of, wanted: set[str]):
        self.key_of, self.wanted = key_of, wanted

    def update(self, features, costs, groups):
        pass

    def predict(self, features):
        return np.array([1.0 if self.key_of(f) in self.wanted else 0.0 for f in features])

    def save(self, path):
        pass

    @classmethod
    def load(cls, path):
        raise NotImplementedError

    @property
    def num_samples(self):
        return 0

    @property
    def ranks(self):
        return True


def _first_round_picks(similar: SimilarPrograms, transfer: bool):
    small, large = _task(64, 64, 64), _task(128, 96, 64)
    donor = small.space.sample_many(1, random.Random(8))[0]
    similar.add([_record(small, donor, 1e-4)])
    expected = large.space.transfer(
        small.sketch_signature(donor.candidate.sketch), donor.candidate.as_dict(), random.Random(0)
    )
    feats = {id(m): k for k, m in zip([expected.candidate.key], large.space.features([expected]))}
    model = PreferExactly(lambda f: feats.get(id(f)), {expected.candidate.key})
    config = TuneConfig(trials=8, search=SearchConfig(population=48, generations=1, transfer_from_similar=transfer))
    tuner = TaskTuner(large, config, model, similar=similar)
    picks, stats = tuner.search.next_batch(
        model, 4, set(), [], True, population=48, transferred=tuner.transferred(48)
    )
    return [b.candidate.key for b in picks[:4]], stats, expected.candidate.key


def test_a_task_starts_from_its_similar_tasks_best_program():
    picks, stats, expected = _first_round_picks(SimilarPrograms(), transfer=True)
    assert stats.transferred == 1 and picks[0] == expected
    picks, stats, expected = _first_round_picks(SimilarPrograms(), transfer=False)
    assert stats.transferred == 0 and expected not in picks


def test_similar_programs_keep_each_tasks_best_and_skip_the_asking_task():
    a, b = _task(64, 64, 64), _task(128, 96, 64)
    programs = a.space.sample_many(6, random.Random(1))
    similar = SimilarPrograms(per_task=2)
    similar.add([_record(a, p, cost) for p, cost in zip(programs, [5, 3, 4, 1, 2, 6])])
    sigs = {s.signature for s in b.sketches}
    donors = similar.donors(b.key, sigs, 8)
    assert [r.costs[0] for r in donors] == [1, 2][: len(donors)] and donors
    assert similar.donors(a.key, sigs, 8) == []


def test_the_same_workload_on_another_target_comes_first():
    """A new device class's task starts from its workload's best programs on the nearest
    class (another target, so another task key) before any other similar task's."""
    other_target = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
    mine = _task(64, 64, 64)
    same_elsewhere = make_task(mine.workload, other_target)
    similar_shape = _task(128, 96, 64)
    programs = mine.space.sample_many(4, random.Random(2))
    similar = SimilarPrograms(per_task=2)
    similar.add([_record(similar_shape, programs[0], 1.0), _record(similar_shape, programs[1], 2.0)])
    similar.add([_record(same_elsewhere, programs[2], 9.0), _record(same_elsewhere, programs[3], 8.0)])
    donors = similar.donors(mine.key, {s.signature for s in mine.sketches}, 3)
    assert [r.task for r in donors] == [same_elsewhere.key, same_elsewhere.key, similar_shape.key]
    assert [r.costs[0] for r in donors] == [8.0, 9.0, 1.0]
