"""CUDA kernels: built where there is no GPU, run where there is one.

Build (a build worker, no GPU needed): `tvm.compile` for a CUDA target emits the host
code and the kernels' CUDA C source (under `lowering(target)`: on sm_80+ the copies of
software-pipelined shared stages become cp.async); `verify` runs TVM's GPU code verifier on
the lowered kernels against the target's limits; `compile_fatbin` compiles the source with nvcc for
the target's compute capability (SASS for it, and its PTX so that newer GPUs can JIT it);
and `export_kernel` writes one artifact, a tar (`CUDA_KERNEL_SUFFIX`) of:

  kernel.so      TVM's library: host code, the launch table and the CUDA source
  kernel.fatbin  nvcc's binary of that source for the class's arch
  kernel.cu      the source (to read)
  manifest.json  {"arch", "source_sha256", "fatbin_sha256"}

Run (an agent with a GPU): `load_kernel` unpacks it and loads kernel.so. TVM's CUDA
runtime turns a module holding source into a binary by calling the global function
`tvm_callback_cuda_compile`; the agent registers one (`_PrebuiltBinaries`) that hands
back the fatbin built for exactly that source (matched by its sha256) and refuses any
other, so a board never compiles and runs exactly what the worker verified.

Where TVM's CUDA runtime is present (a build worker on a machine with a GPU), `tvm.compile`
itself asks `tvm_callback_cuda_compile` for the binary and embeds it in kernel.so (TVM's
own callback uses NVRTC); `use_nvcc` makes that callback `compile_fatbin` too, so that
every kernel runs nvcc's binary with the same flags, wherever it was built. The last
binaries are kept by source, so export reuses the one the compile made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tunefarm.errors import TargetError
from tunefarm.gpu import GpuLimits, compute_capability, gpu_compatible

CUDA_KERNEL_SUFFIX = ".cuda.tar"
"""How a kernel built for a CUDA target is stored (see the module docstring)."""

NVCC_TIMEOUT_SECS = 120.0


class CudaBuildError(Exception):
    """The kernel fails the GPU verifier, or nvcc rejects its source."""


class NoGpuError(Exception):
    """A CUDA kernel was to run on a machine without a usable CUDA GPU."""


def tvm_target(target: dict[str, Any]):
    """The TVM Target of a CUDA target dict, with this machine's LLVM as host."""
    import tvm

    host = target.get("host") or {"kind": "llvm"}
    return tvm.target.Target({k: v for k, v in target.items() if k != "host"}, host=host)


CUDA_GRAPH_CONFIG = {"relax.backend.use_cuda_graph": True}
"""The Relax build option that captures a model's kernels into CUDA graphs: the stretch
of kernels that work on the model's statically planned buffers (everything between the
kernels that read the inputs and write the outputs) is captured at the first call and
replayed as one graph launch after it (`RewriteCUDAGraph`; TVM's runtime
`vm.builtin.cuda_graph.run_or_capture`), where the launches of many small kernels would
otherwise dominate."""


def lowering_config(target: dict[str, Any]) -> dict[str, Any]:
    """TVM's lowering options for a CUDA target's kernels: on sm_80+ the copies into
    shared memory that a software pipeline marks asynchronous become cp.async
    (`tirx.use_async_copy`: InjectPTXAsyncCopy); without the option they would stay
    plain stores. Kernels with no pipeline lower as without it."""
    return {"tirx.use_async_copy": True} if GpuLimits.of(target).async_copy else {}


@contextlib.contextmanager
def lowering(target: dict[str, Any], extra_config: Mapping[str, Any] | None = None) -> Iterator[None]:
    """TVM's pass context for compiling or lowering `target`'s kernels: the current one
    with `lowering_config(target)` added, and `extra_config` (a whole model's build
    options, e.g. `CUDA_GRAPH_CONFIG`)."""
    import tvm

    extra = {**lowering_config(target), **(extra_config or {})}
    if not extra:
        yield
        return
    current = tvm.transform.PassContext.current()
    config = {str(k): v for k, v in current.config.items()}
    with tvm.transform.PassContext(
        opt_level=current.opt_level,
        required_pass=list(current.required_pass),
        disabled_pass=list(current.disabled_pass),
        instruments=list(current.instruments),
        config={**config, **extra},
    ):
        yield


