"""Taking in an uploaded model: import, simplify, fuse, list the tasks, check each can be
tuned, and save the fused module.

An upload may carry the model's external data (weights in side files): one
`external_data` part per file, named by the location the model gives it. They are
staged in a directory of their own (`DATA_DIR`), where the importer reads them (it
refuses any location outside that directory, naming the tensor); the model itself is
staged outside it, so no part, whatever its name, can replace the model or another
part. What is kept is the model with that data read into it, one self-contained ONNX
file like any other upload, stored under the hash of the bytes kept.

All of it runs in a child process (one of `intake_pool.IntakePool`'s importers, its
address space capped): TVM's importer on an arbitrary file may crash, hang or ask for
gigabytes, and must never take the API down. Tensors are capped by their shapes before
anything is allocated (`IntakeLimits.max_tensor_elements`). The child
writes `fused.json` into a staging directory and returns plain data (`intake_job`); the
parent (`take_in`) turns failures into `InvalidModel` with the importer's one-line
message, which names the operator TVM cannot convert.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from services.api.exceptions import InvalidModel, InvalidRequest, PayloadTooLarge, ServiceUnavailable
from services.api.intake_pool import IntakePool
from services.api.storage import StoredFile, copy_limited, keep, staging
from tunefarm.isolation import CallStatus, WorkerStartError
from tunefarm.models.external_data import location_problem

FUSED_NAME = "fused.json"
INLINED_NAME = "inlined.onnx"
"""The uploaded model with its external data read into it: what is kept of such an upload."""
UPLOAD_NAME = "upload.onnx"
"""The uploaded model file, in the staging directory."""
DATA_DIR = "data"
"""The staging subdirectory of an upload's external data files (and nothing else)."""

PROBE_TARGET = {"kind": "llvm", "num-cores": 4}
"""The target a task's sketches are derived for when checking that it can be tuned at
all (whether a program has sketches does not depend on the CPU)."""

REDUCED_PRECISION_PROBE_TARGET = {"kind": "cuda", "arch": "sm_80"}
"""The target the tasks of a model converted to reduced precision (a job's `precision`,
CUDA classes with tensor cores only) are checked against."""

_OWN_ERRORS = ("ModelError: ", "UsageError: ", "WorkloadError: ")


def intake_job(
    onnx_path: str, shapes_json: str, name: str, staging_dir: str, data_dir: str, max_tensor_elements: int | None,
    max_model_elements: int | None = None, precision: str = "fp32",
) -> dict[str, Any]:
    """Child side: plain arguments, plain result; raises `ModelError`/`UsageError`.
    `precision`: what the fused module computes in (`tunefarm.models.precision`)."""
    from tunefarm.models.importer import import_model, read_onnx_file

    shapes = json.loads(shapes_json)
    # External data is read from the upload's data directory only (the files that came
    # with it); the model kept is then self-contained. A file that is not ONNX at all
    # is refused here, before TVM is loaded.
    model, inlined = read_onnx_file(Path(onnx_path), label="the model", data_dir=Path(data_dir))
    if inlined:
        (Path(staging_dir) / INLINED_NAME).write_bytes(model.SerializeToString())

    import tvm

    from tunefarm.errors import ModelError, WorkloadError
    from tunefarm.models.tasks import extract_tasks
    from tunefarm.search.task import make_task

    imported = import_model(model, shapes, name=name, max_tensor_elements=max_tensor_elements,
                            max_model_elements=max_model_elements)  # fmt: skip
    tasks = extract_tasks(imported, name=name, precision=precision)
    if not tasks.tasks:
        raise ModelError(f"{name}: the model has no kernel to tune (every operator is a reshape)")
    probe = PROBE_TARGET if precision == "fp32" else REDUCED_PRECISION_PROBE_TARGET
    for t in tasks.tasks:
        try:
            make_task(t.workload, probe)
        except WorkloadError as exc:
            raise ModelError(f"task {t.name} cannot be tuned: {exc}") from None
    fused = Path(staging_dir) / FUSED_NAME
    fused.write_text(tvm.ir.save_json(tasks.fused_mod))
    rows = {r.key: r for r in tasks.table()}
    return {
        "inputs": [_spec(t) for t in imported.inputs],
        "outputs": [_spec(t) for t in imported.outputs],
        "warnings": list(imported.warnings),
        "elided": list(tasks.elided),
        "inlined": bool(inlined),  # the model to keep is INLINED_NAME, not the upload
        "tasks": [
            {
                "position": i,
                "key": t.key,
                "name": t.name,
                "shapes": rows[t.key].shapes,
                "module_json": t.workload.to_json(),
                "flops": float(t.flops),
                "share": float(rows[t.key].share),
                "n_inputs": len(t.workload.inputs),
                "n_outputs": len(t.workload.outputs),
                "weight": int(t.weight),
                "const_inputs": list(t.const_inputs),
                "global_vars": list(t.global_vars),
            }
            for i, t in enumerate(tasks.tasks)
        ],
    }


