"""What a device agent tells the farm about its machine (`Register`'s capabilities).

`detect()` reads the OS (CPU model and ISA features from /proc/cpuinfo, cores, memory)
in the agent's own process, and asks TVM for the rest (`probe_tvm`: TVM's version,
LLVM's name for the CPU, the host target dict, a CUDA GPU's name and compute capability)
in an isolated child process, so that the agent itself never imports TVM. An agent
started with `--gpu` measures on its GPU: its target is the GPU's CUDA target
(`with_gpu_target`), and its default class is named after the GPU.

ARM (aarch64): the ISA features are the kernel's HWCAP bits (`getauxval(AT_HWCAP)` and
`AT_HWCAP2`, the same bits /proc/cpuinfo's "Features" line prints), named as the kernel
names them: `asimd` is NEON, `asimddp` the dot product instructions, `sve`/`sve2` the
scalable vectors, `i8mm`, `bf16`. The agent's target (`agent_target`) is TVM's host
target with the machine's triple (`aarch64-linux-gnu`: build workers cross-compile for
it) and, on aarch64, the LLVM features those bits stand for (`+neon`, `+dotprod`, `+sve`...),
so that a class an agent creates builds for what its CPU has.

Emulation (`emulation`): an agent may run under a user-mode emulator (qemu-user through
binfmt_misc, which is how the farm tests an aarch64 agent on an x86 machine). The
process then sees its own architecture (uname, HWCAP, ELF loading are emulated) while
the kernel's view, which the emulator does not rewrite, is the host's: the kernel's
architecture (/proc/sys/kernel/arch, or the CPU modalias in sysfs) or the CPU
/proc/cpuinfo describes is another family than `platform.machine()`. Such an agent
registers with `emulated: true`; its measurements still check outputs but their costs
are the emulator's (see the lease service and the shared cost model). The agent's
`TUNEFARM_AGENT_EMULATED` setting overrides the detection.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from services.protocol.errors import BadRequest
from tunefarm.isa import AARCH64_EXTENSIONS, X86_EXTENSIONS, arch_family, cpuinfo_flags, cpuinfo_model
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker
from tunefarm.target import physical_cores

AGENT_VERSION = "1"
"""Version of the agent's protocol behaviour (sent at registration)."""

ISA_FEATURES = frozenset(
    {
        # the extensions device classes are checked against (tunefarm.isa), by the OS's names
        *X86_EXTENSIONS.values(), *AARCH64_EXTENSIONS.values(),
        # more x86 and arm ones worth showing
        "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
        "neon", "fphp", "sme",
        # risc-v
        "v", "zvfh",
    }
)  # fmt: skip
"""CPU flags an agent reports: the instruction-set extensions that decide which kernels a
machine can run (and run fast). An x86 class is only served by an agent that has every
extension its target's code uses (`class_missing_extensions`)."""

AARCH64_HWCAP = (
    "fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp", "asimdhp",
    "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512",
    "sve", "asimdfhm", "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg",
)  # fmt: skip
"""The kernel's names of the AT_HWCAP bits on arm64, bit 0 first (asm/hwcap.h)."""

AARCH64_HWCAP2 = (
    "dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint",
    "svei8mm", "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh", "rng", "bti", "mte", "ecv",
    "afp", "rpres", "mte3", "sme",
)  # fmt: skip
"""... and of the AT_HWCAP2 bits."""

AT_HWCAP, AT_HWCAP2 = 16, 26

PROBE_TIMEOUT_SECS = 120.0


def detect(*, probe: bool = True, emulated: bool | None = None, worker: IsolatedWorker | None = None) -> dict[str, Any]:
    """The capabilities of this machine, as the Register message's fields. `emulated`
    overrides the detection of an emulator (`emulation`); `worker`: the child to probe
    TVM in (kept for `class_missing_extensions`; default: one of its own)."""
    machine = platform.machine()
    cpuinfo = _read("/proc/cpuinfo")
    model, features = _cpuinfo(cpuinfo)
    why = emulation(machine, kernel_arch(), cpuinfo)
    if arch_family(machine) == "arm":
        hwcaps = _auxv_hwcaps()
        if hwcaps is not None:  # the process's own view, right under an emulator too
            features = hwcap_features(*hwcaps)
    if why:
        model = f"emulated {machine} ({why})"
    caps: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": machine,
        "cpu_model": model or platform.processor(),
        "physical_cores": physical_cores(),
        "logical_cores": os.cpu_count() or 1,
        "isa_features": sorted(features & ISA_FEATURES),
        "memory_bytes": _meminfo().get("MemTotal", 0),
        "agent_version": AGENT_VERSION,
        "emulated": bool(why) if emulated is None else emulated,
        "emulation": why if emulated is None else ("set by the agent's settings" if emulated else ""),
    }
    if probe:
        probed = probe_in_child(worker=worker)
        if probed.get("target_json"):
            target = agent_target(json.loads(probed["target_json"]), machine, features)
            probed["target_json"] = json.dumps(target, sort_keys=True)
        caps.update(probed)
    return caps


