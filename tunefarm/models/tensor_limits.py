"""A cap on the elements of an ONNX model's tensors, checked before anything is allocated.

An ONNX file of a few dozen bytes may declare an input of 32768 x 32768 floats, a
`ConstantOfShape` of a billion elements, or an initializer whose dimensions promise
far more than its data: importing it (the random check input, onnxruntime, onnxslim's
folding, TVM's frontend) would then allocate gigabytes. `check_tensor_elements` reads
only shapes:

- every graph input, at the shape it will be imported with;
- every initializer and every `Constant` node's tensor of the main graph, as declared;
- every value ONNX shape inference gives a static shape, with the inputs so fixed
  (what the graph computes from them).

The first tensor over the cap is a one-line `ModelError` naming it, its shape and the
cap. With `max_total`, so is a model whose tensors have more elements in all (many
tensors, each under the cap, add up to gigabytes too). Shape inference that fails says nothing (the importer reports what is wrong with
the graph later); a shape that is not static is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from tunefarm.errors import ModelError


def check_tensor_elements(
    model, shapes: Mapping[str, Sequence[int]], max_elements: int, max_total: int | None = None
) -> None:
    """`ModelError` naming the first tensor of `model` (an `onnx.ModelProto` whose inputs
    get `shapes`) with more than `max_elements` elements, or saying that its tensors have
    more than `max_total` elements in all."""
    total = 0
    for what, name, dims in _declared(model, shapes):
        total += _check(what, name, dims, max_elements)
    for name, dims in _inferred(model, shapes):
        total += _check("tensor", name, dims, max_elements)
    if max_total is not None and total > max_total:
        raise ModelError(
            f"the model's tensors have {total:,} elements in all, more than the {max_total:,} a model may "
            "have here; give it fewer or smaller tensors"
        )


def _check(what: str, name: str, dims: Sequence[int], max_elements: int) -> int:
    """The tensor's elements; ModelError above `max_elements`."""
    elements = math.prod(dims)
    if elements > max_elements:
        shape = "x".join(str(d) for d in dims)
        raise ModelError(
            f"{what} {name!r} has {elements:,} elements ({shape}), more than the {max_elements:,} "
            "a tensor may have here; give it a smaller shape"
        )
    return elements


def _declared(model, shapes: Mapping[str, Sequence[int]]) -> Iterator[tuple[str, str, Sequence[int]]]:
    for name, dims in shapes.items():
        yield "input", name, [int(d) for d in dims]
    for tensor in model.graph.initializer:
        yield "initializer", tensor.name, list(tensor.dims)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield "constant", node.output[0] if node.output else node.name, list(attr.t.dims)


def _inferred(model, shapes: Mapping[str, Sequence[int]]) -> Iterator[tuple[str, Sequence[int]]]:
    """(name, static shape) of every value shape inference gives one, the inputs fixed."""
    import onnx

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in fixed.graph.input:
        if value.name in shapes and value.type.HasField("tensor_type"):
            dims = value.type.tensor_type.shape
            dims.ClearField("dim")
            for d in shapes[value.name]:
                dims.dim.add().dim_value = int(d)
    try:
        inferred = onnx.shape_inference.infer_shapes(fixed)
    except Exception:  # a graph ONNX cannot infer: the importer says what is wrong with it
        return
    graph = inferred.graph
    for value in (*graph.value_info, *graph.output):
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            yield value.name, [d.dim_value for d in dims]
