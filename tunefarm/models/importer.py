"""Import a model (ONNX or a PyTorch module) into a Relax IRModule with fixed shapes.

`import_model(source, input_shapes)` accepts an ONNX file path, ONNX bytes, an
`onnx.ModelProto`, or a `torch.nn.Module` (with `example_inputs`). It returns an
`ImportedModel`: the Relax module (weights embedded as constants), its inputs and
outputs as `TensorSpec`s, the ONNX graph that was converted, and warnings as strings.

The ONNX path, step by step:

1. Load and sanity-check the file. A malformed, truncated or non-ONNX file is a
   `ModelError` with one line. Weights in external files are read from the model's own
   directory only (`external_data.py`: a location outside it is refused, naming the
   tensor) into the graph; a model given as bytes or a ModelProto has no directory and
   may have no external tensor.
2. Graph inputs are the `graph.input` entries that are not initializers. Every dynamic
   dimension (a `dim_param` or a missing `dim_value`) needs a value from `input_shapes`;
   a missing one is a `UsageError` naming the input and its dynamic dimensions and the
   `--input-shape NAME=d0,d1,...` to pass. Unknown names, wrong ranks and values that
   contradict a static dimension are `UsageError`s too. With `max_tensor_elements`,
   a tensor with more elements (an input at its shape, an initializer, a value shape
   inference sizes) is a `ModelError` naming it, before anything is allocated
   (`tensor_limits.py`).
3. Simplify with the fixed shapes using onnxslim. Real exports compute Reshape targets
   with Shape/Gather/Concat arithmetic that TVM's Relax frontend cannot convert
   ("Reshape requires the input new shape to be Shape", "Node ... cannot handle
   ShapeExpr inputs"); with fixed shapes the simplifier folds it into constants.
   onnxslim against onnx-simplifier (onnxsim 0.8.1), on the six example models, each
   exported by both torch.onnx exporters (11 graphs): both simplified the
   reshape_pattern graph (18 -> 5 nodes) and left results unchanged (max abs error
   <= 1.5e-6 against onnxruntime), but onnxsim rewrote BERT's attention into the
   onnxruntime contrib op `com.microsoft.Attention` with a custom scale, which TVM
   rejects ("custom scale is not currently supported"), on both BERT exports. onnxslim
   gave graphs TVM converts on 11 of 11, onnxsim on 9 of 11, so onnxslim is used
   (0.01-0.9 s per model here).
4. Check the simplified graph against the original with onnxruntime on a seeded random
   input: the largest absolute difference must be within `SIMPLIFY_TOLERANCE` times
   the largest output magnitude (at least 1). If the simplifier fails or changes the
   results, the original graph is converted instead and `ImportedModel.warnings` says so.
5. Convert with TVM's `relax.frontend.onnx` (weights as constants). Operators the
   frontend has no converter for are found before converting (its converter table) and
   reported with their node names; a converter that fails is reported with the node
   it failed on; anything else is a one-line `ModelError`.

A PyTorch module goes through `torch.export.export` and TVM's
`from_exported_program(..., keep_params_as_input=False)`.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings as pywarnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.errors import ModelError, UsageError
from tunefarm.models.check import random_inputs  # noqa: F401  (the import check's input; re-exported)
from tunefarm.models.external_data import inline_external_data, refuse_external_data
from tunefarm.models.tensor_limits import check_tensor_elements
from tunefarm.records import TensorSpec

SIMPLIFY_TOLERANCE = 1e-4
"""Largest allowed |simplified - original| on the check input, relative to
max(1, largest |original output|). Folding constants reorders float arithmetic
(BN folding, for instance), which moves results by ~1e-7 relative, never by 1e-4."""

CHECK_SEED = 0
"""Seed of the random input (standard normal) used to check the simplified graph against the original."""

ORT_THREADS = 2
"""Intra-op threads of the onnxruntime sessions used for checking."""


@dataclass(frozen=True)
class ImportedModel:
    """A model as a Relax IRModule whose every shape is static."""

    name: str
    mod: object  # tvm.IRModule with a Relax "main"; weights are constants
    inputs: tuple[TensorSpec, ...]  # in the order "main" takes them (ONNX names for ONNX models)
    outputs: tuple[TensorSpec, ...]
    onnx_bytes: bytes | None  # the ONNX graph converted (simplified when that worked); None for torch
    warnings: tuple[str, ...] = ()

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self.inputs}


def import_model(
    source: Any,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    name: str | None = None,
    example_inputs: Sequence[Any] | None = None,
    max_tensor_elements: int | None = None,
    max_model_elements: int | None = None,
) -> ImportedModel:
    """Import an ONNX model (path, bytes or `onnx.ModelProto`) or a `torch.nn.Module`.

    `input_shapes` maps input names to shapes; ONNX inputs with dynamic dimensions need
    one. A torch module needs `example_inputs` (a tuple of tensors); without them,
    `input_shapes` gives float32 zero tensors in its order. `max_tensor_elements` caps
    every tensor of an ONNX model, and `max_model_elements` all of them together, checked
    on their shapes before anything is allocated (`tensor_limits`; None: no cap).
    """
    if _is_torch_module(source):
        return _import_torch(source, input_shapes, name=name, example_inputs=example_inputs)
    if example_inputs is not None:
        raise UsageError("example_inputs is only for torch.nn.Module sources")
    model, default_name = _load_onnx(source)
    return _import_onnx(model, input_shapes or {}, name=name or default_name, max_tensor_elements=max_tensor_elements,
                        max_model_elements=max_model_elements)  # fmt: skip


# -- ONNX ----------------------------------------------------------------------------------


def _onnx():
    try:
        import onnx
    except ImportError:
        raise UsageError(
            "importing ONNX models needs the onnx package: pip install onnx onnxruntime onnxslim"
        ) from None
    return onnx


def _load_onnx(source: Any):
    """(ModelProto, default name) from a path, bytes or a ModelProto; one-line errors."""
    onnx = _onnx()
    if isinstance(source, onnx.ModelProto):
        refuse_external_data(source, "the given onnx.ModelProto")
        return source, source.graph.name or "model"
    if isinstance(source, (bytes, bytearray, memoryview)):
        model = _parse_onnx(bytes(source), "the given ONNX data")
        refuse_external_data(model, "the given ONNX data")
        return model, "model"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return read_onnx_file(path)[0], path.stem
    raise UsageError(
        f"cannot import a {type(source).__name__}: give an ONNX file path, ONNX bytes, "
        "an onnx.ModelProto or a torch.nn.Module"
    )


def read_onnx_file(path: Path, *, label: str | None = None, data_dir: Path | None = None):
    """(ModelProto, tensors read from external files) of an ONNX file. External data
    (weights in side files) is read only from `data_dir` (default: the model's own
    directory) or below it (`tunefarm.models.external_data`); a location outside it is
    a one-line `ModelError` naming the tensor and the location, and nothing is read.
    Errors start with `label` (default: the path)."""
    label = label or str(path)
    if not path.is_file():
        raise ModelError(f"{label}: no such file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelError(f"{label}: cannot read: {exc.strerror or exc}") from None
    model = _parse_onnx(data, label)
    try:
        inlined = inline_external_data(model, path.parent if data_dir is None else data_dir)
    except ModelError as exc:
        raise ModelError(f"{label}: {exc}") from None
    except OSError as exc:
        raise ModelError(f"{label}: cannot read its external data: {exc.strerror or exc}") from None
    return model, inlined


def _parse_onnx(data: bytes, label: str):
    onnx = _onnx()
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # google.protobuf.message.DecodeError and friends
        raise ModelError(
            f"{label} is not a valid ONNX model (truncated or not ONNX): {_first_line(exc)}"
        ) from None
    # Protobuf happily parses many non-ONNX byte strings into an almost empty message.
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.node:
        raise ModelError(f"{label} is not a valid ONNX model (no graph with nodes; truncated or not ONNX)")
    return model


@dataclass(frozen=True)
class _OnnxInput:
    name: str
    dims: tuple[int | str | None, ...] | None  # None: unknown rank; int static; str/None dynamic
    dtype: str

    @property
    def dynamic(self) -> list[str]:
        """The dynamic dimensions, described: "0 ('batch')", "2"; ["rank"] for an unknown rank."""
        if self.dims is None:
            return ["rank"]
        return [
            f"{i} ({d!r})" if isinstance(d, str) else str(i)
            for i, d in enumerate(self.dims)
            if not isinstance(d, int)
        ]


def onnx_graph_inputs(model) -> list[_OnnxInput]:
    """The graph's real inputs (not initializers) with their dimensions."""
    onnx = _onnx()
    initializers = {t.name for t in model.graph.initializer}
    result = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        ttype = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise ModelError(f"input {value.name!r} is not a tensor (sequences and maps are not supported)")
        try:
            dtype = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)))
        except Exception:
            raise ModelError(
                f"input {value.name!r} has an unsupported element type {ttype.elem_type}"
            ) from None
        if not ttype.HasField("shape"):
            dims = None
        else:
            dims = tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
                for d in ttype.shape.dim
            )
        result.append(_OnnxInput(value.name, dims, dtype))
    return result