def agent_target(host: dict[str, Any], machine: str, features: Iterable[str]) -> dict[str, Any]:
    """The target an agent reports: TVM's host target plus the machine's triple (build
    workers cross-compile for it) and, on aarch64, the LLVM features of its HWCAP."""
    target = dict(host)
    if target.get("kind") != "llvm":
        return target
    if platform.system() == "Linux" and "mtriple" not in target:
        libc = "musl" if platform.libc_ver()[0] not in ("glibc", "") else "gnu"
        target["mtriple"] = f"{machine}-linux-{libc}"
    if arch_family(machine) == "arm":
        have = set(features)
        mattr = [f"+{llvm}" for llvm, name in AARCH64_EXTENSIONS.items() if name in have]
        if mattr:
            target["mattr"] = sorted(set(target.get("mattr", [])) | set(mattr))
    return target


def hwcap_features(hwcap: int, hwcap2: int) -> set[str]:
    """The aarch64 feature names of AT_HWCAP and AT_HWCAP2 bits."""
    names = {name for bit, name in enumerate(AARCH64_HWCAP) if hwcap >> bit & 1}
    return names | {name for bit, name in enumerate(AARCH64_HWCAP2) if hwcap2 >> bit & 1}


def _auxv_hwcaps() -> tuple[int, int] | None:
    """(AT_HWCAP, AT_HWCAP2) of this process, from the C library (None if unavailable)."""
    try:
        libc = ctypes.CDLL(None)
        getauxval = libc.getauxval
    except (OSError, AttributeError):
        return None
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    return int(getauxval(AT_HWCAP)), int(getauxval(AT_HWCAP2))


def kernel_arch() -> str:
    """The running kernel's architecture, as the kernel reports it outside the process
    (no emulator rewrites these files): /proc/sys/kernel/arch, or the CPU type of
    /sys/devices/system/cpu/modalias ("cpu:type:x86,..." / "cpu:type:aarch64:..."); "" if neither."""
    arch = _read("/proc/sys/kernel/arch").strip()
    if arch:
        return arch
    modalias = _read("/sys/devices/system/cpu/modalias")
    if modalias.startswith("cpu:type:"):
        return modalias[len("cpu:type:") :].split(":")[0].split(",")[0].strip()
    return ""


def emulation(machine: str, kernel: str, cpuinfo: str) -> str:
    """Why this process runs under an emulator ("" when nothing says so): the kernel's
    architecture, or the CPU /proc/cpuinfo describes, is of another family than the
    process's own (`machine`)."""
    own = arch_family(machine)
    if kernel and arch_family(kernel) != own:
        return f"the process is {machine}, the kernel {kernel}"
    described = _cpuinfo_family(cpuinfo)
    if described and described != own:
        return f"the process is {machine}, /proc/cpuinfo describes an {described} CPU"
    return ""


def _cpuinfo_family(text: str) -> str:
    """The architecture family whose CPU a /proc/cpuinfo text describes, by the fields
    only that architecture's kernel prints ("" when it cannot tell)."""
    keys = {line.partition(":")[0].strip().lower() for line in text.splitlines()}
    if "vendor_id" in keys and "flags" in keys:
        return "x86"
    if "cpu implementer" in keys or "cpu architecture" in keys:
        return "arm"
    if "isa" in keys and "mmu" in keys:
        return "riscv"
    return ""


def probe_worker(timeout: float = PROBE_TIMEOUT_SECS) -> IsolatedWorker:
    """An isolated child with TVM imported, for `probe_tvm` and `missing_for_target`."""
    return IsolatedWorker(preload=["tvm"], name="probe", start_timeout=timeout, blocked_imports=WITHOUT_TORCH)


def probe_in_child(timeout: float = PROBE_TIMEOUT_SECS, worker: IsolatedWorker | None = None) -> dict[str, Any]:
    """`probe_tvm` run in an isolated child ({} if TVM cannot even start there); in
    `worker` when given (left running), else in one of its own."""
    child = worker or probe_worker(timeout)
    try:
        outcome = child.call(f"{__name__}:probe_tvm", timeout=timeout)
    finally:
        if worker is None:
            child.close()
    return dict(outcome.value) if outcome.ok else {}


