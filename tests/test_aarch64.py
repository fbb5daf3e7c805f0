"""ARM (aarch64) device classes, without the farm: what an agent detects and reports
(HWCAP features, emulation, its target), which agents a class accepts, and what the
build side makes for a board (aarch64 shared libraries, checked by their ELF header).

The farm end to end, with the agent under emulation: test_farm_aarch64.py.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess

import pytest
from aarch64_fixtures import (
    ELF_MACHINE_AARCH64,
    aarch64_root,  # noqa: F401 (fixture)
    elf_machine,
    emulated_env,
    emulated_python,
    require_cross_compiler,
)

from services.agent import capabilities
from services.lease.servicer import _check_compatible
from services.protocol.errors import BadRequest
from tunefarm.errors import TargetError
from tunefarm.records import ErrorKind, MeasureRecord

AARCH64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "mattr": ["+neon"], "num-cores": 2}

X86_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2\n"
ARM_CPUINFO = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\n"


# -- what an agent reports --------------------------------------------------------------------


def test_hwcap_bits_name_the_kernels_features():
    hwcap = 1 << 0 | 1 << 1 | 1 << 20 | 1 << 22  # fp, asimd (NEON), asimddp (dot product), sve
    hwcap2 = 1 << 1 | 1 << 13  # sve2, i8mm
    assert capabilities.hwcap_features(hwcap, hwcap2) == {"fp", "asimd", "asimddp", "sve", "sve2", "i8mm"}
    assert capabilities.hwcap_features(0, 0) == set()


def test_emulation_is_told_from_the_kernels_view_of_the_machine():
    assert capabilities.emulation("aarch64", "x86_64", "")  # qemu-user on an x86 host
    assert capabilities.emulation("aarch64", "", X86_CPUINFO)  # no kernel.arch: cpuinfo tells
    assert capabilities.emulation("aarch64", "aarch64", ARM_CPUINFO) == ""  # a board
    assert capabilities.emulation("armv7l", "aarch64", "") == ""  # 32-bit code on a 64-bit ARM kernel
    assert capabilities.emulation("x86_64", "x86_64", X86_CPUINFO) == ""
    assert capabilities.emulation("aarch64", "", "") == ""  # nothing says so


def test_an_agent_reports_its_triple_and_the_llvm_features_of_its_cpu():
    host = {"kind": "llvm", "mcpu": "generic", "num-cores": 4}
    got = capabilities.agent_target(host, "aarch64", {"fp", "asimd", "asimddp", "sve", "sha2"})
    if platform.system() == "Linux":
        assert got["mtriple"] == "aarch64-linux-gnu"
    assert got["mattr"] == ["+dotprod", "+neon", "+sve"]
    assert got["mcpu"] == "generic" and got["num-cores"] == 4
    assert "mattr" not in capabilities.agent_target(host, "x86_64", {"avx2"})


def test_an_aarch64_class_takes_only_aarch64_agents():
    _check_compatible("arm", AARCH64, {"arch": "aarch64"})
    _check_compatible("arm", AARCH64, {"arch": "arm64"})
    with pytest.raises(BadRequest, match="builds for aarch64; this agent is x86_64"):
        _check_compatible("arm", AARCH64, {"arch": "x86_64"})
    # A class without a triple is built for the build workers' (this host's) architecture.
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    with pytest.raises(BadRequest, match=f"this agent is {other}"):
        _check_compatible("host", {"kind": "llvm", "mcpu": "generic"}, {"arch": other})


def test_an_emulated_record_says_so_and_reads_back():
    record = MeasureRecord(
        task="t#1@h", workload="t", target=AARCH64, sketch=0, sketch_sig="s", decisions=(), trace=[],
        costs=(0.5,), error_kind=ErrorKind.NONE, error_msg="", build_secs=0.1, run_secs=0.2,
        verified=True, timestamp=1.0, emulated=True,
    )  # fmt: skip
    line = record.to_json()
    assert json.loads(line)["emulated"] is True
    assert MeasureRecord.from_json(line) == record
    native = MeasureRecord.from_json(line.replace(',"emulated":true', ""))
    assert native.emulated is False and "emulated" not in native.to_json()


def test_the_agent_under_emulation_detects_an_emulated_aarch64_cpu(aarch64_root):  # noqa: F811
    """The real detection code in the aarch64 root: the emulated CPU's features (qemu's
    cortex-a72 has NEON but neither SVE nor the dot product; its "max" CPU has both)."""
    code = (
        "import json; from services.agent import capabilities as c; "
        "print(json.dumps(c.detect(probe=False)))"
    )
    seen = {}
    for cpu in ("cortex-a72", "max"):
        out = subprocess.run(
            [*emulated_python(aarch64_root), "-c", code],
            env={**os.environ, **emulated_env(aarch64_root, cpu=cpu)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seen[cpu] = json.loads(out.stdout.strip().splitlines()[-1])
    a72, most = seen["cortex-a72"], seen["max"]
    for caps in (a72, most):
        assert caps["arch"] == "aarch64" and caps["emulated"] is True and caps["emulation"]
        assert caps["logical_cores"] == os.cpu_count() and caps["physical_cores"] >= 1
        assert "emulated aarch64" in caps["cpu_model"]
    assert "asimd" in a72["isa_features"] and not {"sve", "asimddp"} & set(a72["isa_features"])
    assert {"asimd", "asimddp", "sve"} <= set(most["isa_features"])


# -- what is built for a board ----------------------------------------------------------------


def test_kernels_are_cross_compiled_to_aarch64_libraries(tmp_path):
    """(A whole model for an aarch64 class is built and checked the same way, end to end,
    in test_farm_aarch64.py.)"""
    import tvm

    from tunefarm.measure.builder import build_module
    from tunefarm.workloads.registry import make

    require_cross_compiler()
    wl = make("matmul", {"M": 16, "N": 16, "K": 16})
    (tmp_path / "wl.json").write_text(tvm.ir.save_json(wl.mod))
    build_module(str(tmp_path / "wl.json"), None, AARCH64, str(tmp_path / "k.so"))
    assert elf_machine(tmp_path / "k.so") == ELF_MACHINE_AARCH64
    assert elf_machine(tmp_path / "wl.json") == 0


def test_without_a_cross_compiler_a_kernel_is_a_tar_and_a_library_an_error(tmp_path, monkeypatch):
    import tvm

    from tunefarm import export
    from tunefarm.workloads.registry import make

    monkeypatch.setattr(export.shutil, "which", lambda name: None)
    assert export.artifact_suffix(AARCH64) == ".tar"
    assert export.artifact_suffix({"kind": "llvm"}) == ".so"
    ex = tvm.compile(make("matmul", {"M": 8, "N": 8, "K": 8}).mod, target=tvm.target.Target(AARCH64))
    export.export_library(ex, tmp_path / "k.tar", AARCH64)
    assert (tmp_path / "k.tar").stat().st_size > 0
    with pytest.raises(TargetError, match="no C\\+\\+ cross compiler for aarch64-linux-gnu"):
        export.export_library(ex, tmp_path / "k.so", AARCH64)
    assert not list(tmp_path.glob("k.so*"))  # no half-written library left behind
