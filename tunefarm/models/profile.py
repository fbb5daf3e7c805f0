"""Where a built model's time goes: per kernel call, against the end-to-end latency.

`profile_model(model_dir, inputs)` runs the model once in a child process (TVM's thread
pool at the target's core count) with a VM instrument that records every call the VM
makes: kernels (the model's PrimFuncs) with their argument tensors, and the VM's own
builtins (allocations, views, null-outs). Then it measures:

- each kernel call in the model's own sequence: all the calls replayed in order, on the
  very tensors the model passed them, `SEQUENCE_ROUNDS` times, each call timed on its own
  (the median of its rounds). A kernel then finds in the caches what the kernels before it
  left there, as in the model: its weights and most of its inputs come from L3 or memory.
  These are the times the breakdown charges each task;
- each kernel call on its own, repeated on the same tensors with the library's
  `time_evaluator` (C++ timer, no Python per call): its time with its data in cache
  (`warm_seconds`). Where a kernel takes much longer in the sequence than warm, cold data
  holds it back, not its code: on a 2-core Xeon a YOLOv8n-style model's 95 kernel calls
  took 9.7 ms in sequence and 6.5 ms warm, and the model itself 9.5 ms, so the VM's own
  work (dispatch, allocations) was next to nothing;
- the whole model, `main`, with `time_evaluator` too;
- the copy bandwidth of this machine (numpy, one thread): from memory (64 MiB, larger
  than the caches) and from cache (`CACHED_BYTES`, what the kernels of a small model
  mostly see).

Timings keep the fastest of `REPEATS` repeats (on a shared machine noise only slows),
and each kernel is timed in `PASSES` passes over all the calls, keeping its fastest: a
burst of noise lasting a second (longer than all the repeats of a few kernels) then has
to hit the same kernels in every pass to inflate them.

`in_model_breakdown(tasks, profile)` turns that into per-task rows: calls, seconds in
the model, share, GB/s and GFLOPS, and what holds the task back, from the measurements:

- `launch-bound`: the model's time not spent inside kernels (end-to-end minus the sum of
  the kernel calls in sequence: VM dispatch, allocations, views), spread over the kernel
  calls, is at least `LAUNCH_BOUND_SHARE` of the task's time per call plus that overhead;
- `cold data`: the task's calls take at least `COLD_DATA_RATIO` times as long in the
  model's sequence as warm;
- `memory-bound`: the task moves its arguments' bytes at `MEMORY_BOUND_SHARE` or more of
  the measured copy bandwidth (the cache's when its arguments fit `CACHED_BYTES`, else
  memory's);
- `data movement`: a kernel without arithmetic (a copy, a transpose, a concat that could
  not become views, a resize): a layout change between tasks;
- `elementwise, unfused`: a kernel of under one FLOP per byte (its own pass over memory
  for what could be a neighbour's epilogue);
- otherwise `compute`: GFLOPS and FLOPs per byte.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.errors import ModelError
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker

PROFILE_TIMEOUT = 300.0
"""Seconds the profiling child may take."""

MIN_REPEAT_SECS = 2e-3
"""Each timed repeat of a kernel runs it this long at least (tiny kernels many times)."""

REPEATS = 5
"""Timed repeats per kernel and of the whole model; the fastest is kept."""

PASSES = 2
"""Passes over the model's kernel calls, timing each; each keeps its fastest."""

CACHED_BYTES = 1 << 20
"""A kernel whose arguments take at most this many bytes is compared with the copy
bandwidth of a buffer that size (the L2 of a core here), bigger ones with memory's."""

SEQUENCE_ROUNDS = 15
"""Replays of the model's kernel calls in order; each call keeps its median."""

COLD_DATA_RATIO = 1.3
"""A task whose calls take this much longer in the model's sequence than warm is said to
be held back by cold data."""

LAUNCH_BOUND_SHARE = 0.3
MEMORY_BOUND_SHARE = 0.5

PREPACKED_SUFFIX = "_prepacked"
"""A kernel whose weights are stored in a rewritten layout is built as `<name>_prepacked`
(Relax's SplitLayoutRewritePreproc, run by the build's `fold_layout_rewrites`)."""

_JOBS = "tunefarm.models.profile"


def kernel_symbols(tasks) -> list[str]:
    """The names the model's kernels may be called by: each task function's, and its
    `PREPACKED_SUFFIX` form."""
    return [n for t in tasks.tasks for g in t.global_vars for n in (g, g + PREPACKED_SUFFIX)]


@dataclass(frozen=True)
class KernelCall:
    symbol: str  # the kernel (PrimFunc) name, as the task's global_vars name it
    seconds: float  # one call, on the model's own tensors, in the model's sequence of calls
    bytes: int  # its arguments' bytes (what it must at least read and write)
    warm_seconds: float = 0.0  # the same call repeated on its own (its data in cache)


