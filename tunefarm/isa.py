"""Instruction-set extensions: what code built for a target needs, what a CPU has.

A device class is defined by its target. On x86 that is chiefly the LLVM `mcpu` (and
`mattr`): `haswell` builds AVX2+FMA code, `x86-64-v2` SSE4.2 code, `skylake-avx512` and
`znver5` AVX-512 code. Code built for a target runs on a CPU that has every
instruction-set extension the target enables, so one machine can measure several
classes (an AVX-512 machine runs `haswell` and `x86-64-v2` kernels too).

- `target_isa(target)` asks LLVM (through TVM, `llvm_get_cpu_features`) which features the
  target's mcpu and mattr enable, and keeps the instruction-set extensions among them
  (`TargetISA`: the architecture family and those extension names, in LLVM's spelling).
  LLVM's lists also hold tuning properties (`fast-*`, `slow-*`, `false-deps-*`, ...) and
  instructions no generated kernel executes (`invpcid`, `aes`, `clwb`...): those are not compared.
- `cpu_isa(flags)`: the same names for a CPU, from the flags the operating system prints
  (Linux's /proc/cpuinfo `flags`, or the aarch64 HWCAP names).
- `missing_extensions(target_isa, cpu_isa)`: what code for the target needs and the CPU
  lacks (empty: it runs there). `host_isa()` is this machine's.

The tables below name each extension in LLVM's and in Linux's spelling (they differ:
`sse4.1`/`sse4_1`, `sse3`/`pni`, `lzcnt`/`abm`...). They list instruction-set extensions,
never CPUs: which CPU has what comes from LLVM (for a target) and the OS (for a machine).
An extension missing from the table is not checked, which can only let an agent register
for a class whose kernels then fail on it (recorded as crashes), never refuse one.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm.errors import TargetError

X86_EXTENSIONS = {
    "64bit": "lm", "x87": "fpu", "cmov": "cmov", "cx8": "cx8", "cx16": "cx16", "mmx": "mmx", "fxsr": "fxsr",
    "nopl": "nopl", "sahf": "lahf_lm", "popcnt": "popcnt", "lzcnt": "abm", "movbe": "movbe",
    "bmi": "bmi1", "bmi2": "bmi2", "adx": "adx", "prfchw": "3dnowprefetch",
    "sse": "sse", "sse2": "sse2", "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2",
    "crc32": "sse4_2", "sse4a": "sse4a", "fma4": "fma4", "xop": "xop",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "gfni": "gfni", "avxvnni": "avx_vnni",
    "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avx512vp2intersect": "avx512_vp2intersect",
    "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
}  # fmt: skip
"""x86 instruction-set extensions a compiler may emit in generated code: LLVM's name ->
Linux's /proc/cpuinfo flag (`crc32` is part of SSE4.2, which Linux reports for both).
Extensions only an intrinsic emits (aes, sha, rdrand, clwb, xsave...) are left out: a
kernel never uses them, and a class whose mcpu has them still runs where they are missing."""

AARCH64_EXTENSIONS = {
    "neon": "asimd", "fullfp16": "asimdhp", "dotprod": "asimddp", "i8mm": "i8mm", "bf16": "bf16",
    "sve": "sve", "sve2": "sve2",
}  # fmt: skip
"""aarch64 extensions that change the code TVM generates: LLVM's name -> the kernel's HWCAP name."""

EXTENSIONS = {"x86": X86_EXTENSIONS, "arm": AARCH64_EXTENSIONS}
"""The tables by architecture family."""

VECTOR_BYTES = (("avx512f", 64), ("avx", 32), ("sse", 16), ("sse2", 16), ("neon", 16))
"""Float vector register width an extension brings, widest first (`TargetISA.vector_bytes`)."""

VECTOR_REGISTERS = (("avx512f", 32), ("avx", 16), ("sse", 16), ("sse2", 16), ("neon", 32))
"""How many of those registers the code has: AVX-512 has 32 zmm, AVX and SSE 16 (ymm, xmm),
aarch64 32 NEON registers (`TargetISA.vector_registers`)."""


@dataclass(frozen=True)
class TargetISA:
    """The instruction-set extensions code built for a target uses, in LLVM's names."""

    family: str  # architecture family: "x86", "arm", ... ("" when not a CPU target)
    extensions: frozenset[str]

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "extensions": sorted(self.extensions)}

    @property
    def vector_bytes(self) -> int:
        """Width of the widest vector registers this code computes floats in: 64 with
        AVX-512, 32 with AVX, 16 with SSE or NEON (SVE's width is the board's: 16 is its
        minimum); 0 when unknown."""
        for ext, width in VECTOR_BYTES:
            if ext in self.extensions:
                return width
        return 0

    @property
    def vector_registers(self) -> int:
        """How many float vector registers of that width the code has; 0 when unknown."""
        for ext, count in VECTOR_REGISTERS:
            if ext in self.extensions:
                return count
        return 0


