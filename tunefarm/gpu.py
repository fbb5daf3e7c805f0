"""NVIDIA targets: what a CUDA target dict says about the GPU it builds for.

A CUDA target is TVM's JSON dict with the compute capability as `arch`:
`{"kind": "cuda", "arch": "sm_80"}`. The search needs the GPU's limits (threads per
block, shared memory per block, warp size...) to reject programs that cannot launch
before they cost a build, and the build worker needs the same limits for TVM's GPU
code verifier. Without a GPU nothing can be asked of the driver, so the limits come
from the compute capability (`GpuLimits.of`), and a target may override any of them
with TVM's own attribute names (`max_threads_per_block`, `max_shared_memory_per_block`,
`thread_warp_size`, `registers_per_block`), e.g. the values a GPU agent detected.

From sm_80 (Ampere) on, a block's shared memory is not capped at the 48 KB a kernel may
declare statically: stages beyond that are allocated dynamically (TVM's "shared.dyn"
scope, whose size the launch passes, with the per-function opt-in TVM's CUDA runtime
makes), up to the compute capability's opt-in limit per block (`block_shared_memory`:
163 KB on sm_80, 227 KB on sm_90); and global-to-shared copies can be asynchronous
(cp.async), which the software-pipelined shared stages use (`async_copy`). Older
targets keep the 48 KB static limit and synchronous copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tunefarm.errors import TargetError

GPU_KINDS = frozenset({"cuda"})
"""TVM target kinds whose kernels run on an NVIDIA GPU."""

STATIC_SHARED_MEMORY_BYTES = 48 * 1024
"""Shared memory one block may declare statically (`__shared__` arrays, how TVM allocates
the "shared" scope) on every compute capability; more needs dynamic shared memory and
the kernel's opt-in (see the module docstring)."""

ASYNC_COPY_CAPABILITY = (8, 0)
"""The first compute capability with asynchronous global-to-shared copies (cp.async,
Ampere), and the first whose kernels tunefarm gives dynamic shared memory beyond the
static 48 KB: older targets keep what they had."""

TENSOR_CORE_CAPABILITY = (7, 0)
"""The first compute capability with tensor cores (Volta): warp-wide 16x16x16 matrix
multiply-accumulates of float16 operands into float32 (CUDA's wmma API, which TVM's
wmma intrinsics emit), the tensor-core rule's (`tunefarm.search.space.tensor_core`)."""

MAX_VTHREADS = 8
"""Largest virtual-thread extent (Ansor's `max_vthread_extent`)."""

MAX_VECTOR_BYTES = 16
"""Widest load or store one thread issues (float4)."""

_ARCH = re.compile(r"^sm_(\d)(\d+)[af]?$")


@dataclass(frozen=True)
class MultiprocessorLimits:
    """What one streaming multiprocessor (SM) holds at once, by compute capability (NVIDIA's
    CUDA C Programming Guide, "Technical Specifications per Compute Capability"), and how
    many SMs the arch's datacenter part has (A100: 108, H100 SXM: 132). The SM count is a
    part's, not the arch's (an A30 is sm_80 with 56): waves computed from it are an
    estimate of the device class's flagship."""

    multiprocessors: int
    max_threads: int  # resident threads per SM
    max_blocks: int  # resident blocks per SM
    shared_memory: int  # bytes of shared memory per SM
    registers: int = 65536  # 32-bit registers per SM
    block_shared_memory: int = STATIC_SHARED_MEMORY_BYTES  # bytes one block may opt in to (dynamic)


SM_LIMITS: dict[tuple[int, int], MultiprocessorLimits] = {
    (7, 0): MultiprocessorLimits(80, 2048, 32, 96 * 1024, block_shared_memory=96 * 1024),
    (7, 5): MultiprocessorLimits(40, 1024, 16, 64 * 1024, block_shared_memory=64 * 1024),
    (8, 0): MultiprocessorLimits(108, 2048, 32, 164 * 1024, block_shared_memory=163 * 1024),
    (8, 6): MultiprocessorLimits(84, 1536, 16, 100 * 1024, block_shared_memory=99 * 1024),
    (8, 7): MultiprocessorLimits(16, 2048, 16, 164 * 1024, block_shared_memory=163 * 1024),
    (8, 9): MultiprocessorLimits(142, 1536, 24, 100 * 1024, block_shared_memory=99 * 1024),
    (9, 0): MultiprocessorLimits(132, 2048, 32, 228 * 1024, block_shared_memory=227 * 1024),
    (10, 0): MultiprocessorLimits(148, 2048, 32, 228 * 1024, block_shared_memory=227 * 1024),
    (12, 0): MultiprocessorLimits(170, 1536, 32, 100 * 1024, block_shared_memory=99 * 1024),
}
"""Per compute capability; an arch not listed takes the closest older one's."""


