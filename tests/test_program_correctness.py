"""Property: every program the search space samples computes what the naive program
computes (here checked against each workload's numpy reference)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunefarm.search.space.program_space import ProgramSpace
from tunefarm.search.space.realize import realize, trace_json
from tunefarm.search.task import make_task
from tunefarm.workloads import registry

CASES = {
    "matmul_relu": {"M": 24, "N": 32, "K": 16},
    "batch_matmul": {"B": 2, "M": 8, "N": 16, "K": 12},
    "conv2d": {"N": 1, "C": 4, "H": 9, "W": 9, "F": 8, "stride": 2},
    "depthwise_conv2d": {"N": 1, "C": 4, "H": 10, "W": 10},
    "softmax": {"B": 2, "M": 4, "N": 24},
    "layer_norm": {"M": 6, "N": 40},
    "norm2": {"M": 16, "N": 24},
    "conv2d_transpose": {"N": 1, "C": 3, "H": 5, "W": 5, "F": 4},
}


def _check(op: str, seed: int, target: dict) -> None:
    wl = registry.make(op, CASES[op])
    task = make_task(wl, target)
    space: ProgramSpace = task.space
    # A draw the model rejects (e.g. an unroll too long to compile) is drawn again, as the search does.
    (built,) = space.sample_many(1, random.Random(seed))
    sch = realize(wl.mod, built.program.instructions)
    # Build what the builder builds: the trace JSON replayed on a fresh, checked schedule.
    replayed = tvm.s_tir.Schedule(wl.mod)
    tvm.s_tir.Trace.apply_json_to_schedule(trace_json(sch), replayed)
    ex = tvm.compile(replayed.mod, target=tvm.target.Target(target))
    rng = np.random.default_rng(seed)
    inputs = [rng.uniform(-1, 1, size=t.shape).astype(t.dtype) for t in wl.inputs]
    outs = [tvm.runtime.empty(t.shape, t.dtype, tvm.cpu()) for t in wl.outputs]
    ex["main"](*[tvm.runtime.tensor(a) for a in inputs], *outs)
    expected = wl.reference(*inputs)
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-4, err_msg=f"{op} {built.candidate.key}")


@pytest.mark.parametrize("op", sorted(CASES))
@given(seed=st.integers(1, 2**30))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sampled_programs_compute_the_reference(op, seed, host_target):
    _check(op, seed, host_target)
