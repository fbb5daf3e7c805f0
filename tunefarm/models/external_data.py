"""ONNX tensors whose data lives in other files (`data_location: EXTERNAL`).

A tensor of an ONNX file may keep its bytes in another file, named by its
`external_data` entry `location` (with an optional `offset` and `length`), relative to
the model file's directory. A model from elsewhere is untrusted, and a location is only
a string: `../../etc/passwd`, `/etc/shadow`, or a symlink planted next to the model.
The rules here:

- the external data of a model file is read only from the model's own directory or
  below it: a location that is absolute, that has a `..` part, or that resolves
  (symlinks followed) to a file outside the directory is refused with a `ModelError`
  naming the tensor and the location, before any file is opened; so is a missing file,
  one that is not a regular file, and an offset or length past its end;
- a model given as bytes or as an `onnx.ModelProto` has no directory: any external
  tensor in it is refused (`refuse_external_data`);
- the data is read here, into the tensor (`inline_external_data`), and the tensor no
  longer names a file: nothing downstream (onnxslim, onnxruntime, TVM's frontend, which
  would all read a location relative to the working directory) ever sees one.

Every tensor of the model is looked at: the graph's initializers (dense and sparse),
tensor attributes of nodes (a `Constant`), the graphs of control-flow nodes (`If`,
`Loop`, `Scan`) at any depth, and the model's local functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from tunefarm.errors import ModelError

EXTERNAL = 1
"""`onnx.TensorProto.EXTERNAL` (the value of `data_location`), without importing onnx here."""


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor keeps its data, as the model says."""

    tensor: str
    location: str
    offset: int
    length: int | None  # None: to the end of the file


def external_tensors(model) -> Iterator:
    """Every `TensorProto` of `model` (an `onnx.ModelProto`) whose data is external."""
    for tensor in _all_tensors(model):
        if tensor.data_location == EXTERNAL:
            yield tensor


def external_ref(tensor) -> ExternalRef:
    """The tensor's `external_data` entries, parsed; `ModelError` for malformed ones."""
    entries = {e.key: e.value for e in tensor.external_data}
    name = tensor.name or "(unnamed)"
    location = entries.get("location", "")
    if not location:
        raise ModelError(f"tensor {name!r} keeps its data in an external file but names none (no 'location')")
    offset = _nonnegative(entries.get("offset", "0"), "offset", name, location)
    length = _nonnegative(entries["length"], "length", name, location) if "length" in entries else None
    return ExternalRef(name, location, offset, length)


def location_problem(location: str) -> str | None:
    """Why `location` cannot name a file below the model's directory, judged on the string
    alone (None when it may): absolute, with a `..` part, empty or with a NUL."""
    if not location or "\0" in location:
        return "is not a file name"
    posix, windows = PurePosixPath(location), PureWindowsPath(location)
    if posix.is_absolute() or windows.is_absolute() or windows.drive:
        return "is an absolute path"
    if ".." in posix.parts or ".." in windows.parts:
        return "leaves the model's directory ('..')"
    return None


def resolve_location(base_dir: Path, ref: ExternalRef) -> Path:
    """The file `ref` names below `base_dir`, checked (see the module's rules); nothing
    is opened."""
    problem = location_problem(ref.location)
    if problem is not None:
        raise _outside(ref, problem)
    base = base_dir.resolve()
    candidate = base / ref.location
    try:
        path = candidate.resolve(strict=True)
    except FileNotFoundError:
        raise ModelError(
            f"tensor {ref.tensor!r} keeps its data in {ref.location!r}, which is missing from the model's directory"
        ) from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, a component that is not a directory
        raise ModelError(f"tensor {ref.tensor!r}: its external data {ref.location!r} cannot be opened: {exc}") from None
    if not path.is_relative_to(base) or path == base:
        raise _outside(ref, "resolves (through a symlink) to a file outside the model's directory")
    if not path.is_file():
        raise ModelError(f"tensor {ref.tensor!r} keeps its data in {ref.location!r}, which is not a regular file")
    size = path.stat().st_size
    end = ref.offset + (ref.length if ref.length is not None else 0)
    if ref.offset > size or end > size:
        raise ModelError(
            f"tensor {ref.tensor!r}: offset {ref.offset} and length {ref.length} in {ref.location!r} "
            f"go past its end ({size} bytes)"
        )
    return path


def check_external_data(model, base_dir: Path) -> list[tuple[ExternalRef, Path]]:
    """Every external tensor's reference and checked file, in the model's order, before
    any file is read: one bad location refuses the whole model."""
    return [(ref, resolve_location(base_dir, ref)) for ref in map(external_ref, external_tensors(model))]


def inline_external_data(model, base_dir: Path) -> int:
    """Read every external tensor's data from its file below `base_dir` into the tensor
    (which then no longer names a file). Returns the number of tensors read.
    Raises `ModelError` (nothing read) for any location outside `base_dir`."""
    checked = check_external_data(model, base_dir)
    tensors = list(external_tensors(model))
    for tensor, (ref, path) in zip(tensors, checked):
        with open(path, "rb") as f:
            f.seek(ref.offset)
            data = f.read() if ref.length is None else f.read(ref.length)
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = 0  # TensorProto.DEFAULT
    return len(checked)


def refuse_external_data(model, label: str) -> None:
    """`ModelError` when `model` (given without a directory) has an external tensor."""
    for tensor in external_tensors(model):
        ref = external_ref(tensor)
        raise ModelError(
            f"{label}: tensor {ref.tensor!r} keeps its data in the external file {ref.location!r}, "
            "and a model given without its file has no directory to read it from: give the model's path"
        )


def external_files(model, base_dir: Path) -> list[tuple[str, Path]]:
    """(location, checked file) of every file the model's external tensors name, each once,
    in the model's order (what an upload of the model must carry along)."""
    seen: dict[str, Path] = {}
    for ref, path in check_external_data(model, base_dir):
        seen.setdefault(ref.location, path)
    return list(seen.items())


def _all_tensors(model) -> Iterator:
    for graph in _graphs(model.graph):
        yield from _graph_tensors(graph)
    for function in model.functions:
        for node in function.node:
            yield from _attribute_tensors(node)
            for attr in node.attribute:
                for sub in _attribute_graphs(attr):
                    for graph in _graphs(sub):
                        yield from _graph_tensors(graph)


def _graph_tensors(graph) -> Iterator:
    """The tensors of one graph (not of the graphs nested in it)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _attribute_tensors(node)


def _graphs(graph) -> Iterator:
    """`graph` and every graph nested in its nodes' attributes, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in _attribute_graphs(attr):
                yield from _graphs(sub)


def _attribute_graphs(attr) -> Iterator:
    if attr.HasField("g"):
        yield attr.g
    yield from attr.graphs


def _attribute_tensors(node) -> Iterator:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        for sparse in attr.sparse_tensors:
            yield sparse.values
            yield sparse.indices


def _nonnegative(text: str, key: str, tensor: str, location: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ModelError(f"tensor {tensor!r}: external data {key} {text!r} (in {location!r}) is not a byte count")
    return value


def _outside(ref: ExternalRef, problem: str) -> ModelError:
    return ModelError(
        f"tensor {ref.tensor!r} keeps its data in {ref.location!r}, which {problem}: external data is read "
        "only from the model's own directory (or below it)"
    )
