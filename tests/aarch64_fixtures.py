"""The emulated aarch64 machine the ARM tests run on, and what they check built files with.

`make aarch64-root` (deploy/aarch64-root.sh) installs the aarch64 cross compiler and
qemu-user, registers qemu-aarch64 with binfmt_misc and builds an arm64 Debian root with
the agent's packages at TUNEFARM_AARCH64_ROOT (default /var/cache/tunefarm/aarch64-root).
A program of the root runs as `QEMU_LD_PREFIX=<root> <root>/usr/bin/python3 ...`
(`emulated_python`, `emulated_env`); its children run emulated too.

- `aarch64_root` (fixture): the root's path once it runs an aarch64 python; otherwise
  the test fails under CI=true (CI runs `make aarch64-root` first) and skips elsewhere;
- `require_cross_compiler()`: the same for aarch64-linux-gnu-g++;
- `elf_machine(path)`: the ELF header's e_machine (`ELF_MACHINE_AARCH64` = 0xB7).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from farm_fixtures import service_unavailable

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path("/var/cache/tunefarm/aarch64-root")
ELF_MACHINE_AARCH64 = 0xB7
ELF_MACHINE_X86_64 = 0x3E


def aarch64_root_path() -> Path:
    return Path(os.environ.get("TUNEFARM_AARCH64_ROOT") or DEFAULT_ROOT)


def emulated_python(root: Path) -> list[str]:
    """The root's python (an aarch64 program, run by qemu through binfmt_misc)."""
    return [str(root / "usr" / "bin" / "python3")]


def emulated_env(root: Path, *, cpu: str | None = None) -> dict[str, str]:
    """What a program of the root needs besides the caller's environment: qemu's file
    prefix, the CPU qemu emulates (`qemu-aarch64 -cpu help`; default its "max"), and this
    checkout on the path (the agent runs from it)."""
    env = {"QEMU_LD_PREFIX": str(root), "PYTHONPATH": str(REPO)}
    if cpu:
        env["QEMU_CPU"] = cpu
    return env


@pytest.fixture(scope="session")
def aarch64_root() -> Path:
    root = aarch64_root_path()
    python = emulated_python(root)[0]
    if not (root / ".tunefarm-wheels").is_file() or not os.path.exists(python):
        service_unavailable(f"no aarch64 root at {root}: run `make aarch64-root`")
    try:
        out = subprocess.run(
            [python, "-c", "import platform; print(platform.machine())"],
            env={**os.environ, **emulated_env(root)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as exc:  # ENOEXEC: qemu-aarch64 is not registered with binfmt_misc
        service_unavailable(f"{python} does not run ({exc}): run `make aarch64-root`")
    if out.stdout.strip() != "aarch64":
        service_unavailable(f"{python} does not run as aarch64 ({out.stdout!r} {out.stderr[-300:]!r})")
    return root


def require_cross_compiler() -> None:
    if shutil.which("aarch64-linux-gnu-g++") is None:
        service_unavailable("aarch64-linux-gnu-g++ is not installed: run `make aarch64-root`")


def elf_machine(path: str | os.PathLike[str]) -> int:
    """e_machine of an ELF file (0 when the file is not ELF)."""
    with open(path, "rb") as f:
        header = f.read(20)
    if header[:4] != b"\x7fELF" or len(header) < 20:
        return 0
    order = "<" if header[5] == 1 else ">"
    return struct.unpack(order + "H", header[18:20])[0]
