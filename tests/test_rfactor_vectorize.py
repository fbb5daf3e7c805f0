"""An inner rfactor keeps its vector axis when the rf block is computed at a consumer's loop.

`compute_at` rebuilds the rf block's loops in its iterator order, rf axis first; the model
moves it innermost and vectorizes it (a softmax's max and sum reductions, a layer norm's
mean and variance), and TVM must build exactly those loops.
"""

from __future__ import annotations

import random

import pytest

from tunefarm.search.space.dag import analyse
from tunefarm.search.space.loopnest import build
from tunefarm.search.space.program import InvalidProgram, expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize
from tunefarm.search.space.sketch import RfactorStep, generate_sketches
from tunefarm.search.space.slots import Decider
from tunefarm.workloads import registry


@pytest.mark.parametrize(
    ("op", "params"), [("softmax", {"B": 2, "M": 8, "N": 64}), ("layer_norm", {"M": 8, "N": 96})]
)
def test_computed_at_rf_blocks_are_vectorized_on_the_rf_axis(op, params):
    wl = registry.make(op, params)
    dag = analyse(wl.mod["main"])
    sketches = [
        s
        for s in generate_sketches(dag, num_cores=2)
        if any(isinstance(x, RfactorStep) and x.inner for x in s.steps)
    ]
    rng = random.Random(11)
    checked = 0
    for i in range(200):
        try:
            prog = build(dag, sketches[i % len(sketches)], Decider(None, rng), 2)
        except InvalidProgram:
            continue
        moved = {ins.block for ins in prog.instructions if ins.op == "move_innermost"}
        for name in moved:
            nest = prog.nests[name]
            rf_loop = nest.loops[-1]
            assert rf_loop.key in nest.binding[nest.spec.iters[0].name].vars
            assert not rf_loop.reduce and rf_loop.kind == "vectorized"
        if moved and checked < 6:
            assert loop_structure(realize(wl.mod, prog.instructions)) == expected_tvm_loops(prog)
            checked += 1
    assert checked == 6, "no sampled program computed an inner rf block at a consumer loop"
