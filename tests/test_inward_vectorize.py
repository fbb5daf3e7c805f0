"""A reduction over a strided axis is vectorized along its contiguous spatial axis.

A max pool in NHWC reduces over the window (rows and columns), a softmax over axis 1 of
an NCHW tensor over the channels: their innermost loop is a reduction with a large
stride, and the contiguous axis is a spatial one outside it. The annotation may split
that spatial loop and move its inner part inside the reduction loops, vectorized
(slot `<block>.inward_vector`); TVM must build exactly the model's loops, and the
kernels must compute the operator.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tunefarm.search.space.program import expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize


def _max_pool_nhwc():
    from tvm import te, topi

    from tunefarm.workloads.base import workload_from_te

    x = te.placeholder((1, 14, 14, 48), name="x")
    out = topi.nn.pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), "max", layout="NHWC")

    def reference(a):
        padded = np.pad(a, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
        windows = [padded[:, i : i + 13 : 2, j : j + 13 : 2, :] for i in range(3) for j in range(3)]
        return [np.max(windows, axis=0).astype(np.float32)]

    return workload_from_te("max_pool_nhwc", [x, out], reference=reference), [(1, 14, 14, 48)]


def _softmax_over_channels():
    from tvm import te, topi

    from tunefarm.workloads.base import workload_from_te

    x = te.placeholder((1, 16, 4, 100), name="x")
    out = topi.nn.softmax(x, axis=1)

    def reference(a):
        e = np.exp(a - a.max(axis=1, keepdims=True))
        return [(e / e.sum(axis=1, keepdims=True)).astype(np.float32)]

    return workload_from_te("softmax_axis1", [x, out], reference=reference), [(1, 16, 4, 100)]


@pytest.mark.parametrize("make", [_max_pool_nhwc, _softmax_over_channels])
def test_strided_reductions_get_a_vector_loop_inside_their_reduction_loops(make, host_target):
    import tvm

    from tunefarm.search.task import make_task

    wl, shapes = make()
    task = make_task(wl, host_target)
    rng = np.random.default_rng(7)
    inputs = [rng.uniform(-3, 3, size=s).astype(np.float32) for s in shapes]
    want = wl.reference(*inputs)[0]
    out_shape = tuple(int(d) for d in wl.outputs[0].shape)
    checked = 0
    for built in task.space.sample_many(40, random.Random(3)):
        prog = built.program
        inward = {ins.block for ins in prog.instructions if ins.op == "split_inward"}
        if not inward:
            continue
        for name in inward:
            loops = prog.nests[name].loops
            first_reduce = next(i for i, lp in enumerate(loops) if lp.reduce)
            assert loops[-1].kind == "vectorized" and not loops[-1].reduce
            assert all(lp.reduce for lp in loops[first_reduce:-1])
        sch = realize(wl.mod, prog.instructions)
        assert loop_structure(sch) == expected_tvm_loops(prog)
        ex = tvm.compile(sch.mod, target=tvm.target.Target(host_target))
        got = tvm.runtime.empty(out_shape, "float32", tvm.cpu())
        ex["main"](*(tvm.runtime.tensor(a) for a in inputs), got)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
        checked += 1
        if checked == 4:
            break
    assert checked == 4, "too few sampled programs vectorized a reduction inward"


def test_a_reduction_over_the_contiguous_axis_gets_no_inward_vector_slot(host_target):
    """Softmax over the last axis: the reductions over the input walk its contiguous axis,
    and the spatial loops stride over rows; nothing is gained by moving a spatial loop
    inside them. (An outer rfactor's combining block, which reduces over the rf axis of a
    buffer whose last axis is a row, may get the slot.)"""
    from tunefarm.search.task import make_task
    from tunefarm.workloads import registry

    task = make_task(registry.make("softmax", {"B": 2, "M": 8, "N": 64}), host_target)
    seen = 0
    for built in task.space.sample_many(30, random.Random(1)):
        for slot in built.domains:
            if slot.endswith(".inward_vector"):
                spec = built.program.nests[slot.rsplit(".", 1)[0]].spec
                assert not any(a.buffer == "x" for a in spec.reads), slot
                seen += 1
    assert seen, "no combining block of an outer rfactor was offered the slot"
