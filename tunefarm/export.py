"""Writing a compiled module as a library for its target, this machine's or a board's.

A farm's build workers never run what they build, and a board never compiles: a target
whose LLVM `mtriple` names another architecture than this machine's (`is_cross_target`,
e.g. `{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}` on an x86
host) is compiled by TVM's LLVM as usual and then linked with that architecture's C++
cross compiler (`cross_compiler`: `<mtriple>-g++` on PATH, as Debian's
g++-aarch64-linux-gnu installs it), giving a shared library for the board.

`export_library` writes a kernel or a whole model that way (under a temporary name,
then renamed: a reader never loads half a library, and two processes building the same
program do not collide). Without a cross compiler a kernel may still be exported as a
`.tar` of object files, which `tvm.runtime.load_module` links on the board
(`artifact_suffix`); a `.so` for a cross target without one is a `TargetError`.

A kernel for a CUDA target (`tunefarm.gpu.is_gpu`) is a `tunefarm.cuda` artifact: TVM's
library plus nvcc's binary of its kernels for the target's compute capability.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Any

from tunefarm.cuda import CUDA_KERNEL_SUFFIX, export_kernel
from tunefarm.errors import TargetError
from tunefarm.gpu import is_gpu

ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64"}
"""Other names of an architecture, as operating systems and triples spell them."""


def arch_name(name: str) -> str:
    """The canonical name of an architecture ("arm64" -> "aarch64")."""
    return ARCH_ALIASES.get(name, name)


def target_arch(target: dict[str, Any]) -> str:
    """The architecture an LLVM target's `mtriple` names ("" when it has none: the
    building machine's own)."""
    triple = str(target.get("mtriple", ""))
    return arch_name(triple.split("-")[0]) if triple else ""


def is_cross_target(target: dict[str, Any]) -> bool:
    """An LLVM target for another architecture than this machine's (its `mtriple`)."""
    arch = target_arch(target)
    return target.get("kind") == "llvm" and bool(arch) and arch != arch_name(platform.machine())


def cross_compiler(target: dict[str, Any]) -> str | None:
    """The C++ cross compiler on PATH for a cross target (`<mtriple>-g++`, or its
    triple without the vendor part, as Debian names them), or None."""
    triple = str(target.get("mtriple", ""))
    parts = triple.split("-")
    names = [f"{triple}-g++"]
    if len(parts) == 4:  # aarch64-unknown-linux-gnu -> aarch64-linux-gnu
        names.append(f"{parts[0]}-{parts[2]}-{parts[3]}-g++")
    return next((n for n in names if shutil.which(n)), None)


def artifact_suffix(target: dict[str, Any]) -> str:
    """How a built kernel is exported: a shared library (.so), or, for a cross target
    with no cross compiler here, a .tar of object files that the board links at load
    time (`tvm.runtime.load_module` on a .tar); for a CUDA target a `tunefarm.cuda`
    kernel artifact."""
    if is_gpu(target):
        return CUDA_KERNEL_SUFFIX
    if is_cross_target(target) and cross_compiler(target) is None:
        return ".tar"
    return ".so"


def export_library(executable: Any, out_path: str | os.PathLike[str], target: dict[str, Any]) -> None:
    """Export a compiled module (`tvm.compile`'s result) to `out_path` for `target`:
    linked by the cross compiler for a cross target, by the host's otherwise. Raises
    `TargetError` for a cross `.so` without a cross compiler; TVM's errors otherwise."""
    out_path = str(out_path)
    if out_path.endswith(CUDA_KERNEL_SUFFIX):
        export_kernel(executable, out_path, target)
        return
    suffix = Path(out_path).suffix or ".so"
    fcompile = None
    if suffix == ".so" and is_cross_target(target):
        compiler = cross_compiler(target)
        if compiler is None:
            raise TargetError(
                f"no C++ cross compiler for {target.get('mtriple')} on PATH (looked for "
                f"{target.get('mtriple')}-g++; Debian: apt-get install g++-{target_arch(target)}-linux-gnu)"
            )
        import tvm

        fcompile = tvm.support.cc.cross_compiler(compiler)
    tmp = f"{out_path}.{os.getpid()}.tmp{suffix}"
    try:
        if fcompile is not None:
            executable.export_library(tmp, fcompile=fcompile)
        else:
            executable.export_library(tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
