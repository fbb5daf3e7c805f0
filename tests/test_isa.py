"""x86 ISA device classes and cost-model transfer, without the farm: the extensions a
target's code uses (from LLVM) against a CPU's flags (from the OS), which classes an agent
serves, which targets this host runs, and which class a new class's model starts from.

The farm end to end (two x86 classes tuned side by side): test_farm_isa.py.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from services.agent import capabilities
from tunefarm import isa
from tunefarm.errors import TargetError
from tunefarm.search.cost_model import transfer

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
X86_64_V2 = {"kind": "llvm", "mcpu": "x86-64-v2", "num-cores": 2}
SKYLAKE_AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}
ZNVER2 = {"kind": "llvm", "mcpu": "znver2", "num-cores": 8}
CORTEX_A72 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "num-cores": 2}
CUDA = {"kind": "cuda", "arch": "sm_80"}

# /proc/cpuinfo flags of an AVX2 machine without AVX-512 (a first-generation EPYC), and of
# an AVX-512 one (a Skylake server), as Linux spells them.
ZEN1_FLAGS = (
    "fpu cx8 cmov mmx fxsr sse sse2 lm nopl pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes "
    "xsave avx f16c rdrand lahf_lm abm sse4a 3dnowprefetch bmi1 avx2 bmi2 adx sha_ni"
).split()
SKYLAKE_FLAGS = [*ZEN1_FLAGS, "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"]

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 host")


def test_a_targets_extensions_come_from_llvm_without_tuning_properties():
    haswell, v2 = isa.target_isa(HASWELL), isa.target_isa(X86_64_V2)
    assert haswell.family == v2.family == "x86"
    assert {"avx", "avx2", "fma", "sse4.2", "bmi2"} <= haswell.extensions
    assert "sse4.2" in v2.extensions and not {"avx", "avx2", "fma"} & v2.extensions
    assert v2.extensions < haswell.extensions  # an older ISA is a subset
    assert {"avx512f", "avx512bw", "avx512vl"} <= isa.target_isa(SKYLAKE_AVX512).extensions
    # LLVM lists tuning properties and system instructions too; they are not extensions here
    assert not {f for f in haswell.extensions if f.startswith(("fast-", "slow-", "false-deps"))}
    assert "invpcid" not in haswell.extensions
    assert isa.target_isa({"kind": "llvm", "mcpu": "haswell", "mattr": ["-avx2"]}).extensions == haswell.extensions - {"avx2"}
    assert isa.target_isa(CORTEX_A72) == isa.TargetISA("arm", frozenset({"neon"}))
    assert isa.target_isa(CUDA) == isa.TargetISA("", frozenset())


def test_a_targets_vector_width_follows_its_widest_float_extension():
    assert isa.target_isa(SKYLAKE_AVX512).vector_bytes == 64
    assert isa.target_isa(HASWELL).vector_bytes == 32
    assert isa.target_isa(X86_64_V2).vector_bytes == 16
    assert isa.target_isa(CORTEX_A72).vector_bytes == 16
    assert isa.target_isa(CUDA).vector_bytes == 0


def test_a_targets_vector_register_count_follows_the_same_extension():
    assert isa.target_isa(SKYLAKE_AVX512).vector_registers == 32  # zmm0-31
    assert isa.target_isa(HASWELL).vector_registers == 16  # ymm0-15
    assert isa.target_isa(CORTEX_A72).vector_registers == 32  # v0-v31
    assert isa.target_isa(CUDA).vector_registers == 0


def test_missing_extensions_compare_llvm_names_with_the_oss_flags():
    haswell, v2, skx = (isa.target_isa(t) for t in (HASWELL, X86_64_V2, SKYLAKE_AVX512))
    assert isa.missing_extensions(haswell, ZEN1_FLAGS) == []
    assert isa.missing_extensions(v2, ZEN1_FLAGS) == []
    assert isa.missing_extensions(skx, ZEN1_FLAGS) == ["avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"]
    assert isa.missing_extensions(skx, SKYLAKE_FLAGS) == []  # an AVX-512 machine runs all three
    assert isa.missing_extensions(haswell, [f for f in ZEN1_FLAGS if f != "fma"]) == ["fma"]
    assert isa.missing_extensions(isa.target_isa(CORTEX_A72), ["fp", "asimd"]) == []
    assert isa.missing_extensions(isa.target_isa(CORTEX_A72), ["fp"]) == ["neon"]


def test_cpuinfo_flags_are_read_from_the_flags_or_features_line():
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2\nbugs\t\t: sysret_ss_attrs\n"
    assert isa.cpuinfo_flags(text) == {"fpu", "sse", "avx2"}
    assert isa.cpuinfo_flags("Features\t: fp asimd\n") == {"fp", "asimd"}
    assert isa.cpuinfo_flags("") == frozenset()


def test_this_host_runs_what_its_cpu_has_and_names_what_it_lacks():
    flags = isa.host_flags()
    assert isa.runs_on_host(X86_64_V2)
    assert not isa.runs_on_host(CORTEX_A72)
    with pytest.raises(TargetError, match="builds for arm; this machine is x86"):
        isa.check_runs_on_host(CORTEX_A72)
    if "avx512f" in flags:
        assert isa.runs_on_host(SKYLAKE_AVX512)
    else:
        assert not isa.runs_on_host(SKYLAKE_AVX512)
        with pytest.raises(TargetError, match=r"cannot run code built for --target \(it lacks .*avx512f"):
            isa.check_runs_on_host(SKYLAKE_AVX512, "--target")


def test_an_agent_refuses_a_class_whose_extensions_its_cpu_lacks():
    skx = json.dumps(SKYLAKE_AVX512)
    for target in (HASWELL, X86_64_V2):  # one machine serves both classes
        assert capabilities.class_missing_extensions(json.dumps(target), ZEN1_FLAGS) == []
    assert capabilities.class_missing_extensions(skx, SKYLAKE_FLAGS) == []
    missing = capabilities.class_missing_extensions(skx, ZEN1_FLAGS)
    assert missing == ["avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"]
    assert capabilities.isa_refusal("skx", skx, missing, "AMD EPYC") == (
        "device class 'skx' (skylake-avx512) builds code using avx512bw, avx512cd, avx512dq, avx512f, "
        "avx512vl, which this machine's CPU (AMD EPYC) lacks"
    )
    assert capabilities.class_missing_extensions(skx, []) is None  # no flags reported: cannot tell
    # the agent asks in a child process when it has not imported TVM itself
    code = (
        "import json, sys; from services.agent import capabilities as c; "
        "print(json.dumps(c.class_missing_extensions(sys.argv[1], sys.argv[2].split()))); "
        "print('tvm' in sys.modules)"
    )
    ran = subprocess.run([sys.executable, "-c", code, skx, " ".join(ZEN1_FLAGS)], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    answer, imported = ran.stdout.splitlines()[-2:]
    assert json.loads(answer) == missing and imported == "False"


def test_the_nearest_class_is_of_the_same_kind_then_family_then_isa_overlap():
    candidates = [("v2", X86_64_V2), ("skx", SKYLAKE_AVX512), ("zen2", ZNVER2), ("a72", CORTEX_A72), ("gpu", CUDA)]
    assert transfer.nearest(HASWELL, candidates).name == "zen2"  # AVX2 too, despite 8 cores
    assert transfer.nearest(HASWELL, [("v2", X86_64_V2), ("a72", CORTEX_A72), ("gpu", CUDA)]).name == "v2"
    assert transfer.nearest(HASWELL, [("a72", CORTEX_A72), ("gpu", CUDA)]).name == "a72"  # another family last
    assert transfer.nearest(CUDA, [("v2", X86_64_V2)]) is None  # never across kinds
    assert transfer.nearest(HASWELL, []) is None
    # the same ISA: the closer core count, then the name
    four, eight = {**HASWELL, "num-cores": 4}, {**HASWELL, "num-cores": 8}
    assert transfer.nearest(HASWELL, [("b8", eight), ("c4", four)]).name == "c4"
    assert transfer.nearest(HASWELL, [("b", four), ("a", four)]).name == "a"
    choice = transfer.nearest(X86_64_V2, [("haswell", HASWELL)])
    assert choice.similarity.same_family and 0 < choice.similarity.isa_overlap < 1


def test_a_class_without_a_model_starts_from_its_nearest_classs_latest_version(db_sessions, tmp_path):
    import numpy as np

    from services.db import cost_models, device_classes
    from services.db.session import transaction
    from services.scheduler.shared_model import ClassModels
    from tunefarm.search.cost_model import XGBConfig, XGBCostModel
    from tunefarm.search.features import CPU_FEATURE_VERSION as FEATURE_VERSION

    rng = np.random.default_rng(0)

    def programs(n: int) -> tuple[list, list, list]:
        feats = [rng.random((2, 8), dtype=np.float32) for _ in range(n)]
        return feats, [float(f.sum()) for f in feats], ["task"] * n

    ids = {}
    with transaction(db_sessions) as s:
        for name, target in (("t-haswell", HASWELL), ("t-v2", X86_64_V2), ("t-v3", {**HASWELL, "mcpu": "x86-64-v3"}),
                             ("t-gpu", CUDA), ("t-gpu-new", {**CUDA, "arch": "sm_90"})):  # fmt: skip
            ids[name] = device_classes.ensure_device_class(s, name=name, target=target).id
    versions = {}
    for name, n in (("t-haswell", 40), ("t-haswell", 50), ("t-v2", 30)):  # haswell: two versions
        model = XGBCostModel(XGBConfig(num_warmup_samples=4, adaptive_training=False))
        model.update(*programs(n))
        path = tmp_path / f"{name}-{n}.npz"
        model.save(path)
        with transaction(db_sessions) as s:
            versions[name] = cost_models.add_cost_model_version(
                s, device_class_id=ids[name], feature_version=FEATURE_VERSION, path=path.name, sha256="0" * 64,
                size=1, trained_on=n, last_measurement_id=None,
            )  # fmt: skip
    with transaction(db_sessions) as s:
        latest = {dc.name: v.version for dc, v in cost_models.latest_cost_models_of_classes(s, feature_version=FEATURE_VERSION)}
    assert latest == {"t-haswell": 2, "t-v2": 1}

    models = ClassModels(db_sessions, tmp_path, warmup=4, save_every=1000, catch_up_secs=60)
    shared = models.get(ids["t-v3"])  # x86-64-v3 (AVX2) is nearer to haswell than to x86-64-v2
    assert shared.transferred_from.device_class == "t-haswell" and shared.transferred_from.version == 2
    assert shared.start_version_id == versions["t-haswell"].id and shared.version_id is None
    assert shared.model.num_prior == shared.model.num_samples == 50 and shared.unsaved == 0
    assert ClassModels(db_sessions, tmp_path, warmup=4, save_every=1000, catch_up_secs=60, transfer=False).get(
        ids["t-v3"]
    ).transferred_from is None  # transfer off: a fresh model
    assert models.get(ids["t-gpu-new"]).transferred_from is None  # no other cuda class has a model

    shared.model.update(*programs(10))  # its own measurements: the saved version names its origin
    assert models.save(shared) == 1
    with transaction(db_sessions) as s:
        saved = cost_models.latest_cost_model_version(s, device_class_id=ids["t-v3"])
        assert saved.transferred_from_id == versions["t-haswell"].id and saved.trained_on == 60
    again = ClassModels(db_sessions, tmp_path, warmup=4, save_every=1000, catch_up_secs=60).get(ids["t-v3"])
    assert again.version == 1 and again.transferred_from.device_class == "t-haswell"
    assert again.model.num_prior == 50 and again.start_version_id == saved.id


def test_the_transfer_bench_counts_trials_to_reach_the_cold_runs_final_latency(capsys):
    import math

    from tunefarm_app.bench.cold_warm import trials_to_reach
    from tunefarm_app.bench.transfer import compare
    from tunefarm_app.cli import main as cli

    assert trials_to_reach([5.0, 3.0, 2.0], 3.0) == 2 and trials_to_reach([5.0], 3.0) is None
    cold = [9.0, math.inf, 4.0, 3.0, 2.0, 2.5]
    row = compare("w", 1, 6, [1.0], cold, [2.02, 3.0, 1.0, 9.0, 9.0, 9.0], tolerance=0.02)
    assert (row.cold_best, row.cold_trials, row.warm_trials, row.warm_best) == (2.0, 5, 1, 1.0)
    assert row.ratio == 0.2
    slow = compare("w", 1, 6, [1.0], cold, [9.0] * 6, tolerance=0.0)
    assert slow.warm_trials is None and slow.ratio == 7 / 5  # never reached: counted as budget + 1
    if "avx512f" not in isa.host_flags():  # a target this machine cannot run is refused, in one line
        assert cli(["bench", "transfer", "--dest", json.dumps(SKYLAKE_AVX512), "--trials", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--dest" in err[0] and "avx512f" in err[0]
