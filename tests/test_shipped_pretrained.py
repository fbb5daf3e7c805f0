"""The pretrained cost model the package ships for x86, and the measurements it is rebuilt from.

Tests see an empty pretrained directory (conftest), so these read the package's file directly.
A failure of the compatibility test means the features (or TVM's series) changed since the
file was trained: `make pretrained` trains it again from pretraining/x86/ in a few minutes,
with the features recomputed, and no new measurement.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tunefarm.search.cost_model import pretrained
from tunefarm.search.cost_model.pretrain import trained_workloads

SHIPPED = Path(pretrained.__file__).parent / "x86.npz"
MEASUREMENTS = Path(__file__).resolve().parents[1] / "pretraining" / "x86"
X86 = {"kind": "llvm", "mcpu": "rocketlake", "num-cores": 2}
OLDER_X86 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 4}


@pytest.fixture(scope="module")
def base():
    return pretrained.read_pretrained(SHIPPED)


def test_the_shipped_model_is_small_and_says_how_it_was_made(base):
    assert SHIPPED.stat().st_size <= 20 * 2**20
    info = base.info
    assert info["family"] == "x86" and info["objective"] in ("rank", "squared")
    assert info["programs"] >= 1000 and info["tasks"] >= 50
    # several ISA classes: the device descriptor only tells classes apart if it varied in training
    assert len(info["classes"]) >= 3 and len({json.dumps(t, sort_keys=True) for t in info["class_targets"].values()}) >= 3
    assert "pretrain" in info["provenance"]["command"]
    assert trained_workloads(info), "the file must list the workloads it learnt, so evaluations can hold others out"


@pytest.mark.parametrize("target", [X86, OLDER_X86], ids=["rocketlake", "haswell"])
def test_the_shipped_model_fits_this_installation_and_any_x86_class(base, target):
    assert pretrained.incompatibility(base, target) is None
    model, note = pretrained.load_pretrained(target, path=SHIPPED)
    assert model is not None and model.ranks, note


def test_the_kept_measurements_are_the_ones_it_was_trained_on(base):
    """Every workload of the kept records is one the model learnt, and the other way round,
    so `make pretrained` rebuilds this model and not another."""
    names = set()
    for path in sorted(MEASUREMENTS.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            names |= {json.loads(line)["workload"] for line in f if line.strip()}
        assert path.with_name(path.name.replace(".jsonl.gz", ".jsonl.workloads.gz")).is_file()
    assert names == set(base.info["workload_names"])
