"""Taking in an uploaded model: import, simplify, fuse, list the tasks, check each can be
tuned, and save the fused module.

All of it runs in a child process (`tunefarm.isolation.IsolatedWorker`): TVM's importer
on an arbitrary file may crash or hang, and must never take the API down. The child
writes `fused.json` into a staging directory and returns plain data (`intake_job`); the
parent (`take_in`) turns failures into `InvalidModel` with the importer's one-line
message, which names the operator TVM cannot convert.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from services.api.exceptions import InvalidModel, InvalidRequest, PayloadTooLarge, ServiceUnavailable
from services.api.storage import StoredFile, copy_limited, keep, staging
from tunefarm.isolation import CallStatus, IsolatedWorker, WorkerStartError

FUSED_NAME = "fused.json"

PROBE_TARGET = {"kind": "llvm", "num-cores": 4}
"""The target a task's sketches are derived for when checking that it can be tuned at
all (whether a program has sketches does not depend on the CPU)."""

_OWN_ERRORS = ("ModelError: ", "UsageError: ", "WorkloadError: ")


def intake_job(onnx_path: str, shapes_json: str, name: str, staging_dir: str) -> dict[str, Any]:
    """Child side: plain arguments, plain result; raises `ModelError`/`UsageError`."""
    import tvm

    from services.scheduler.task import make_task
    from tunefarm.errors import ModelError, WorkloadError
    from tunefarm.models.importer import import_model
    from tunefarm.models.tasks import extract_tasks

    shapes = json.loads(shapes_json)
    imported = import_model(Path(onnx_path).read_bytes(), shapes, name=name)
    tasks = extract_tasks(imported, name=name)
    if not tasks.tasks:
        raise ModelError(f"{name}: the model has no kernel to tune (every operator is a reshape)")
    for t in tasks.tasks:
        try:
            make_task(t.workload, PROBE_TARGET)
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
        "fused_path": str(fused),
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


def _for_the_api(message: str) -> str:
    """The importer's hints name the command line's flag; an API client sets `input_shapes`."""
    return _SHAPE_HINT.sub(
        lambda m: f'pass its full shape in input_shapes, e.g. {{"{m[1]}": [{", ".join(m[2].split(","))}]}} '
        f"(tunefarm submit --input-shape {m[1]}={m[2]})",
        message,
    )


def _spec(t) -> dict[str, Any]:
    return {"name": t.name, "shape": [int(d) for d in t.shape], "dtype": str(t.dtype)}


def take_in(
    worker: IsolatedWorker,
    *,
    onnx_path: Path,
    input_shapes: dict[str, list[int]],
    name: str,
    staging_dir: Path,
    timeout: float,
) -> dict[str, Any]:
    """Run `intake_job` in `worker`. Raises `InvalidModel` for a model that cannot be
    taken in (malformed, unsupported operator, crash or hang of the importer)."""
    try:
        outcome = worker.call(
            f"{__name__}:intake_job",
            str(onnx_path),
            json.dumps(input_shapes),
            name,
            str(staging_dir),
            timeout=timeout,
        )
    except WorkerStartError as exc:
        raise ServiceUnavailable(f"the model importer could not start: {exc}") from None
    if outcome.ok:
        return outcome.value
    if outcome.status is CallStatus.RAISED:
        message = outcome.message
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


def accept_upload(
    worker: IsolatedWorker,
    *,
    upload: BinaryIO,
    filename: str | None,
    name: str | None,
    input_shapes_text: str,
    root: Path,
    max_bytes: int,
    timeout: float,
) -> TakenIn:
    """Copy the upload to staging (at most `max_bytes`), take it in, and keep its files.
    Raises `PayloadTooLarge`, `InvalidRequest` or `InvalidModel`, having stored nothing."""
    shapes = parse_input_shapes(input_shapes_text)
    model_name = name.strip() if name and name.strip() else _name_from(filename)
    with staging(root) as tmp:
        staged = tmp / "model.onnx"
        copied = copy_limited(upload, staged, limit=max_bytes)
        if copied is None:
            raise PayloadTooLarge(f"the model is larger than this farm accepts ({max_bytes} bytes)")
        sha256, size = copied
        if size == 0:
            raise InvalidModel("the uploaded file is empty")
        intake = take_in(worker, onnx_path=staged, input_shapes=shapes, name=model_name, staging_dir=tmp, timeout=timeout)
        onnx = keep(root, staged, suffix=".onnx", sha256=sha256)
        fused = keep(root, Path(intake["fused_path"]), suffix=".fused.json")
    return TakenIn(model_name, shapes, onnx, fused, intake)


def _name_from(filename: str | None) -> str:
    stem = Path(filename or "model.onnx").stem
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:100] or "model"