def sm_limits(capability: tuple[int, int]) -> MultiprocessorLimits:
    """The SM limits of a compute capability (the closest older listed one's)."""
    older = [cc for cc in SM_LIMITS if cc <= capability]
    return SM_LIMITS[max(older)] if older else SM_LIMITS[min(SM_LIMITS)]


def is_gpu(target: dict[str, Any]) -> bool:
    """The target builds kernels for an NVIDIA GPU."""
    return str(target.get("kind")) in GPU_KINDS


def compute_capability(target: dict[str, Any]) -> tuple[int, int]:
    """(major, minor) of a CUDA target's `arch` ("sm_80" -> (8, 0)). Raises TargetError."""
    arch = str(target.get("arch", ""))
    m = _ARCH.match(arch)
    if m is None:
        raise TargetError(
            f'a CUDA target needs the compute capability as "arch", e.g. {{"kind": "cuda", "arch": "sm_80"}}; got {arch!r}'
        )
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class GpuLimits:
    """What one block of a kernel may use on the target GPU."""

    arch: str  # "sm_80"
    max_threads_per_block: int = 1024
    warp_size: int = 32
    max_shared_memory_per_block: int = STATIC_SHARED_MEMORY_BYTES  # static and dynamic together
    registers_per_block: int = 65536  # 32-bit registers of one block (every CC >= 5.0)
    max_registers_per_thread: int = 255
    max_vthreads: int = MAX_VTHREADS
    max_vector_bytes: int = MAX_VECTOR_BYTES
    sm: MultiprocessorLimits = SM_LIMITS[(8, 0)]  # what one SM holds, and how many SMs
    capability: tuple[int, int] = (8, 0)

    @staticmethod
    def of(target: dict[str, Any]) -> GpuLimits:
        """The limits of a CUDA target: its compute capability's, overridden by the
        target's own attributes. A block's shared memory: what the target declares, else
        from sm_80 on the compute capability's opt-in limit (`block_shared_memory`), else
        the static 48 KB. Raises TargetError for a target without an arch."""
        capability = compute_capability(target)
        if capability[0] < 5:
            raise TargetError(f"compute capability {target.get('arch')} is older than Maxwell (sm_50): not supported")
        sm = sm_limits(capability)
        shared = STATIC_SHARED_MEMORY_BYTES
        if capability >= ASYNC_COPY_CAPABILITY:
            shared = sm.block_shared_memory
        return GpuLimits(
            arch=str(target["arch"]),
            max_threads_per_block=int(target.get("max_threads_per_block", target.get("max_num_threads", 1024))),
            warp_size=int(target.get("thread_warp_size", 32)),
            max_shared_memory_per_block=int(target.get("max_shared_memory_per_block", shared)),
            registers_per_block=int(target.get("registers_per_block", 65536)),
            sm=sm,
            capability=capability,
        )

    @property
    def async_copy(self) -> bool:
        """Shared stages may be software-pipelined with asynchronous copies (cp.async), and
        a block's shared memory beyond the static 48 KB is allocated dynamically."""
        return self.capability >= ASYNC_COPY_CAPABILITY

    @property
    def tensor_cores(self) -> bool:
        """The GPU multiplies float16 matrices into float32 on tensor cores (wmma)."""
        return self.capability >= TENSOR_CORE_CAPABILITY

    @property
    def static_shared_memory_per_block(self) -> int:
        """Shared memory one block may allocate statically: beyond it a kernel's stages
        take dynamic shared memory (`async_copy` targets only)."""
        return min(self.max_shared_memory_per_block, STATIC_SHARED_MEMORY_BYTES)

    def verifier_constraints(self) -> dict[str, int]:
        """The constraints of TVM's `verify_gpu_code`, with TVM's names."""
        return {
            "max_threads_per_block": self.max_threads_per_block,
            "max_shared_memory_per_block": self.max_shared_memory_per_block,
            "max_local_memory_per_block": self.registers_per_block * 4,
            "max_thread_x": self.max_threads_per_block,
            "max_thread_y": self.max_threads_per_block,
            "max_thread_z": 64,
            "max_vthread": self.max_vthreads,
            "max_vector_bytes": self.max_vector_bytes,
        }


def gpu_compatible(target: dict[str, Any], capability: str) -> str:
    """Why an agent whose GPU has compute capability `capability` ("8.6"; "" for none)
    cannot run a CUDA class's kernels ("" when it can): the kernels carry the class
    arch's SASS, which GPUs of the same major version and a minor at least as high run,
    and its PTX, which the driver compiles for a newer major version."""
    if not capability:
        return "this agent has no CUDA GPU"
    try:
        major, minor = (int(x) for x in capability.split(".")[:2])
    except ValueError:
        return f"this agent reports compute capability {capability!r}"
    want = compute_capability(target)
    if (major, minor) < want:
        return f"this agent's GPU is compute capability {capability}, older than the class's"
    return ""
