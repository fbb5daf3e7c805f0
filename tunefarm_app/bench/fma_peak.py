"""The machine's measured FMA peak: what `tunefarm bench ops` judges kernels against.

A short TVM kernel keeps independent vector accumulators per core in registers and
updates each with one fused multiply-add per iteration, in the widest vector the target
has (`loop_shape`: 16 float32 lanes in zmm on AVX-512, 8 in ymm on AVX2, 4 on SSE and
NEON). Enough independent chains cover the FMA latency on both pipes, and all of them fit
in the target's vector registers (twelve 16-lane accumulators on an AVX2 machine would
be 24 ymm registers of 16 and spill to memory, which measured half the real peak), so
nothing but the FMA units limits it. It is compiled for the bench's own target, run on every core of it, timed
like the kernels (in a child process with `TVM_NUM_THREADS` set to the target's cores,
best of several repeats, since noise on a shared machine only slows things down) and
measured in the same run as the kernels it is compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCUMULATORS = 12
"""Independent accumulators per core: FMA latency (4 cycles) x 2 pipes, with headroom."""

SPARE_REGISTERS = 4
"""Vector registers left to the loop's constants and the compiler."""

DEFAULT_LANES = 16
"""float32 lanes when the target's vector width is unknown."""

ITERATIONS = 4_000_000
"""FMA iterations per call: tens of milliseconds, so thread start-up does not count."""


@dataclass(frozen=True)
class LoopShape:
    """The FMA loop's accumulators per core and float32 lanes per accumulator."""

    accumulators: int
    lanes: int


def loop_shape(vector_bytes: int, vector_registers: int) -> LoopShape:
    """One accumulator per vector register of the target's widest kind, as many as fit
    beside `SPARE_REGISTERS` (at most `ACCUMULATORS`)."""
    lanes = vector_bytes // 4 if vector_bytes else DEFAULT_LANES
    fit = vector_registers - SPARE_REGISTERS if vector_registers else ACCUMULATORS
    return LoopShape(accumulators=max(1, min(ACCUMULATORS, fit)), lanes=lanes)


@dataclass(frozen=True)
class FmaPeak:
    gflops: float  # float32 GFLOPS of the loop, all cores
    cores: int
    library: str  # the compiled loop, kept for `objdump -d`
    shape: LoopShape


def fma_loop(cores: int, shape: LoopShape, iterations: int = ITERATIONS):
    """The FMA loop as a TIR function: out[core] holds each core's accumulators at the end
    (so nothing is dead code)."""
    from tvm.script import tirx as T

    acc_n, lanes = shape.accumulators, shape.lanes

    @T.prim_func
    def main(out: T.Buffer((cores, acc_n, lanes), "float32")):
        for p in T.parallel(cores):
            acc = T.decl_buffer((acc_n, lanes), "float32", scope="local")
            for j in T.unroll(acc_n):
                for lane in T.vectorized(lanes):
                    acc[j, lane] = T.float32(1) + T.Cast("float32", j)
            for _ in range(iterations):
                for j in T.unroll(acc_n):
                    for lane in T.vectorized(lanes):
                        acc[j, lane] = acc[j, lane] * T.float32(0.9999) + T.float32(0.0001)
            for j in T.unroll(acc_n):
                for lane in T.vectorized(lanes):
                    out[p, j, lane] = acc[j, lane]

    return main


def flops_per_call(cores: int, shape: LoopShape, iterations: int = ITERATIONS) -> float:
    return 2.0 * cores * iterations * shape.accumulators * shape.lanes


_compiled: dict[tuple[str, str], LoopShape] = {}
"""The loops this process compiled: (target JSON, library path) -> its shape."""


def measure_fma_peak(target: dict[str, Any], work_dir: Path, repeat: int = 10) -> FmaPeak:
    """Compile the loop for `target`, run it on `target`'s cores, return the best GFLOPS."""
    import tvm

    from tunefarm.isa import target_isa

    cores = int(target.get("num-cores") or 1)
    isa = target_isa(target)
    shape = loop_shape(isa.vector_bytes, isa.vector_registers)
    work_dir.mkdir(parents=True, exist_ok=True)
    library = work_dir / "fma_peak.so"
    built = (json.dumps(target, sort_keys=True), str(library.resolve()))
    if _compiled.get(built) != shape or not library.is_file():  # `bench ops` reads the peak twice per op
        tvm.compile(tvm.IRModule({"main": fma_loop(cores, shape)}), target=tvm.target.Target(target)).export_library(
            str(library)
        )
        _compiled[built] = shape
    child = subprocess.run(
        [sys.executable, "-m", __name__, str(library), str(cores), str(shape.accumulators), str(shape.lanes), str(repeat)],
        env={**os.environ, "TVM_NUM_THREADS": str(cores)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(f"the FMA loop failed: {(child.stderr.strip().splitlines() or ['?'])[-1]}")
    best = float(child.stdout.split()[-1])
    return FmaPeak(
        gflops=flops_per_call(cores, shape) / best / 1e9, cores=cores, library=str(library), shape=shape
    )


def _time_library(library: str, cores: int, shape: LoopShape, repeat: int) -> float:
    """Best seconds per call of the compiled loop (run in the child process)."""
    import numpy as np
    import tvm

    lib = tvm.runtime.load_module(library)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((cores, shape.accumulators, shape.lanes), "float32"), dev)
    timer = lib.time_evaluator("main", dev, number=1, repeat=repeat)
    timer(out)  # warm-up: threads started, clocks up
    return min(timer(out).results)


if __name__ == "__main__":
    from tunefarm.isolation import WITHOUT_TORCH, block_imports

    block_imports(WITHOUT_TORCH)  # TVM's FFI would import torch (seconds) for a loop that never uses it
    library_arg, cores_arg, accumulators_arg, lanes_arg, repeat_arg = sys.argv[1:6]
    print(_time_library(library_arg, int(cores_arg), LoopShape(int(accumulators_arg), int(lanes_arg)), int(repeat_arg)))
