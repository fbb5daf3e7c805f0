"""A model's kernels run as CUDA graphs (`build_model_library(cuda_graph=True)`): the
build captures the kernels on the model's planned buffers into one graph, the manifest
says so, and a CPU target refuses the option. On a GPU machine, the graph build gives
the plain build's outputs call after call, with inputs that change between calls (a
graph replays the captured launches: a kernel that read a stale input would show)."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest
from gpu_machine import LOCAL_GPU, needs_nvcc
from onnx_models import gpu_mix_onnx

from tunefarm.errors import ModelError

SM90 = {"kind": "cuda", "arch": "sm_90"}
CAPTURE = b"vm.builtin.cuda_graph.run_or_capture"


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    from tunefarm.models.finish import load_model

    path = gpu_mix_onnx(tmp_path_factory.mktemp("mix") / "mix.onnx")
    return load_model(path, {"x": [1, 3, 8, 8]}, name="mix")


def _build(mix, directory, target, cuda_graph):
    from tunefarm.models.build import build_model_library

    return build_model_library(mix.tasks.fused_mod, directory, target=target, inputs=mix.imported.inputs,
                               outputs=mix.imported.outputs, cuda_graph=cuda_graph)  # fmt: skip


def _vm_code(library) -> bytes:
    with tarfile.open(library) as tar:
        return tar.extractfile("kernel.so").read()


@needs_nvcc
def test_a_cuda_graph_build_captures_the_kernels_and_its_manifest_says_so(mix, tmp_path):
    plain = _build(mix, tmp_path / "plain", SM90, cuda_graph=False)
    graphs = _build(mix, tmp_path / "graphs", SM90, cuda_graph=True)
    assert CAPTURE in _vm_code(graphs.library) and CAPTURE not in _vm_code(plain.library)
    assert json.loads(graphs.manifest.read_text())["cuda_graph"] is True
    assert "cuda_graph" not in json.loads(plain.manifest.read_text())


def test_cuda_graphs_on_a_cpu_target_are_refused(mix, tmp_path):
    from tunefarm.target import host_target_dict

    with pytest.raises(ModelError, match="CUDA graphs are for CUDA targets"):
        _build(mix, tmp_path / "cpu", host_target_dict(), cuda_graph=True)
    assert not (tmp_path / "cpu").exists()



@needs_nvcc
@pytest.mark.skipif(LOCAL_GPU is None, reason="no CUDA GPU on this machine (these run on a GPU machine)")
def test_on_a_gpu_the_graph_build_matches_the_plain_build_as_inputs_change(mix, tmp_path):
    import tvm
    from tvm import relax

    def load(built):
        directory = built.directory / "unpacked"
        with tarfile.open(built.library) as tar:
            tar.extractall(directory, filter="data")
        return relax.VirtualMachine(tvm.runtime.load_module(str(directory / "kernel.so")), tvm.cuda())

    plain = load(_build(mix, tmp_path / "plain", LOCAL_GPU, cuda_graph=False))
    graphs = load(_build(mix, tmp_path / "graphs", LOCAL_GPU, cuda_graph=True))
    rng = np.random.default_rng(0)
    for _ in range(4):  # the first call captures, the others replay
        x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
        want = plain["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
        got = graphs["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
