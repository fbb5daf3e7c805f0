"""A block computed at a consumer's loop vectorizes an innermost loop longer than a vector.

A softmax's exp computed at each row of 256 has one spatial loop of 256 under the row:
too long to vectorize whole (`MAX_VECTOR`), so it was left scalar. The annotation now
splits it (slot `<block>.vector`) and vectorizes the inner part; TVM must build exactly
the model's loops and the kernel must compute the softmax. Records made before the slot
existed rebuild the program they measured.
"""

from __future__ import annotations

import random

import numpy as np

from tunefarm.search.space.annotate import MAX_VECTOR
from tunefarm.search.space.program import expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize

SHAPE = {"B": 2, "M": 8, "N": 256}


def _task(host_target):
    from tunefarm.search.task import make_task
    from tunefarm.workloads import registry

    return make_task(registry.make("softmax", SHAPE), host_target)


def _split_attached_blocks(prog) -> list[str]:
    """The blocks computed at a consumer's loop whose innermost loop the annotation split."""
    split = {ins.block for ins in prog.instructions if ins.op == "split_inner"}
    return [name for name in split if prog.nests[name].attach is not None]


def test_a_computed_at_block_splits_and_vectorizes_its_long_innermost_loop(host_target):
    import tvm

    task = _task(host_target)
    wl = task.workload
    x = np.random.default_rng(5).uniform(-4, 4, size=(2, 8, 256)).astype(np.float32)
    want = wl.reference(x)[0]
    checked = 0
    for built in task.space.sample_many(80, random.Random(11)):
        prog = built.program
        split = _split_attached_blocks(prog)
        if not split:
            continue
        for name in split:
            outer, vec = built.candidate.as_dict()[f"{name}.vector"]
            assert vec > 1 and outer * vec == SHAPE["N"] and vec <= MAX_VECTOR
            last = prog.nests[name].loops[-1]
            assert last.kind == "vectorized" and last.extent == vec
        sch = realize(wl.mod, prog.instructions)
        assert loop_structure(sch) == expected_tvm_loops(prog)
        ex = tvm.compile(sch.mod, target=tvm.target.Target(host_target))
        got = tvm.runtime.empty((2, 8, 256), "float32", tvm.cpu())
        ex["main"](tvm.runtime.tensor(x), got)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
        checked += 1
        if checked == 3:
            break
    assert checked == 3, "too few sampled programs computed a block at a row and vectorized its loop"


def test_decisions_made_before_the_slot_rebuild_the_scalar_loop(host_target):
    """A measured program whose decisions lack the slot (rebuilt without a random source)
    keeps its long loop whole and scalar: the program its record measured."""
    task = _task(host_target)
    found = 0
    for built in task.space.sample_many(80, random.Random(11)):
        slots = [s for s in built.candidate.as_dict() if s.endswith(".vector")]
        attached = [s for s in slots if built.program.nests[s.rsplit(".", 1)[0]].attach is not None]
        if not attached:
            continue
        old = {k: v for k, v in built.candidate.as_dict().items() if k not in attached}
        rebuilt = task.space.build(built.candidate.sketch, old)
        for slot in attached:
            name = slot.rsplit(".", 1)[0]
            assert rebuilt.candidate.as_dict()[slot] == (SHAPE["N"], 1)
            assert not any(ins.op == "split_inner" and ins.block == name for ins in rebuilt.program.instructions)
            assert rebuilt.program.nests[name].loops[-1].kind != "vectorized"
        found += 1
    assert found, "no sampled program computed a block with a long loop at a consumer's loop"
