"""The timing floor: the least time a kernel can take on a device class, whatever it does.

A kernel of a task does the task's work: `flops` operations (`Workload.flops`, one
call) and reading its inputs and writing its outputs (`Workload.io_bytes`, the sum of
its buffers' sizes). No device does either faster than its peak, so

    floor = max(flops / peak_ops, io_bytes / peak_bytes) / SAFETY_FACTOR

and a timing below it was not measured: it is stored as an error result of kind
`below_floor` (`ErrorKind.BELOW_FLOOR`, its reported times in the message), which is never
a task's best nor trains a cost model, and counts against the agent that sent it
(`Agent.below_floor`: the agent is flagged, `services.db.trust`).

The peaks come from the class's target and are bounds no real device of it reaches, so
that a real fast kernel is never refused:

- a CPU class (`llvm`): `num-cores` (the target's; `UNKNOWN_CORES` when it names none)
  x `CPU_OPS_PER_CYCLE` x `CLOCK_HZ_BOUND` operations per second, and likewise
  `CPU_BYTES_PER_CYCLE` bytes. Per cycle, a core does at most 2048 operations (Intel
  AMX's int8 tile multiply: 1024 multiply-adds; AVX-512 with two FMA units does 64 fp32
  or 256 int8 operations) and moves at most 512 bytes (L1 serves two 64-byte loads and a
  64-byte store); no core clocks faster than 8 GHz (the fastest ship at 6.2).
- a CUDA class: `GPU_OPS_PER_SEC` and `GPU_BYTES_PER_SEC`, above any GPU's tensor-core
  peak (sparse FP4 on the largest parts: about 2e16) and any on-chip bandwidth.
- another kind: no floor (nothing is refused).

`SAFETY_FACTOR` covers FLOP counts that overstate the work a kernel must do (a schedule
may skip a padding's zeros the count includes). With it, a 2-core class's floor for a
128x128x128 matrix multiply is 13 ns; such a kernel takes microseconds on real cores.
A tiny kernel's floor is below a nanosecond: the floor catches impossible times of real
work, and confirmations (`services.db.confirmations`) catch the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tunefarm.records import ErrorKind, MeasureRecord

CLOCK_HZ_BOUND = 8e9
"""No CPU core runs faster (the fastest shipping ones boost to 6.2 GHz)."""

CPU_OPS_PER_CYCLE = 2048
"""Operations per cycle and core, at most: AMX's int8 tile multiply (1024 multiply-adds)."""

CPU_BYTES_PER_CYCLE = 512
"""Bytes per cycle and core from or to its nearest cache, at most (L1: 2 loads + 1 store of 64 bytes)."""

UNKNOWN_CORES = 256
"""Cores assumed for a CPU class whose target names no `num-cores` (the largest sockets)."""

GPU_OPS_PER_SEC = 2e16
"""Operations per second of any GPU, at most (sparse FP4 tensor cores of the largest parts)."""

GPU_BYTES_PER_SEC = 1e15
"""Bytes per second any GPU moves through its memory or caches, at most."""

SAFETY_FACTOR = 10.0
"""The floor is the peak-speed time divided by this."""


def peak(target: Mapping[str, Any]) -> tuple[float, float] | None:
    """(operations per second, bytes per second) no device of the class exceeds; None
    for a kind of target without a bound."""
    kind = str(target.get("kind", ""))
    if kind == "cuda":
        return GPU_OPS_PER_SEC, GPU_BYTES_PER_SEC
    if kind != "llvm":
        return None
    try:
        cores = int(target.get("num-cores") or UNKNOWN_CORES)
    except (TypeError, ValueError):
        cores = UNKNOWN_CORES
    cores = max(1, cores)
    return cores * CPU_OPS_PER_CYCLE * CLOCK_HZ_BOUND, cores * CPU_BYTES_PER_CYCLE * CLOCK_HZ_BOUND


def floor_secs(target: Mapping[str, Any], *, flops: float, io_bytes: int | None) -> float:
    """The least seconds one call of a task may take on the class (0: no floor)."""
    bound = peak(target)
    if bound is None:
        return 0.0
    ops_per_sec, bytes_per_sec = bound
    work = max(0.0, float(flops)) / ops_per_sec
    traffic = max(0, int(io_bytes or 0)) / bytes_per_sec
    return max(work, traffic) / SAFETY_FACTOR


def below(record: MeasureRecord, floor: float) -> bool:
    """A valid record with a repeat faster than the floor (no repeat can be)."""
    return floor > 0 and record.is_valid and min(record.costs) < floor


def refused(record: MeasureRecord, floor: float) -> MeasureRecord:
    """The record as stored when `below` the floor: an error of kind below_floor, its
    reported times in the message."""
    reported = ", ".join(f"{c:.3g}" for c in record.costs[:8])
    return replace(
        record,
        costs=(),
        error_kind=ErrorKind.BELOW_FLOOR,
        error_msg=f"reported {reported} s per call, below the class's timing floor of {floor:.3g} s "
        "(its FLOPs and bytes at the class's peak): not a measurement",
        verified=False,
    )


def checked(record: MeasureRecord, floor: float) -> MeasureRecord:
    """The record, or its `refused` form when it is below the floor."""
    return refused(record, floor) if below(record, floor) else record


__all__ = ["floor_secs", "peak", "below", "refused", "checked", "SAFETY_FACTOR"]

