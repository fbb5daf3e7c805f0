"""What a device agent tells the farm about its machine (`Register`'s capabilities).

`detect()` reads the OS (CPU model and ISA features from /proc/cpuinfo, cores, memory)
in the agent's own process, and asks TVM for the rest (`probe_tvm`: TVM's version,
LLVM's name for the CPU, the host target dict, a CUDA GPU's name and compute capability)
in an isolated child process, so that the agent itself never imports TVM.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

from tunefarm.isolation import IsolatedWorker
from tunefarm.target import physical_cores

AGENT_VERSION = "1"
"""Version of the agent's protocol behaviour (sent at registration)."""

ISA_FEATURES = frozenset(
    {
        # x86
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
        "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
        # arm (the kernel's names)
        "neon", "asimd", "asimdhp", "asimddp", "fphp", "sve", "sve2", "i8mm", "bf16", "sme",
        # risc-v
        "v", "zvfh",
    }
)  # fmt: skip
"""CPU flags worth reporting: those that decide which kernels a machine can run fast."""

PROBE_TIMEOUT_SECS = 120.0


def detect(*, probe: bool = True) -> dict[str, Any]:
    """The capabilities of this machine, as the Register message's fields."""
    model, features = _cpuinfo()
    caps: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu_model": model or platform.processor(),
        "physical_cores": physical_cores(),
        "logical_cores": os.cpu_count() or 1,
        "isa_features": sorted(features & ISA_FEATURES),
        "memory_bytes": _meminfo().get("MemTotal", 0),
        "agent_version": AGENT_VERSION,
    }
    if probe:
        caps.update(probe_in_child())
    return caps


def probe_in_child(timeout: float = PROBE_TIMEOUT_SECS) -> dict[str, Any]:
    """`probe_tvm` run in an isolated child ({} if TVM cannot even start there)."""
    worker = IsolatedWorker(preload=["tvm"], name="probe", start_timeout=timeout)
    try:
        outcome = worker.call(f"{__name__}:probe_tvm", timeout=timeout)
    finally:
        worker.close()
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
    except Exception:  # no CUDA runtime in this build or on this machine
        pass
    return out


def default_device_class(caps: dict[str, Any]) -> str:
    """A class name for an agent given none: architecture, LLVM CPU and cores
    (e.g. "x86_64-znver5-2c"), so identical machines share a class."""
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


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    model, features = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model", "uarch") and not model:
            model = value.strip()
        elif key in ("flags", "features", "isa") and not features:
            features = set(value.split())
    return model, features


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
