"""What a device is, as a fixed-length vector a cost model can condition on.

A pretrained cost model learns from many device classes at once (`pretrain`). Program
features say what a program does, not where it runs; appending the descriptor of the
class a program was measured on lets the trees learn how devices rank the same
programs differently (a 64-byte vector tile pays off with AVX-512, not with SSE4.2;
a 48 KiB shared-memory tile fits one GPU's blocks and not another's), and lets a class
the model never saw borrow from the classes whose descriptors are nearest.

`device_descriptor(target)` -> float32 vector of `DESCRIPTOR_NAMES` (width
`DESCRIPTOR_WIDTH`), from the target dict alone:
- kind: 1 for a GPU target, and the CPU architecture family (x86, arm);
- CPU: log2(1 + float vector bytes) and log2(1 + vector registers) (`TargetISA`),
  one 0/1 column per instruction-set extension in `CPU_FLAGS` (those that change the
  code TVM generates or how fast it runs), log2(cores);
- GPU (`GpuLimits`): compute capability (major + minor / 10), log2 of the SM count, of
  the threads, shared memory and registers one block may use, of the shared memory and
  threads one SM holds, and of the warp size.
Columns of the other kind are 0. Sizes enter as log2(1 + x), as program features do.

`DESCRIPTOR_VERSION` names the layout; a model trained with another version is not
used (`tunefarm.search.cost_model.pretrained`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tunefarm.gpu import GpuLimits, compute_capability, is_gpu

DESCRIPTOR_VERSION = 1
"""Version of the descriptor's layout; bumped whenever `DESCRIPTOR_NAMES` change."""

CPU_FLAGS = (
    "sse4.2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vnni", "avxvnni", "amx-tile",
    "neon", "dotprod", "i8mm", "sve", "sve2",
)  # fmt: skip
"""Instruction-set extensions (LLVM's names, `tunefarm.isa`) with a column of their own."""

FAMILIES = ("x86", "arm")
"""CPU architecture families with a column of their own (`tunefarm.isa.target_family`)."""

DESCRIPTOR_NAMES: list[str] = [
    "is_gpu",
    *(f"family_{f}" for f in FAMILIES),
    "log_vector_bytes",
    "log_vector_registers",
    "log_cores",
    *(f"isa_{f}" for f in CPU_FLAGS),
    "compute_capability",
    "log_multiprocessors",
    "log_max_threads_per_block",
    "log_shared_memory_per_block",
    "log_registers_per_block",
    "log_shared_memory_per_sm",
    "log_max_threads_per_sm",
    "log_warp_size",
]

DESCRIPTOR_WIDTH = len(DESCRIPTOR_NAMES)


def device_descriptor(target: dict[str, Any]) -> np.ndarray:
    """The descriptor of `target` (module doc). Raises TargetError for a target TVM does
    not accept or a CUDA target without its compute capability."""
    values = dict.fromkeys(DESCRIPTOR_NAMES, 0.0)
    if is_gpu(target):
        values.update(_gpu_columns(target))
    else:
        values.update(_cpu_columns(target))
    return np.array([values[name] for name in DESCRIPTOR_NAMES], dtype=np.float32)


def device_family(target: dict[str, Any]) -> str:
    """The family of device classes one pretrained model serves: "cuda" for an NVIDIA
    GPU, else the CPU architecture family ("x86", "arm", ...; `tunefarm.isa`), else the
    target's kind. Classes of one family share a feature layout."""
    from tunefarm.isa import target_family

    if is_gpu(target):
        return "cuda"
    return target_family(target) or str(target.get("kind", ""))


def _slog(x: float) -> float:
    return math.log2(1.0 + max(float(x), 0.0))


def _cpu_columns(target: dict[str, Any]) -> dict[str, float]:
    from tunefarm.isa import target_isa
    from tunefarm.target import num_cores

    isa = target_isa(target)
    columns = {
        f"family_{isa.family}": 1.0,
        "log_vector_bytes": _slog(isa.vector_bytes),
        "log_vector_registers": _slog(isa.vector_registers),
        "log_cores": math.log2(max(num_cores(target), 1)),
    }
    columns.update({f"isa_{flag}": 1.0 for flag in CPU_FLAGS if flag in isa.extensions})
    return {k: v for k, v in columns.items() if k in DESCRIPTOR_NAMES}


def _gpu_columns(target: dict[str, Any]) -> dict[str, float]:
    limits = GpuLimits.of(target)
    major, minor = compute_capability(target)
    return {
        "is_gpu": 1.0,
        "compute_capability": major + minor / 10,
        "log_multiprocessors": _slog(limits.sm.multiprocessors),
        "log_max_threads_per_block": _slog(limits.max_threads_per_block),
        "log_shared_memory_per_block": _slog(limits.max_shared_memory_per_block),
        "log_registers_per_block": _slog(limits.registers_per_block),
        "log_shared_memory_per_sm": _slog(limits.sm.shared_memory),
        "log_max_threads_per_sm": _slog(limits.sm.max_threads),
        "log_warp_size": _slog(limits.warp_size),
    }