def arch_family(name: str) -> str:
    """Architectures whose code one CPU runs natively share a family: "x86" (x86_64,
    i686), "arm" (aarch64, armv7l), "riscv", ...; other names are their own family."""
    name = name.lower()
    if name in ("x86", "x86_64", "amd64", "x64") or (len(name) == 4 and name[0] == "i" and name.endswith("86")):
        return "x86"
    if name.startswith(("aarch64", "arm")):
        return "arm"
    if name.startswith("riscv"):
        return "riscv"
    if name.startswith(("ppc", "powerpc")):
        return "ppc"
    return name


def target_family(target: dict[str, Any]) -> str:
    """The architecture family an LLVM target builds for: its `mtriple`'s, or this
    machine's when it has none ("" for a target that is not a CPU's)."""
    if target.get("kind") != "llvm":
        return ""
    triple = str(target.get("mtriple", ""))
    return arch_family(triple.split("-")[0] if triple else platform.machine())


def target_isa(target: dict[str, Any]) -> TargetISA:
    """The extensions LLVM enables for `target` (its mcpu, mattr and triple). Raises
    `TargetError` for a target TVM does not accept."""
    family = target_family(target)
    table = EXTENSIONS.get(family)
    if table is None:
        return TargetISA(family, frozenset())
    import tvm

    from tunefarm.tvm_target import to_tvm_target

    features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(to_tvm_target(target))}
    return TargetISA(family, frozenset(features & table.keys()))


def cpu_isa(family: str, flags: set[str] | frozenset[str] | list[str]) -> frozenset[str]:
    """The extensions (LLVM's names) a CPU of `family` with these OS flags has."""
    have = set(flags)
    return frozenset(llvm for llvm, os_name in EXTENSIONS.get(family, {}).items() if os_name in have)


def missing_extensions(needed: TargetISA, flags: set[str] | frozenset[str] | list[str]) -> list[str]:
    """The extensions code for `needed` uses that a CPU with these OS flags lacks, sorted
    (empty: that code runs on it)."""
    return sorted(needed.extensions - cpu_isa(needed.family, flags))


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The CPU flags of a /proc/cpuinfo text (x86 `flags`, aarch64 `Features`, RISC-V `isa`)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features", "isa"):
            return frozenset(value.split())
    return frozenset()


def cpuinfo_model(text: str) -> str:
    """The CPU model of a /proc/cpuinfo text (x86 `model name`, aarch64 `Hardware` or `CPU
    model`, RISC-V `uarch`); "" when it names none."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("model name", "hardware", "cpu model", "uarch"):
            return value.strip()
    return ""


def host_cpu_model() -> str:
    """This machine's CPU model as its OS names it ("" when it does not)."""
    try:
        return cpuinfo_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        return ""


def host_flags() -> frozenset[str]:
    """This machine's CPU flags as its OS reports them (empty when it does not)."""
    try:
        return cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def runs_on_host(target: dict[str, Any]) -> bool:
    """Whether this machine can run code built for `target`: a CPU target of its own
    architecture family whose extensions its CPU has (unknown flags: assumed so)."""
    if target_family(target) != arch_family(platform.machine()):
        return False
    flags = host_flags()
    return not flags or not missing_extensions(target_isa(target), flags)


def check_runs_on_host(target: dict[str, Any], what: str = "this target") -> None:
    """Raise `TargetError` naming the missing extensions when this machine cannot run
    code built for `target` (another architecture, or an ISA its CPU lacks)."""
    family, own = target_family(target), arch_family(platform.machine())
    if family != own:
        raise TargetError(f"{what} builds for {family or target.get('kind')}; this machine is {own}")
    flags = host_flags()
    missing = missing_extensions(target_isa(target), flags) if flags else []
    if missing:
        raise TargetError(f"this CPU cannot run code built for {what} (it lacks {', '.join(missing)})")