def verify(mod: Any, target: dict[str, Any]) -> list[str]:
    """TVM's GPU code verifier (`tvm.s_tir.analysis.verify_gpu_code`) on every kernel of
    the scheduled module, lowered for `target`: the names of the kernels that exceed the
    GPU's limits (threads, shared and local memory, vthreads, vector width)."""
    import tvm

    limits = GpuLimits.of(target)
    t = tvm_target(target)
    pipeline = tvm.tirx.get_tir_pipeline("default")[0]
    with lowering(target):
        lowered = pipeline(tvm.tirx.transform.BindTarget(t)(mod))
    constraints = limits.verifier_constraints()
    bad = []
    for gv, func in lowered.functions.items():
        ftarget = func.attrs.get("target") if func.attrs is not None else None
        if ftarget is not None and ftarget.kind.name == "cuda":
            if not tvm.s_tir.analysis.verify_gpu_code(func, constraints):
                bad.append(gv.name_hint)
    return bad


def source_of(executable: Any) -> str:
    """The CUDA C source of a compiled module's kernels (a kernel's, or a whole model's:
    there the CUDA module sits below the Relax VM's host library)."""
    pending = list(executable.mod.imports)
    while pending:
        m = pending.pop(0)
        if m.kind == "cuda":
            return str(m.inspect_source("cuda"))
        pending.extend(m.imports)
    raise CudaBuildError("the compiled module has no CUDA kernels (is every loop nest bound to GPU threads?)")


def nvcc_path() -> str | None:
    """nvcc on PATH, or in CUDA_HOME / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    return None


_FATBINS: OrderedDict[tuple[str, str], bytes] = OrderedDict()
"""The last binaries `compile_fatbin` made, by (source sha256, compute capability)."""

_FATBINS_KEPT = 4


def compile_fatbin(source: str, target: dict[str, Any]) -> bytes:
    """nvcc's fatbin of the source for the target's compute capability: its SASS and its
    PTX (which the driver JIT-compiles on a newer GPU). Raises CudaBuildError."""
    major, minor = compute_capability(target)
    key = (_sha256(source.encode()), f"{major}{minor}")
    fatbin = _FATBINS.get(key)
    if fatbin is None:
        fatbin = _nvcc_fatbin(source, key[1])
        _FATBINS[key] = fatbin
        while len(_FATBINS) > _FATBINS_KEPT:
            _FATBINS.popitem(last=False)
    return fatbin


def use_nvcc(target: dict[str, Any]) -> None:
    """Make `compile_fatbin` for `target` the binary `tvm.compile` embeds in this process
    (TVM's CUDA codegen asks the global function `tvm_callback_cuda_compile` for it when
    TVM's CUDA runtime is present)."""
    import tvm_ffi

    tvm_ffi.register_global_func(
        "tvm_callback_cuda_compile", lambda code, *_: compile_fatbin(str(code), target), override=True
    )


def _nvcc_fatbin(source: str, cc: str) -> bytes:
    import subprocess

    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaBuildError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): a CUDA build worker needs the CUDA toolkit")
    with tempfile.TemporaryDirectory(prefix="tunefarm-nvcc-") as tmp:
        src, out = Path(tmp, "kernel.cu"), Path(tmp, "kernel.fatbin")
        src.write_text(source)
        cmd = [
            nvcc, "--fatbin", "-O3", "--use_fast_math", "--expt-relaxed-constexpr",
            "-gencode", f"arch=compute_{cc},code=sm_{cc}", "-gencode", f"arch=compute_{cc},code=compute_{cc}",
            "-o", str(out), str(src),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_SECS)
        except subprocess.TimeoutExpired:
            raise CudaBuildError(f"nvcc took longer than {NVCC_TIMEOUT_SECS:.0f} s") from None
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            raise CudaBuildError(f"nvcc failed for sm_{cc}: {lines[0] if lines else proc.returncode}")
        return out.read_bytes()


