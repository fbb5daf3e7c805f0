"""The machine's measured FMA peak: what `tunefarm bench ops` judges kernels against.

A short TVM kernel keeps `ACCUMULATORS` independent vector accumulators per core in
registers and updates each with one fused multiply-add per iteration, the widest vector
the target has (`VECTOR_LANES` float32 lanes; LLVM emits zmm FMAs on AVX-512). Enough
independent chains cover the FMA latency on both pipes, so nothing but the FMA units
limits it. It is compiled for the bench's own target, run on every core of it, timed
like the kernels (in a child process with `TVM_NUM_THREADS` set to the target's cores,
best of several repeats, since noise on a shared machine only slows things down) and
measured in the same run as the kernels it is compared with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCUMULATORS = 12
"""Independent accumulators per core: FMA latency (4 cycles) x 2 pipes, with headroom."""

VECTOR_LANES = 16
"""float32 lanes of one vector register (AVX-512); narrower targets split it in two."""

ITERATIONS = 4_000_000
"""FMA iterations per call: tens of milliseconds, so thread start-up does not count."""


@dataclass(frozen=True)
class FmaPeak:
    gflops: float  # float32 GFLOPS of the loop, all cores
    cores: int
    library: str  # the compiled loop, kept for `objdump -d`


def fma_loop(cores: int, iterations: int = ITERATIONS):
    """The FMA loop as a TIR function: out[core] holds each core's accumulators at the end
    (so nothing is dead code)."""
    from tvm.script import tirx as T

    acc_n, lanes = ACCUMULATORS, VECTOR_LANES

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


def flops_per_call(cores: int, iterations: int = ITERATIONS) -> float:
    return 2.0 * cores * iterations * ACCUMULATORS * VECTOR_LANES


def measure_fma_peak(target: dict[str, Any], work_dir: Path, repeat: int = 10) -> FmaPeak:
    """Compile the loop for `target`, run it on `target`'s cores, return the best GFLOPS."""
    import tvm

    cores = int(target.get("num-cores") or 1)
    work_dir.mkdir(parents=True, exist_ok=True)
    library = work_dir / "fma_peak.so"
    tvm.compile(tvm.IRModule({"main": fma_loop(cores)}), target=tvm.target.Target(target)).export_library(
        str(library)
    )
    child = subprocess.run(
        [sys.executable, "-m", __name__, str(library), str(cores), str(repeat)],
        env={**os.environ, "TVM_NUM_THREADS": str(cores)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(f"the FMA loop failed: {(child.stderr.strip().splitlines() or ['?'])[-1]}")
    best = float(child.stdout.split()[-1])
    return FmaPeak(gflops=flops_per_call(cores) / best / 1e9, cores=cores, library=str(library))


def _time_library(library: str, cores: int, repeat: int) -> float:
    """Best seconds per call of the compiled loop (run in the child process)."""
    import numpy as np
    import tvm

    lib = tvm.runtime.load_module(library)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((cores, ACCUMULATORS, VECTOR_LANES), "float32"), dev)
    timer = lib.time_evaluator("main", dev, number=1, repeat=repeat)
    timer(out)  # warm-up: threads started, clocks up
    return min(timer(out).results)


if __name__ == "__main__":
    print(_time_library(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
