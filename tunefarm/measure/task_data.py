"""Task data: the input arrays of a workload, and its reference outputs, in one .npz file.

Every candidate of a task runs on the same task data, so the runner can check each
kernel's output against the reference and the timings see the same values.

Layout of the .npz (plain arrays only; it loads with ``allow_pickle=False``)::

    task_data_version   0-d int64, TASK_DATA_VERSION
    input_{i}           i-th input of the kernel, i = 0 .. n_inputs-1
    output_shape_{k}    1-d int64: the shape of output k, k = 0 .. n_outputs-1
    output_dtype_{k}    0-d str: the dtype of output k ("float32", ...)
    expected_{k}        the reference value of output k (optional, all or none)

Reference outputs come from the workload's numpy reference when it has one. Workloads
without one get theirs from the unscheduled program: run it once with
`RunInput.save_outputs` set, then fold that file in with `add_expected_from`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tunefarm.errors import WorkloadError
from tunefarm.workloads.base import Workload

TASK_DATA_VERSION = 1
"""Version of the .npz layout described in the module docstring."""

INT_INPUT_HIGH = 8
"""Integer inputs are drawn from [0, INT_INPUT_HIGH): small enough not to overflow sums."""


@dataclass(frozen=True)
class TaskData:
    """The content of a task data file."""

    inputs: tuple[np.ndarray, ...]
    output_specs: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each output
    expected: tuple[np.ndarray, ...] | None  # reference outputs, None when the file has none


def write_task_data(
    path: str | os.PathLike[str], workload: Workload, *, seed: int = 0, with_expected: bool = True
) -> str:
    """Write deterministic inputs for `workload` (and, when it has a reference and
    `with_expected`, its expected outputs) to `path`. Returns the path as a str.

    Floats are uniform in [-1, 1), integers uniform in [0, INT_INPUT_HIGH), booleans
    fair coins, all from one generator seeded with `seed`, in input order.
    """
    rng = np.random.default_rng(seed)
    inputs = [_random_array(rng, spec.shape, spec.dtype, spec.name) for spec in workload.inputs]
    arrays: dict[str, np.ndarray] = {"task_data_version": np.asarray(TASK_DATA_VERSION, dtype=np.int64)}
    arrays.update({f"input_{i}": a for i, a in enumerate(inputs)})
    for k, spec in enumerate(workload.outputs):
        arrays[f"output_shape_{k}"] = np.asarray(spec.shape, dtype=np.int64)
        arrays[f"output_dtype_{k}"] = np.asarray(str(spec.dtype))
    if with_expected and workload.reference is not None:
        outputs = workload.reference(*inputs)
        if isinstance(outputs, np.ndarray):
            outputs = [outputs]
        if len(outputs) != len(workload.outputs):
            raise WorkloadError(
                f"{workload.name}: the reference returned {len(outputs)} arrays, "
                f"the workload has {len(workload.outputs)} outputs"
            )
        for k, (out, spec) in enumerate(zip(outputs, workload.outputs, strict=True)):
            out = np.asarray(out)
            if tuple(out.shape) != tuple(spec.shape):
                raise WorkloadError(
                    f"{workload.name}: the reference's output {k} has shape {out.shape}, expected {spec.shape}"
                )
            arrays[f"expected_{k}"] = out.astype(spec.dtype, copy=False)
    _save_npz(path, arrays)
    return str(path)


def read_task_data(path: str | os.PathLike[str]) -> TaskData:
    """Read a task data file (any version-1 layout, including hand-written ones without
    output_shape_k when expected_k gives the shape)."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    version = int(arrays.get("task_data_version", TASK_DATA_VERSION))
    if version != TASK_DATA_VERSION:
        raise ValueError(f"{path}: task data version {version}, this code reads {TASK_DATA_VERSION}")
    inputs = tuple(arrays[f"input_{i}"] for i in range(_count(arrays, "input_")))
    n_outputs = max(_count(arrays, "output_shape_"), _count(arrays, "expected_"))
    n_expected = _count(arrays, "expected_")
    expected = tuple(arrays[f"expected_{k}"] for k in range(n_expected)) if n_expected else None
    if expected is not None and n_expected != n_outputs:
        raise ValueError(f"{path}: {n_expected} expected outputs for {n_outputs} outputs")
    specs = []
    for k in range(n_outputs):
        if f"output_shape_{k}" in arrays:
            shape = tuple(int(s) for s in arrays[f"output_shape_{k}"])
            dtype = str(arrays[f"output_dtype_{k}"])
        else:
            shape, dtype = tuple(arrays[f"expected_{k}"].shape), str(arrays[f"expected_{k}"].dtype)
        specs.append((shape, dtype))
    return TaskData(inputs, tuple(specs), expected)


def add_expected_from(path: str | os.PathLike[str], outputs_npz: str | os.PathLike[str]) -> None:
    """Store the outputs a run saved (`RunInput.save_outputs`, keys output_k) as the
    expected outputs of the task data file `path`, replacing any it had."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files if not name.startswith("expected_")}
    specs = read_task_data(path).output_specs
    with np.load(outputs_npz, allow_pickle=False) as npz:
        saved = {name: npz[name] for name in npz.files}
    for k, (shape, dtype) in enumerate(specs):
        out = saved.get(f"output_{k}")
        if out is None:
            raise ValueError(f"{outputs_npz}: no output_{k}")
        if tuple(out.shape) != shape or str(out.dtype) != dtype:
            raise ValueError(
                f"{outputs_npz}: output_{k} is {out.dtype}{list(out.shape)}, expected {dtype}{list(shape)}"
            )
        arrays[f"expected_{k}"] = out
    _save_npz(path, arrays)


def save_outputs(path: str | os.PathLike[str], outputs: list[np.ndarray]) -> None:
    """Write a kernel's outputs as output_0, output_1, ... (the runner's `save_outputs`)."""
    _save_npz(path, {f"output_{k}": a for k, a in enumerate(outputs)})


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, name: str) -> np.ndarray:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise WorkloadError(f"input {name}: numpy has no dtype {dtype!r}") from None
    if dt.kind == "f":
        return rng.uniform(-1.0, 1.0, shape).astype(dt)
    if dt.kind in "iu":
        return rng.integers(0, INT_INPUT_HIGH, shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    raise WorkloadError(f"input {name}: cannot make random data of dtype {dtype}")


def _count(arrays: dict[str, np.ndarray], prefix: str) -> int:
    n = 0
    while f"{prefix}{n}" in arrays:
        n += 1
    return n


def _save_npz(path: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    """Write atomically (a reader never sees half a file) and under exactly `path`
    (np.savez given a name would append ".npz")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
