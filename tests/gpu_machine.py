"""What the GPU tests need to know about this machine: whether nvcc is there (CI claims
the nvcc tests, so there a missing toolkit fails them) and the CUDA target of its GPU
(None without one: the `test_on_a_gpu_*` tests run on a GPU machine only)."""

from __future__ import annotations

import os

import pytest

from tunefarm import cuda

needs_nvcc = pytest.mark.skipif(
    cuda.nvcc_path() is None and not os.environ.get("CI"), reason="nvcc (the CUDA toolkit) is not installed"
)


def local_gpu_target() -> dict | None:
    """The CUDA target of this machine's GPU, None without one."""
    try:
        dev = cuda.cuda_device()
    except cuda.NoGpuError:
        return None
    major, minor = str(dev.compute_version).split(".")[:2]
    return {"kind": "cuda", "arch": f"sm_{major}{minor}"}


LOCAL_GPU = local_gpu_target()