def resolve_input_shapes(
    inputs: Sequence[_OnnxInput], given: Mapping[str, Sequence[int]]
) -> dict[str, tuple[int, ...]]:
    """Every input's static shape: the model's own, filled in from `given`."""
    names = [i.name for i in inputs]
    unknown = [n for n in given if n not in names]
    if unknown:
        raise UsageError(
            f"--input-shape names {', '.join(map(repr, unknown))}, but the model's inputs are {', '.join(map(repr, names))}"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for inp in inputs:
        if inp.name in given:
            try:
                shape = tuple(int(d) for d in given[inp.name])
            except (TypeError, ValueError):
                raise UsageError(
                    f"--input-shape {inp.name}: dimensions must be integers, got {given[inp.name]!r}"
                ) from None
            if any(d <= 0 for d in shape):
                raise UsageError(f"--input-shape {inp.name}: dimensions must be positive, got {_dims(shape)}")
            if inp.dims is not None:
                if len(shape) != len(inp.dims):
                    raise UsageError(
                        f"--input-shape {inp.name}={_dims(shape)} has rank {len(shape)}, but input {inp.name!r} "
                        f"has rank {len(inp.dims)} ({_describe_dims(inp.dims)})"
                    )
                clash = [i for i, (d, s) in enumerate(zip(inp.dims, shape)) if isinstance(d, int) and d != s]
                if clash:
                    raise UsageError(
                        f"--input-shape {inp.name}={_dims(shape)} contradicts the model's static dimension(s) "
                        f"{', '.join(str(i) for i in clash)} of input {inp.name!r} ({_describe_dims(inp.dims)})"
                    )
            shapes[inp.name] = shape
        elif inp.dynamic:
            if inp.dims is None:
                what = "an unknown rank"
            else:
                plural = "s" if len(inp.dynamic) > 1 else ""
                what = f"the dynamic dimension{plural} {', '.join(inp.dynamic)} in {_describe_dims(inp.dims)}"
            raise UsageError(
                f"input {inp.name!r} has {what}; pass its full shape with --input-shape "
                f"{inp.name}=d0,d1,..., e.g. --input-shape {inp.name}={_suggest(inp.dims)}"
            )
        else:
            shapes[inp.name] = tuple(int(d) for d in inp.dims)  # type: ignore[union-attr, arg-type]
    return shapes


def _import_onnx(
    model, given: Mapping[str, Sequence[int]], *, name: str, max_tensor_elements: int | None = None,
    max_model_elements: int | None = None,
) -> ImportedModel:
    inputs = onnx_graph_inputs(model)
    if not inputs:
        raise ModelError(f"{name}: the ONNX graph has no inputs (every graph input is an initializer)")
    shapes = resolve_input_shapes(inputs, given)
    if max_tensor_elements is not None or max_model_elements is not None:
        check_tensor_elements(model, shapes, max_tensor_elements or max_model_elements, max_model_elements)
    dtypes = {i.name: i.dtype for i in inputs}
    notes: list[str] = []
    converted = _simplify_checked(model, shapes, dtypes, notes)
    _check_operators(converted)
    mod = _convert_onnx(converted, shapes)
    in_specs = tuple(TensorSpec(i.name, shapes[i.name], i.dtype) for i in inputs)
    out_names = [o.name for o in converted.graph.output]
    out_specs = _output_specs(mod, out_names, name)
    data = converted.SerializeToString() if converted.ByteSize() < (2 << 30) - 1 else None
    return ImportedModel(name, mod, in_specs, out_specs, data, tuple(notes))


def _simplify_checked(model, shapes, dtypes, notes: list[str]):
    """The onnxslim-simplified graph when it matches the original, else the original."""
    onnx = _onnx()
    try:
        import onnxslim
    except ImportError:
        notes.append(
            "onnxslim is not installed, so the graph was converted without simplification (pip install onnxslim)"
        )
        return model
    original = onnx.ModelProto()
    original.CopyFrom(model)
    try:
        with _quiet():
            slimmed = onnxslim.slim(
                original, input_shapes=[f"{n}:{','.join(map(str, s))}" for n, s in shapes.items()]
            )
    except Exception as exc:
        notes.append(f"onnxslim failed ({_first_line(exc)}); converting the unsimplified graph")
        return model
    if slimmed is None or not slimmed.graph.node:
        notes.append("onnxslim returned an empty graph; converting the unsimplified graph")
        return model
    verdict = _compare_with_ort(model, slimmed, shapes, dtypes)
    if verdict is None:
        return slimmed
    kind, text = verdict
    if kind == "unchecked":
        notes.append(f"the simplified graph was not checked against the original: {text}")
        return slimmed
    notes.append(f"the simplified graph {text}; converting the unsimplified graph")
    return model


def _compare_with_ort(original, simplified, shapes, dtypes) -> tuple[str, str] | None:
    """None when both graphs agree on a random input; else ("unchecked"|"differs", why)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "unchecked", "onnxruntime is not installed"
    feeds = random_inputs(shapes, dtypes, seed=CHECK_SEED)
    try:
        want = run_onnxruntime(original, feeds)
    except Exception as exc:
        return "unchecked", f"onnxruntime cannot run the original ({_first_line(exc)})"
    try:
        got = run_onnxruntime(simplified, feeds)
    except Exception as exc:
        return "differs", f"does not run in onnxruntime ({_first_line(exc)})"
    if len(got) != len(want):
        return "differs", f"has {len(got)} outputs instead of {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return "differs", f"gives output {i} the shape {g.shape} instead of {w.shape}"
        scale = max(1.0, float(np.max(np.abs(w.astype(np.float64)))) if w.size else 1.0)
        err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) if w.size else 0.0
        if not err <= SIMPLIFY_TOLERANCE * scale:
            return "differs", f"changes output {i} by {err:.3g} (allowed {SIMPLIFY_TOLERANCE * scale:.3g})"
    return None


def run_onnxruntime(
    model_or_bytes, feeds: Mapping[str, np.ndarray], *, threads: int = ORT_THREADS
) -> list[np.ndarray]:
    """The model's outputs from onnxruntime (CPU, `threads` intra-op threads)."""
    import onnxruntime as ort

    data = model_or_bytes if isinstance(model_or_bytes, bytes) else model_or_bytes.SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in session.run(None, dict(feeds))]


