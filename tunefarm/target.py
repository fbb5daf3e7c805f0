"""Target detection and parsing. TVM 0.27 takes JSON-dict targets only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tunefarm.errors import TargetError
from tunefarm.gpu import GpuLimits, is_gpu
from tunefarm.tvm_target import check_llvm_cpu, to_tvm_target


def physical_cores() -> int:
    """Cores the kernels may use: the physical ones when psutil knows them."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unsupported platform
        n = None
    return int(n or os.cpu_count() or 1)


def host_target_dict() -> dict[str, Any]:
    """The host CPU as a TVM target dict: LLVM with the detected mcpu and core count.

    Without mcpu LLVM emits SSE-only code (a 512 GEMM ran 1.4x slower), so it is always set.
    A CPU model's name says more than a virtual machine may expose: an Emerald Rapids guest
    without AMX is detected as "emeraldrapids", whose code may use AMX. The extensions the
    mcpu implies but the OS does not report are turned off (`mattr` "-amx-tile", ...), so
    that the host's target runs on the host.
    """
    import tvm

    from tunefarm.isa import host_flags, missing_extensions, target_isa

    mcpu = str(tvm.target.codegen.llvm_get_system_cpu())
    target: dict[str, Any] = {"kind": "llvm", "mcpu": mcpu, "num-cores": physical_cores()}
    flags = host_flags()
    missing = missing_extensions(target_isa(target), flags) if flags else []
    if missing:
        target = {"kind": "llvm", "mcpu": mcpu, "mattr": [f"-{ext}" for ext in missing], "num-cores": physical_cores()}
    return target


def parse_target(text: str | None) -> dict[str, Any]:
    """`None` -> the host; otherwise a JSON dict, inline or in a file."""
    if text is None:
        return host_target_dict()
    raw = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise TargetError(f"--target must be a JSON dict or a JSON file, got {text!r}")
        raw = path.read_text()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TargetError(f"--target is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(data, dict) or "kind" not in data:
        raise TargetError('--target must be a JSON object with a "kind", e.g. {"kind": "llvm", "mcpu": "skylake"}')
    if is_gpu(data):
        GpuLimits.of(data)  # a CUDA target names its compute capability
    check_llvm_cpu(data)
    to_tvm_target(data)  # validate now, not in a worker
    return data


def num_cores(target: dict[str, Any]) -> int:
    return int(target.get("num-cores") or physical_cores())


def describe(target: dict[str, Any]) -> str:
    parts = [str(target.get("kind"))]
    for key in ("mcpu", "mtriple", "arch", "num-cores"):
        if key in target:
            parts.append(f"{key}={target[key]}")
    return " ".join(parts)