def probe_tvm() -> dict[str, Any]:
    """TVM's view of this machine (runs where TVM is imported)."""
    import tvm

    from tunefarm.target import host_target_dict

    out: dict[str, Any] = {
        "tvm_version": str(tvm.__version__),
        "llvm_cpu": str(tvm.target.codegen.llvm_get_system_cpu()),
        "target_json": json.dumps(host_target_dict(), sort_keys=True),
    }
    try:
        dev = tvm.cuda(0)
        if dev.exist:
            out["gpu_name"] = str(dev.device_name)
            out["gpu_compute_capability"] = str(dev.compute_version)
            out["gpu_max_threads_per_block"] = int(dev.max_threads_per_block)
            out["gpu_warp_size"] = int(dev.warp_size)
    except Exception:  # no CUDA runtime in this build or on this machine
        pass
    return out


def with_gpu_target(caps: dict[str, Any]) -> dict[str, Any]:
    """The capabilities of an agent that measures on its GPU (`--gpu`): its target is
    the GPU's CUDA target (the compute capability as `arch`, the probed thread limits;
    shared memory per block is the static 48 KB TVM's kernels use). Raises BadRequest
    when the probe found no GPU."""
    capability = str(caps.get("gpu_compute_capability") or "")
    if not capability:
        raise BadRequest("--gpu: no CUDA GPU on this machine (TVM's CUDA runtime finds no device, or no driver)")
    major, minor = capability.split(".")[:2]
    target: dict[str, Any] = {"kind": "cuda", "arch": f"sm_{major}{minor}"}
    if caps.get("gpu_max_threads_per_block"):
        target["max_threads_per_block"] = int(caps["gpu_max_threads_per_block"])
    if caps.get("gpu_warp_size"):
        target["thread_warp_size"] = int(caps["gpu_warp_size"])
    return {**caps, "target_json": json.dumps(target, sort_keys=True)}


def class_missing_extensions(
    target_json: str, flags: Iterable[str], timeout: float = PROBE_TIMEOUT_SECS, worker: IsolatedWorker | None = None
) -> list[str] | None:
    """The instruction-set extensions the code of a class's target (TVM target JSON) uses
    that a CPU with these OS flags lacks (`tunefarm.isa`): [] when it runs there, None when
    it cannot be told (no flags, or TVM does not answer). LLVM is asked in an isolated
    child (`worker` when given, e.g. the agent's probe child, left running; in this
    process when it has imported TVM already)."""
    flags = sorted(flags)
    if not flags or not target_json:
        return None
    if "tvm" in sys.modules:
        return missing_for_target(target_json, flags)
    child = worker or probe_worker(timeout)
    try:
        outcome = child.call(f"{__name__}:missing_for_target", target_json, flags, timeout=timeout)
    finally:
        if worker is None:
            child.close()
    return list(outcome.value) if outcome.ok else None


def missing_for_target(target_json: str, flags: list[str]) -> list[str]:
    """`class_missing_extensions`'s work (runs where TVM is imported)."""
    from tunefarm.isa import missing_extensions, target_isa

    return missing_extensions(target_isa(json.loads(target_json)), flags)


def isa_refusal(device_class: str, target_json: str, missing: list[str], cpu_model: str) -> str:
    """Why an agent does not serve a class whose code its CPU cannot run."""
    mcpu = json.loads(target_json).get("mcpu", "generic")
    return (
        f"device class {device_class!r} ({mcpu}) builds code using {', '.join(missing)}, "
        f"which this machine's CPU ({cpu_model}) lacks"
    )


def default_device_class(caps: dict[str, Any]) -> str:
    """A class name for an agent given none: architecture, LLVM CPU and cores
    (e.g. "x86_64-znver5-2c"), so identical machines share a class; for an agent that
    measures on its GPU, the GPU's arch and name (e.g. "cuda-sm_80-nvidia-a100-sxm4-40gb")."""
    target = json.loads(caps.get("target_json") or "{}")
    if target.get("kind") == "cuda":
        gpu = "".join(ch if ch.isalnum() else "-" for ch in str(caps.get("gpu_name", "gpu")).lower()).strip("-")
        return f"cuda-{target.get('arch')}-{gpu}"
    cpu = caps.get("llvm_cpu") or "generic"
    return f"{caps.get('arch', 'unknown')}-{cpu}-{caps.get('physical_cores', 1)}c"


def health_numbers(work_dir: Path) -> dict[str, Any]:
    """Load, free memory and free disk, for ReportHealth."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    try:
        import shutil

        disk = shutil.disk_usage(work_dir).free
    except OSError:
        disk = 0
    return {
        "load_average_1m": load,
        "memory_available_bytes": _meminfo().get("MemAvailable", 0),
        "disk_free_bytes": disk,
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpuinfo(text: str) -> tuple[str, set[str]]:
    return cpuinfo_model(text), set(cpuinfo_flags(text))


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out