@dataclass(frozen=True)
class ModelProfile:
    latency: float  # seconds per inference, end to end (median)
    calls: tuple[KernelCall, ...]  # in the order the model makes them
    builtin_calls: int  # calls of the VM's own functions (allocations, views, ...)
    copy_bandwidth: float  # bytes per second, numpy copy, one thread, 64 MiB
    threads: int
    cached_copy_bandwidth: float = 0.0  # the same for CACHED_BYTES

    @property
    def kernel_seconds(self) -> float:
        return sum(c.seconds for c in self.calls)

    @property
    def warm_kernel_seconds(self) -> float:
        return sum(c.warm_seconds for c in self.calls)

    @property
    def overhead_per_call(self) -> float:
        """End-to-end time outside the kernels, per kernel call (>= 0)."""
        return max(0.0, self.latency - self.kernel_seconds) / max(1, len(self.calls))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def profile_model(
    model_dir: str | Path,
    inputs: Sequence[np.ndarray],
    kernels: Sequence[str],
    *,
    threads: int,
    timeout: float = PROFILE_TIMEOUT,
) -> ModelProfile:
    """Profile the built model in `model_dir` on `inputs` (in the order `main` takes them);
    `kernels` are the names of its PrimFuncs (every other call is the VM's own)."""
    from tunefarm.models.runtime import load_manifest

    manifest = load_manifest(model_dir)
    tmp = tempfile.mkdtemp(prefix="tunefarm-profile-")
    try:
        npz = os.path.join(tmp, "inputs.npz")
        np.savez(npz, *inputs)
        with IsolatedWorker(env={"TVM_NUM_THREADS": str(threads)}, name="model-profile",
                            blocked_imports=WITHOUT_TORCH) as worker:
            outcome = worker.call(
                f"{_JOBS}:profile_job",
                str(Path(model_dir) / manifest["library"]),
                npz,
                json.dumps(list(kernels)),
                timeout=timeout,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not outcome.ok:
        raise ModelError(f"profiling {model_dir} failed ({outcome.status}): {outcome.message}")
    v = outcome.value
    return ModelProfile(
        v["latency"], tuple(KernelCall(**c) for c in v["calls"]), v["builtin_calls"], v["copy_bandwidth"], threads,
        v["cached_copy_bandwidth"],
    )


def profile_job(lib_path: str, inputs_npz: str, kernels_json: str) -> dict[str, Any]:
    """Child side of `profile_model`: plain arguments, plain result."""
    import tvm
    from tvm import relax

    kernels = set(json.loads(kernels_json))
    dev = tvm.cpu(0)
    lib = tvm.runtime.load_module(lib_path)
    vm = relax.VirtualMachine(lib, dev)
    with np.load(inputs_npz) as data:
        args = [tvm.runtime.tensor(data[f"arr_{i}"], dev) for i in range(len(data.files))]
    recorded: list[tuple[str, list]] = []
    builtins = 0

    def instrument(func, symbol, before_run, ret, *call_args):
        nonlocal builtins
        if before_run:
            if symbol in kernels:
                recorded.append((symbol, list(call_args)))
            else:
                builtins += 1
        return 0

    vm["main"](*args)  # warm up: allocator pools, pages
    vm.set_instrument(instrument)
    vm["main"](*args)
    vm.set_instrument(None)
    kernel_module = lib.imports[0] if lib.imports else lib  # the compiled kernels
    in_sequence = _time_in_sequence([(kernel_module.get_function(symbol, query_imports=True), call_args) for symbol, call_args in recorded])
    warm = [min(s) for s in zip(*([_time(kernel_module, symbol, dev, call_args) for symbol, call_args in recorded]
                                  for _ in range(PASSES)))]  # fmt: skip
    calls = [
        {"symbol": symbol, "seconds": secs, "bytes": sum(_nbytes(a) for a in call_args), "warm_seconds": hot}
        for (symbol, call_args), secs, hot in zip(recorded, in_sequence, warm)
    ]
    latency = _time_main(vm, dev, args)
    return {
        "latency": latency,
        "calls": calls,
        "builtin_calls": builtins,
        "copy_bandwidth": copy_bandwidth(),
        "cached_copy_bandwidth": copy_bandwidth(CACHED_BYTES),
    }


def _nbytes(t) -> int:
    shape = getattr(t, "shape", None)
    if shape is None:
        return 0
    n = np.dtype(str(t.dtype)).itemsize
    for d in shape:
        n *= int(d)
    return n


def _time_in_sequence(calls) -> list[float]:
    """Seconds of each (function, arguments) call when all of them run in order, as the
    model makes them: the median over `SEQUENCE_ROUNDS` replays (the first one, which
    also pays for first touches, left out)."""
    clock = time.perf_counter
    samples: list[list[float]] = [[] for _ in calls]
    for round_ in range(SEQUENCE_ROUNDS + 1):
        for i, (func, call_args) in enumerate(calls):
            t0 = clock()
            func(*call_args)
            if round_:
                samples[i].append(clock() - t0)
    return [float(np.median(s)) for s in samples]


def _time(module, symbol: str, dev, call_args) -> float:
    once = module.time_evaluator(symbol, dev, number=1, repeat=3)(*call_args).min
    number = max(1, int(MIN_REPEAT_SECS / max(once, 1e-9)))
    return float(module.time_evaluator(symbol, dev, number=number, repeat=REPEATS)(*call_args).min)


def _time_main(vm, dev, args) -> float:
    once = vm.time_evaluator("main", dev, number=1, repeat=3)(*args).min
    number = max(1, int(MIN_REPEAT_SECS / max(once, 1e-9)))
    return float(vm.time_evaluator("main", dev, number=number, repeat=REPEATS)(*args).min)


def copy_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes per second read plus written by a one-thread numpy copy of `nbytes` (the
    fastest of repeats lasting about 20 ms in all)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    number = max(1, (16 << 20) // nbytes)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(number):
            np.copyto(dst, src)
        best = min(best, (time.perf_counter() - t0) / number)
    return 2 * nbytes / best


# -- per task ---------------------------------------------------------------------------------


def in_model_breakdown(tasks, profile: ModelProfile) -> dict[str, dict[str, Any]]:
    """Per task key: its calls, seconds in the model, share of the latency, GB/s, GFLOPS,
    overhead share and what holds it back (`holds_back`, a list of short texts)."""
    by_symbol: dict[str, list[KernelCall]] = {}
    for c in profile.calls:
        name = c.symbol[: -len(PREPACKED_SUFFIX)] if c.symbol.endswith(PREPACKED_SUFFIX) else c.symbol
        by_symbol.setdefault(name, []).append(c)
    overhead = profile.overhead_per_call
    rows = {}
    for t in tasks.tasks:
        calls = [c for g in t.global_vars for c in by_symbol.get(g, [])]
        if not calls:
            continue
        seconds = sum(c.seconds for c in calls)
        warm = sum(c.warm_seconds for c in calls)
        nbytes = sum(c.bytes for c in calls)
        flops = t.flops * len(calls)
        per_call = seconds / len(calls)
        row = {
            "calls": len(calls),
            "seconds": seconds,
            "share": seconds / profile.latency if profile.latency > 0 else None,
            "seconds_per_call": per_call,
            "warm_seconds_per_call": warm / len(calls),
            "bytes_per_call": nbytes / len(calls),
            "overhead_share": overhead / (per_call + overhead) if per_call + overhead > 0 else 0.0,
            "gbps": nbytes / seconds / 1e9 if seconds > 0 else None,
            "gflops": flops / seconds / 1e9 if seconds > 0 else None,
            "flops_per_byte": flops / nbytes if nbytes else None,
        }
        bandwidth = profile.cached_copy_bandwidth if row["bytes_per_call"] <= CACHED_BYTES else profile.copy_bandwidth
        row["holds_back"] = holds_back(row, overhead, bandwidth or profile.copy_bandwidth)
        rows[t.key] = row
    return rows


def holds_back(row: Mapping[str, Any], overhead_per_call: float, bandwidth: float) -> list[str]:
    """What limits a task in the model, from its measured row (see the module docstring)."""
    out = []
    us = row["seconds_per_call"] * 1e6
    if row["overhead_share"] >= LAUNCH_BOUND_SHARE:
        out.append(
            f"launch-bound (kernel {us:.1f} us, {row['overhead_share']:.0%} of its share is the "
            f"{overhead_per_call * 1e6:.1f} us per-call overhead)"
        )
    gbps, bw = row["gbps"] or 0.0, bandwidth / 1e9
    if bw and gbps >= MEMORY_BOUND_SHARE * bw:
        where = "cache" if row["bytes_per_call"] <= CACHED_BYTES else "memory"
        out.append(f"memory-bound ({gbps:.1f} GB/s vs {bw:.1f} GB/s measured copy bandwidth from {where})")
    intensity = row["flops_per_byte"]
    calls = row["calls"]
    kernels = f"{calls} separate kernel{'s' if calls > 1 else ''}"
    if not row["gflops"]:
        out.append(f"data movement: {kernels} that only move data (a layout change between tasks)")
    elif intensity is not None and intensity < 1.0:
        out.append(f"elementwise, unfused: {kernels} of {intensity:.2f} FLOP/byte")
    elif not out:
        out.append(f"compute ({row['gflops']:.1f} GFLOPS, {intensity:.0f} FLOP/byte)")
    warm_us = (row.get("warm_seconds_per_call") or 0.0) * 1e6
    if warm_us > 0 and us >= COLD_DATA_RATIO * warm_us:
        out.append(f"cold data ({us:.1f} us per call in the model's sequence, {warm_us:.1f} us with its data in cache)")
    return out