_SHAPE_HINT = re.compile(r"pass its full shape with --input-shape (\S+?)=d0,d1,\.\.\., e\.g\. --input-shape \S+?=([\d,]+)")


_MISSING_EXTERNAL = re.compile(r"keeps its data in ('[^']*'), which is missing from the model's directory")


def _for_the_api(message: str) -> str:
    """The importer's hints name the command line's flag; an API client sets `input_shapes`.
    A missing external data file is one that did not come with the upload."""
    message = _MISSING_EXTERNAL.sub(
        lambda m: f"keeps its data in {m[1]}, which did not come with the upload "
        f"(send it as an external_data part named {m[1]}; tunefarm submit does)",
        message,
    )
    return _SHAPE_HINT.sub(
        lambda m: f'pass its full shape in input_shapes, e.g. {{"{m[1]}": [{", ".join(m[2].split(","))}]}} '
        f"(tunefarm submit --input-shape {m[1]}={m[2]})",
        message,
    )


def _spec(t) -> dict[str, Any]:
    return {"name": t.name, "shape": [int(d) for d in t.shape], "dtype": str(t.dtype)}


def take_in(
    pool: IntakePool,
    *,
    onnx_path: Path,
    input_shapes: dict[str, list[int]],
    name: str,
    staging_dir: Path,
    data_dir: Path,
    limits: IntakeLimits,
    precision: str = "fp32",
) -> dict[str, Any]:
    """Run `intake_job` in one of the pool's importers. Raises `InvalidModel` for a model
    that cannot be taken in (malformed, unsupported operator, a tensor over the cap, the
    importer out of memory, crashed or hung)."""
    timeout = limits.timeout_secs
    try:
        with pool.importer() as worker:
            outcome = worker.call(
                f"{__name__}:intake_job",
                str(onnx_path),
                json.dumps(input_shapes),
                name,
                str(staging_dir),
                str(data_dir),
                limits.max_tensor_elements,
                limits.max_model_elements,
                precision,
                timeout=timeout,
            )
    except WorkerStartError as exc:
        raise ServiceUnavailable(f"the model importer could not start: {exc}") from None
    if outcome.ok:
        return outcome.value
    if outcome.status is CallStatus.RAISED:
        message = outcome.message
        if message.startswith("MemoryError"):
            raise InvalidModel("importing the model needs more memory than this farm gives an import; it was abandoned")
        for prefix in _OWN_ERRORS:
            if message.startswith(prefix):
                raise InvalidModel(_for_the_api(message[len(prefix) :]))
        raise InvalidModel(f"the model cannot be imported: {message}")
    if outcome.status is CallStatus.TIMED_OUT:
        raise InvalidModel(f"importing the model took longer than {timeout:g} s; it was abandoned")
    raise InvalidModel(f"TVM's importer crashed on this model ({outcome.message})")


# -- an upload, from the request to stored files ---------------------------------------------


def parse_input_shapes(text: str) -> dict[str, list[int]]:
    """The `input_shapes` form field: a JSON object {input name: [d0, d1, ...]}."""
    try:
        data = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"input_shapes is not JSON ({exc.msg}); expected {{\"x\": [1, 3, 224, 224]}}") from None
    if not isinstance(data, dict):
        raise InvalidRequest('input_shapes must be a JSON object, e.g. {"x": [1, 3, 224, 224]}')
    shapes: dict[str, list[int]] = {}
    for name, dims in data.items():
        if (
            not isinstance(dims, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims)
            or any(d < 1 for d in dims)
        ):
            raise InvalidRequest(f"input_shapes[{name!r}] must be a list of positive integers, got {dims!r}")
        shapes[str(name)] = dims
    return shapes


@dataclass(frozen=True)
class TakenIn:
    """An accepted upload: its stored files and what the importer found."""

    name: str
    input_shapes: dict[str, list[int]]
    onnx: StoredFile
    fused: StoredFile
    intake: dict[str, Any]


@dataclass(frozen=True)
class IntakeLimits:
    """What one upload may take: bytes (the model and its external data together),
    seconds of importing, elements of any one tensor."""

    max_bytes: int
    timeout_secs: float
    max_tensor_elements: int | None
    max_model_elements: int | None = None