def export_kernel(executable: Any, out_path: str | os.PathLike[str], target: dict[str, Any]) -> None:
    """Write a compiled CUDA module as a kernel artifact (see the module docstring),
    under a temporary name, then renamed. Raises CudaBuildError."""
    source = source_of(executable)
    fatbin = compile_fatbin(source, target)
    out_path = Path(out_path)
    with tempfile.TemporaryDirectory(prefix="tunefarm-cuda-") as tmp:
        lib = Path(tmp, "kernel.so")
        executable.export_library(str(lib))
        Path(tmp, "kernel.fatbin").write_bytes(fatbin)
        Path(tmp, "kernel.cu").write_text(source)
        manifest = {
            "arch": str(target.get("arch")),
            "source_sha256": _sha256(source.encode()),
            "fatbin_sha256": _sha256(fatbin),
        }
        Path(tmp, "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        partial = out_path.with_name(f"{out_path.name}.{os.getpid()}.tmp")
        try:
            with tarfile.open(partial, "w") as tar:
                for name in ("manifest.json", "kernel.so", "kernel.fatbin", "kernel.cu"):
                    tar.add(Path(tmp, name), arcname=name)
            os.replace(partial, out_path)
        finally:
            partial.unlink(missing_ok=True)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    with tarfile.open(path) as tar:
        member = tar.extractfile("manifest.json")
        if member is None:
            raise TargetError(f"{path} is not a CUDA kernel artifact (no manifest.json)")
        return json.loads(member.read())


# -- the running side ------------------------------------------------------------------------


class _PrebuiltBinaries:
    """`tvm_callback_cuda_compile` for a machine that runs kernels built elsewhere:
    returns the binary built for exactly the source TVM's runtime asks about."""

    def __init__(self) -> None:
        self.binaries: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.registered = False

    def add(self, source_sha256: str, binary: bytes) -> None:
        with self.lock:
            self.binaries[source_sha256] = binary
            if not self.registered:
                import tvm_ffi

                tvm_ffi.register_global_func("tvm_callback_cuda_compile", self.compile, override=True)
                self.registered = True

    def compile(self, source: str, *_: Any) -> bytes:
        key = _sha256(str(source).encode())
        with self.lock:
            binary = self.binaries.get(key)
        if binary is None:
            raise RuntimeError(
                "a CUDA kernel with no prebuilt binary was loaded (source sha256 "
                f"{key[:12]}): the build worker compiles kernels, the agent does not"
            )
        return binary


PREBUILT = _PrebuiltBinaries()


def cuda_device(index: int = 0) -> Any:
    """TVM's device of the GPU, or NoGpuError saying why there is none."""
    import tvm

    try:
        dev = tvm.cuda(index)
        present = bool(dev.exist)
    except Exception as exc:  # no CUDA runtime in TVM, or no driver
        raise NoGpuError(f"no CUDA GPU on this machine ({type(exc).__name__}: {exc})") from None
    if not present:
        raise NoGpuError("no CUDA GPU on this machine (TVM's CUDA runtime finds no device: no GPU, or no NVIDIA driver)")
    return dev


def describe_gpu(index: int = 0) -> dict[str, Any]:
    """What a result measured on this machine's GPU says of it: its name, compute
    capability and multiprocessor count. Raises NoGpuError."""
    dev = cuda_device(index)
    return {
        "gpu": str(dev.device_name),
        "compute_capability": str(dev.compute_version),
        "multiprocessors": int(dev.multi_processor_count),
    }


def require_local_gpu(target: dict[str, Any]) -> None:
    """TargetError unless this machine has a GPU that runs `target`'s kernels (tuning
    in embedded mode measures on this machine)."""
    try:
        dev = cuda_device()
    except NoGpuError as exc:
        raise TargetError(
            f"{target.get('arch')} kernels are measured on an NVIDIA GPU: {exc}; "
            "tune on a farm with a GPU agent of that class"
        ) from None
    problem = gpu_compatible(target, str(dev.compute_version))
    if problem:
        raise TargetError(f"the target builds for {target.get('arch')}; {problem}")


def load_kernel(path: str | os.PathLike[str], work_dir: str | os.PathLike[str]) -> Any:
    """Load a CUDA kernel artifact (on a machine with a GPU): unpack it into a directory
    of `work_dir` named by the artifact's content, give TVM's runtime its prebuilt binary,
    load kernel.so. Raises NoGpuError first when there is no GPU.

    An artifact already unpacked there is not unpacked again: rewriting a kernel.so this
    process has loaded would change the pages it runs from (loading one artifact twice,
    as a bench's timing passes do, crashed with SIGSEGV in dlsym)."""
    import tvm

    cuda_device()
    directory = Path(work_dir, _sha256(Path(path).read_bytes())[:16])
    if not directory.is_dir():
        partial = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with tarfile.open(path) as tar:
            tar.extractall(partial, filter="data")
        try:
            os.replace(partial, directory)
        except OSError:  # unpacked by another process meanwhile
            shutil.rmtree(partial, ignore_errors=True)
    manifest = json.loads(Path(directory, "manifest.json").read_text())
    fatbin = Path(directory, "kernel.fatbin").read_bytes()
    if _sha256(fatbin) != manifest["fatbin_sha256"]:
        raise CudaBuildError(f"{path}: kernel.fatbin does not match its manifest")
    PREBUILT.add(manifest["source_sha256"], fatbin)
    return tvm.runtime.load_module(str(Path(directory, "kernel.so")))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
