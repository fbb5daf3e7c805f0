"""The FMA-peak loop `bench ops` judges kernels against: its accumulators fit the target's
vector registers, so the loop measures the FMA units and not spills."""

from __future__ import annotations

import re

import pytest

from tunefarm_app.bench.fma_peak import ACCUMULATORS, SPARE_REGISTERS, LoopShape, fma_loop, loop_shape


@pytest.mark.parametrize(
    ("vector_bytes", "registers", "expected"),
    [
        (64, 32, LoopShape(ACCUMULATORS, 16)),  # AVX-512: 12 zmm of 32
        (32, 16, LoopShape(ACCUMULATORS, 8)),  # AVX2: 12 ymm of 16
        (16, 16, LoopShape(ACCUMULATORS, 4)),  # SSE
        (16, 8, LoopShape(8 - SPARE_REGISTERS, 4)),  # few registers: fewer accumulators
        (0, 0, LoopShape(ACCUMULATORS, 16)),  # unknown width
    ],
)
def test_the_loop_uses_the_widest_vector_and_as_many_accumulators_as_fit(vector_bytes, registers, expected):
    shape = loop_shape(vector_bytes, registers)
    assert shape == expected
    if registers:
        assert shape.accumulators + SPARE_REGISTERS <= registers


FMA = re.compile(r"\bvfmadd\w*\s+(%[xyz]mm\d+|[^,]+),")
STACK_ACCESS = re.compile(r"\(%rsp\)|\(%rbp\)")


@pytest.mark.parametrize(("mcpu", "register"), [("haswell", "ymm"), ("skylake-avx512", "zmm")])
def test_the_compiled_loop_keeps_every_accumulator_in_a_register(mcpu, register):
    import tvm

    from tunefarm.isa import target_isa

    target = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu, "num-cores": 2}
    isa = target_isa(target)
    shape = loop_shape(isa.vector_bytes, isa.vector_registers)
    asm = tvm.compile(tvm.IRModule({"main": fma_loop(2, shape, iterations=1000)}), target=tvm.target.Target(target))
    lines = asm.mod.inspect_source("asm").splitlines()
    fma_at = [i for i, line in enumerate(lines) if FMA.search(line)]
    assert len(fma_at) >= shape.accumulators, "the loop's FMAs are not fused multiply-adds"
    assert all(register in lines[i] for i in fma_at), f"FMAs not in {register} registers"
    # the FMA loop's body: from its first FMA to its last
    spills = [line for line in lines[fma_at[0] : fma_at[-1]] if STACK_ACCESS.search(line)]
    assert not spills, f"accumulators spill to the stack inside the FMA loop: {spills[:3]}"


def test_sixteen_lane_accumulators_on_avx2_would_spill():
    """The check above sees a spill: the old loop (twelve 16-lane accumulators, 24 ymm
    registers of 16) moves accumulators through the stack in its loop."""
    import tvm

    target = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2}
    asm = tvm.compile(
        tvm.IRModule({"main": fma_loop(2, LoopShape(ACCUMULATORS, 16), iterations=1000)}), target=tvm.target.Target(target)
    )
    lines = asm.mod.inspect_source("asm").splitlines()
    fma_at = [i for i, line in enumerate(lines) if FMA.search(line)]
    assert any(STACK_ACCESS.search(line) for line in lines[fma_at[0] : fma_at[-1]])