def accept_upload(
    pool: IntakePool,
    *,
    upload: BinaryIO,
    filename: str | None,
    name: str | None,
    input_shapes_text: str,
    root: Path,
    limits: IntakeLimits,
    external_data: Sequence[tuple[str | None, BinaryIO]] = (),
) -> TakenIn:
    """Copy the upload and its external data files (file name: the location the model
    names) to staging (at most `limits.max_bytes` in all), take it in with one of the
    pool's importers, and keep its files. Raises `PayloadTooLarge`, `InvalidRequest`,
    `InvalidModel` or `ServiceUnavailable`, having stored nothing."""
    max_bytes = limits.max_bytes
    shapes = parse_input_shapes(input_shapes_text)
    model_name = name.strip() if name and name.strip() else _name_from(filename)
    locations = [external_location(loc) for loc, _ in external_data]
    twice = sorted({loc for loc in locations if locations.count(loc) > 1})
    if twice:
        raise InvalidRequest(f"external_data {twice[0]!r} was sent twice")
    with staging(root) as tmp:
        staged, data_dir = tmp / UPLOAD_NAME, tmp / DATA_DIR
        data_dir.mkdir()
        size = copy_limited(upload, staged, limit=max_bytes)
        if size is None:
            raise PayloadTooLarge(f"the model is larger than this farm accepts ({max_bytes} bytes)")
        if size == 0:
            raise InvalidModel("the uploaded file is empty")
        sources = [source for _, source in external_data]
        _stage_external_data(data_dir, zip(locations, sources), budget=max_bytes - size, max_bytes=max_bytes)
        intake = take_in(pool, onnx_path=staged, input_shapes=shapes, name=model_name, staging_dir=tmp,
                         data_dir=data_dir, limits=limits)
        # The files to keep are named here, not by the child (nothing it says is a path).
        onnx = keep(root, _written(tmp / INLINED_NAME if intake["inlined"] else staged), suffix=".onnx")
        fused = keep(root, _written(tmp / FUSED_NAME), suffix=".fused.json")
    return TakenIn(model_name, shapes, onnx, fused, intake)


@dataclass(frozen=True)
class ModelVariant:
    """A stored model converted to another precision for a job (`JobCreate.precision`):
    its fused module, kept like an upload's, and its tasks (`intake_job`'s entries)."""

    precision: str
    fused: StoredFile
    tasks: list[dict[str, Any]]


def take_in_variant(
    pool: IntakePool, *, onnx_path: Path, input_shapes: dict[str, list[int]], name: str, root: Path,
    limits: IntakeLimits, precision: str,
) -> ModelVariant:
    """Import a stored model (self-contained: its external data was read in at upload)
    again in `precision` with one of the pool's importers, and keep its fused module.
    Raises as `take_in` does, having stored nothing."""
    with staging(root) as tmp:
        data_dir = tmp / DATA_DIR
        data_dir.mkdir()
        intake = take_in(pool, onnx_path=onnx_path, input_shapes=input_shapes, name=name, staging_dir=tmp,
                         data_dir=data_dir, limits=limits, precision=precision)  # fmt: skip
        fused = keep(root, _written(tmp / FUSED_NAME), suffix=".fused.json")
    return ModelVariant(precision, fused, intake["tasks"])


def _written(path: Path) -> Path:
    """`path`, a regular file the import left (not a link to elsewhere)."""
    if path.is_symlink() or not path.is_file():
        raise InvalidModel(f"the model importer did not leave its {path.name} as a file; the model was not taken in")
    return path


def _stage_external_data(
    data_dir: Path, parts: Iterable[tuple[str, BinaryIO]], *, budget: int, max_bytes: int
) -> None:
    """Copy each (location, source) part below `data_dir`, at most `budget` bytes in all."""
    for location, source in parts:
        dest = data_dir / location
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            size = copy_limited(source, dest, limit=budget)
        except OSError as exc:  # "a" and "a/b": not a set of files
            raise InvalidRequest(f"external_data {location!r} cannot be stored as a file ({exc.strerror})") from None
        if size is None:
            raise PayloadTooLarge(f"the model and its external data are larger than this farm accepts ({max_bytes} bytes)")
        budget -= size


def external_location(filename: str | None) -> str:
    """The location an `external_data` part stands for (its file name), checked and
    normalized as a path ("./w.bin", "w.bin/" and "w.bin" are one file): a relative path
    to a file below the upload's data directory."""
    location = (filename or "").strip()
    problem = location_problem(location)
    if problem is None and not PurePosixPath(location).parts:
        problem = "is not a file name"
    if problem is not None:
        raise InvalidRequest(f"external_data file name {location!r} {problem}; name each part by the location the model gives it")
    return PurePosixPath(location).as_posix()


def _name_from(filename: str | None) -> str:
    stem = Path(filename or "model.onnx").stem
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:100] or "model"