def _converter_table():
    try:
        from tvm.relax.frontend.onnx import onnx_frontend

        return onnx_frontend._get_convert_map()
    except Exception:  # the private table moved: the frontend's own check still reports op types
        return None


def _check_operators(model) -> None:
    table = _converter_table()
    if table is None:
        return
    handled = {"Constant", "If"}  # converted by the frontend outside its table
    missing: dict[str, list[str]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type not in table and node.op_type not in handled:
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            missing.setdefault(op, []).append(node.name or f"#{index}")
    if missing:
        parts = [
            f"{op} (node{'s' if len(n) > 1 else ''} {', '.join(map(repr, n[:3]))}{', ...' if len(n) > 3 else ''})"
            for op, n in missing.items()
        ]
        raise ModelError(f"TVM's ONNX importer cannot convert the operator(s) {'; '.join(parts)}")


def _convert_onnx(model, shapes: Mapping[str, tuple[int, ...]]):
    """TVM's ONNX frontend, reporting the node a converter failed on."""
    from tvm.relax.frontend.onnx import onnx_frontend

    if model.ir_version < 3:
        raise ModelError(f"ONNX IR version {model.ir_version} is too old (TVM needs 3 or later)")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    shape_dict = {n: list(s) for n, s in shapes.items()}
    importer_cls = getattr(onnx_frontend, "ONNXGraphImporter", None)
    importer = None
    try:
        with _quiet():
            if importer_cls is None:  # public entry point only: no node to name on failure
                return onnx_frontend.from_onnx(model, shape_dict=shape_dict, keep_params_in_input=False)
            importer = importer_cls(shape_dict, "float32", keep_params_in_input=False, sanitize=True)
            return importer.from_onnx(model.graph, opset)
    except Exception as exc:
        node = _failed_node(model, importer)
        where = f" at node {node.name or '(unnamed)'!r} ({node.op_type})" if node is not None else ""
        raise ModelError(
            f"TVM's ONNX importer failed{where}: {type(exc).__name__}: {_first_line(exc)}"
        ) from None


def _failed_node(model, importer):
    """The first node (in graph order) whose outputs the importer did not produce."""
    produced = getattr(importer, "_nodes", None)
    if produced is None:
        return None
    for node in model.graph.node:
        if any(out and out not in produced for out in node.output):
            return node
    return None


def _output_specs(mod, names: Sequence[str], model_name: str) -> tuple[TensorSpec, ...]:
    import tvm
    from tvm import relax

    ret = mod["main"].ret_ty
    fields = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    if len(names) != len(fields):
        names = [f"output_{i}" for i in range(len(fields))]
    specs = []
    for n, ty in zip(names, fields):
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise ModelError(f"{model_name}: output {n!r} is not a tensor of known shape ({ty})")
        dims = list(ty.shape.values)
        if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            raise ModelError(
                f"{model_name}: output {n!r} has a shape that depends on the data ({_dims(dims)}); "
                "only models whose shapes are all fixed by the input shapes can be tuned"
            )
        specs.append(TensorSpec(n, tuple(int(d) for d in dims), str(ty.dtype)))
    return tuple(specs)


# -- PyTorch ---------------------------------------------------------------------------------


def _is_torch_module(obj: Any) -> bool:
    cls = type(obj)
    return any(c.__module__.startswith("torch.nn") and c.__name__ == "Module" for c in cls.__mro__)


def _import_torch(module, input_shapes, *, name, example_inputs) -> ImportedModel:
    import torch

    if example_inputs is None:
        if not input_shapes:
            raise UsageError("a torch.nn.Module needs example_inputs (or input_shapes for float32 inputs)")
        example_inputs = tuple(torch.zeros(tuple(s)) for s in input_shapes.values())
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    name = name or type(module).__name__
    try:
        from tvm.relax.frontend.torch import from_exported_program
    except ImportError as exc:
        raise ModelError(f"TVM's PyTorch frontend is unavailable: {_first_line(exc)}") from None
    module = module.eval()
    try:
        with _quiet(), torch.no_grad():
            exported = torch.export.export(module, example_inputs)
    except Exception as exc:
        raise ModelError(f"{name}: torch.export failed: {type(exc).__name__}: {_first_line(exc)}") from None
    try:
        with _quiet():
            mod = from_exported_program(exported, keep_params_as_input=False)
    except Exception as exc:
        raise ModelError(
            f"{name}: TVM's PyTorch importer failed: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    params = mod["main"].params
    in_names = (
        list(input_shapes) if input_shapes and len(input_shapes) == len(params) else [p.name for p in params]
    )
    in_specs = []
    for n, p in zip(in_names, params):
        ty = p.ty
        dims = list(ty.shape.values)
        in_specs.append(TensorSpec(n, tuple(int(d) for d in dims), str(ty.dtype)))
    ret = mod["main"].ret_ty
    n_out = len(ret.fields) if hasattr(ret, "fields") else 1
    out_specs = _output_specs(mod, [f"output_{i}" for i in range(n_out)], name)
    return ImportedModel(name, mod, tuple(in_specs), out_specs, None, ())


# -- helpers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet():
    """Silence the Python-level chatter of converters (prints and warnings)."""
    with pywarnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        pywarnings.simplefilter("ignore")
        yield


def _dims(shape) -> str:
    return ",".join(str(d) for d in shape)


def _describe_dims(dims) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"


def _suggest(dims) -> str:
    if dims is None:
        return "1,3,224,224"
    return ",".join(str(d) if isinstance(d, int) else "1" for d in dims)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__
