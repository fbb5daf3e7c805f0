"""How valid the GPU search space's random programs are, and how close they sit to the
GPU's limits: for a few workloads on sm_90 and sm_80, the share of fresh samples
(`ProgramSpace.sample`) that are invalid (InvalidProgram), the share of mutations of
valid programs that are rejected (nothing valid came back, repair included), and
distribution summaries of the valid samples' kernels: threads per block and shared
memory per block (as shares of the GPU's limits, whose shared memory is the opt-in
limit on sm_80+: 163 KB, 227 KB), the share of kernels whose threads are whole warps,
and for tiled kernels the accumulators' registers (as a share of the budget
`check_tiled_block` allows with those threads), how often each software-pipeline depth
was drawn, and the share of tiled kernels whose stages pass the static 48 KB (dynamic
shared memory).

    python tools/gpu_sampling_stats.py [--samples 200] [--mutations 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import random

import numpy as np

from tunefarm.gpu import STATIC_SHARED_MEMORY_BYTES, GpuLimits
from tunefarm.search.config import SearchConfig
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.loopnest_gpu import ACCUMULATOR_REGISTER_SHARE, PIPELINE_DEPTHS
from tunefarm.search.space.program_space import ProgramSpace
from tunefarm.search.space.rule_set import GpuRules
from tunefarm.workloads import registry

WORKLOADS = [
    ("gemm1024", "matmul", {"M": 1024, "N": 1024, "K": 1024}),
    ("conv2d_nchw", "conv2d", {"N": 1, "C": 64, "H": 56, "W": 56, "F": 64}),
    ("conv2d_nhwc", "conv2d_nhwc", {"N": 1, "C": 128, "H": 28, "W": 28, "F": 128}),
    ("bmm", "batch_matmul", {"B": 12, "M": 128, "N": 128, "K": 64}),
    ("softmax", "softmax", {"B": 12, "M": 128, "N": 128}),
    ("layer_norm", "layer_norm", {"M": 128, "N": 768}),
    ("dense_m16", "matmul", {"M": 16, "N": 4096, "K": 1024}),
]

ARCHS = ("sm_90", "sm_80")


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    q = np.percentile(values, [10, 50, 90])
    return f"p10 {q[0]:.2f} p50 {q[1]:.2f} p90 {q[2]:.2f} max {max(values):.2f}"


def _kernels(prog):
    """The root blocks, one kernel each (a stage computed in a block is in its kernel)."""
    return [n for n in prog.order if prog.nests[n].attach is None]


def measure(op: str, shape: dict, arch: str, n_samples: int, n_mutations: int, seed: int) -> dict:
    rules = GpuRules(GpuLimits.of({"kind": "cuda", "arch": arch}))
    gpu = rules.gpu
    dag = analyse(registry.make(op, shape).mod["main"])
    space = ProgramSpace(dag, rules.sketches(dag), rules)
    rng = random.Random(seed)
    valid = []
    for _ in range(n_samples):
        b = space.sample(rng)
        if b is not None:
            valid.append(b)
    threads, shared, registers, warp_multiple = [], [], [], 0
    kernels = dynamic = tiled = 0
    depths: collections.Counter[int] = collections.Counter()
    for b in valid:
        prog = b.program
        for n in _kernels(prog):
            kernels += 1
            t = prog.nests[n].threads
            threads.append(t / gpu.max_threads_per_block)
            shared.append(prog.kernel_bytes(n, "shared") / gpu.max_shared_memory_per_block)
            warp_multiple += t % gpu.warp_size == 0
            if prog.nests[n].tiled:
                tiled += 1
                depths[prog.nests[n].pipeline] += 1
                dynamic += prog.kernel_bytes(n, "shared") > STATIC_SHARED_MEMORY_BYTES
                budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // max(t, 1))
                registers.append(prog.kernel_bytes(n, "local") / 4 / (ACCUMULATOR_REGISTER_SHARE * budget))
    weights = rules.mutation_weights(SearchConfig())
    rejected = tried = 0
    if valid:
        for _ in range(n_mutations):
            parent = rng.choice(valid)
            before = space.invalid_draws
            child = space.mutate(parent, rng, weights)
            if child is None and space.invalid_draws == before:
                continue  # no mutation possible (not a rejection)
            tried += 1
            if child is None:
                rejected += 1
                continue
            if space.rebuild(child.candidate) is None:  # must rebuild as given, without an rng
                rejected += 1
    return {
        "invalid": 1 - len(valid) / n_samples,
        "mut_rejected": rejected / tried if tried else float("nan"),
        "mut_tried": tried,
        "kernels": kernels,
        "threads": _summary(threads),
        "shared": _summary(shared),
        "registers": _summary(registers),
        "warp_multiple": warp_multiple / kernels if kernels else float("nan"),
        "depths": " ".join(f"{d}:{depths[d] / tiled:.0%}" for d in PIPELINE_DEPTHS) if tiled else "-",
        "dynamic": dynamic / tiled if tiled else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--mutations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for arch in ARCHS:
        for name, op, shape in WORKLOADS:
            r = measure(op, shape, arch, args.samples, args.mutations, args.seed)
            print(
                f"{arch} {name:12s} invalid {r['invalid']:.1%}  mutations rejected {r['mut_rejected']:.1%} "
                f"(of {r['mut_tried']})  kernels {r['kernels']}  whole warps {r['warp_multiple']:.0%}\n"
                f"    threads/max    {r['threads']}\n    shared/max     {r['shared']}\n"
                f"    accum/budget   {r['registers']}\n"
                f"    tiled kernels: pipeline depths {r['depths']}  dynamic shared memory {r['dynamic']:.0%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
