"""Elementwise chains computed in their producer's shape, so that they fuse into it.

ONNX exporters flatten a MatMul's batch dimensions around the product: a transformer's
dense layer reads `reshape(x, [128, 768])`, multiplies, adds the bias and reshapes back
to `[1, 128, 768]` before the residual add, or before GELU's divide, erf, add and
multiply. A reshape is an injective operator, and TVM's FuseOps fuses only elementwise
and broadcast consumers into a matrix multiplication or convolution: the reshape ends
the fused group, and the residual add or the whole GELU chain becomes a kernel of its
own, a pass over memory each.

`sink_reshapes()` moves such a reshape below the elementwise operators that read it:
`f(reshape(t, S), ...)` becomes `reshape(f(t, ...), S)` when `f` computes position by
position (its legalized PrimFunc's TIR pattern is elementwise or broadcast: asked of
TVM, per operator and shapes, never from a list of names) and every other tensor it
reads maps to the same positions in `t`'s shape:
- a reshape of a tensor of `t`'s shape (both sides were flattened the same way),
- a tensor of the full shape `S` (it is read through a reshape to `t`'s shape, which the
  build makes a view),
- one value (a scalar constant),
- a tensor of rank k with `S[-k:] == A[-k:]` and `prod(S[:-k]) == prod(A[:-k])` (a bias
  over the trailing dimensions, which the reshape only regrouped in front of).
Applied from the top, a chain sinks step by step; the reshapes left unused are removed
(`DeadCodeElimination`). The last reshape of a chain meets the next matrix
multiplication's flattening reshape: a reshape of a reshape is one reshape (none when it
gives back the source's shape), which the build makes a view (two in a row fused into
one function would be a copy kernel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tunefarm.models.slices import rewrite_relax_functions, static_shape, with_builder

ELEMENTWISE_PATTERNS = (0, 1)
"""TVM's TIR op patterns of position-wise operators: kElemWise, kBroadcast."""


def sink_reshapes():
    """The Relax module pass (see the module docstring)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Sink(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op):
                return call
            out = static_shape(call.ty)
            if out is None:
                return call
            if call.op.name == "relax.reshape":  # of a reshape: one reshape (none if back to the shape)
                source = self._view_of(call.args[0])
                if source is None:
                    return call
                return source if static_shape(source.ty) == out else relax.op.reshape(source, out)
            views = [self._view_of(a) for a in call.args]
            bases = {tuple(b.ty.shape.values) for b in views if b is not None}
            if len(bases) != 1:
                return call
            base = [int(d) for d in next(iter(bases))]
            args = []
            for arg, view in zip(call.args, views):
                moved = view if view is not None else _moved_operand(arg, out, base)
                if moved is None:
                    return call
                args.append(moved)
            if not position_wise(call):
                return call
            inner = self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))
            if static_shape(inner.ty) != tuple(base):
                return call
            return relax.op.reshape(self.builder_.emit(inner), out)

        def _view_of(self, arg):
            """`t` when `arg` is bound to `reshape(t, S)` with `t` of a static shape."""
            if not isinstance(arg, relax.Var):
                return None
            bound = self.lookup_binding(arg)
            if not (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op) and bound.op.name == "relax.reshape"):
                return None
            source = bound.args[0]
            return source if static_shape(source.ty) is not None else None

    def _moved_operand(arg, out: tuple[int, ...], base: list[int]):
        """`arg` as read at `base`'s positions instead of `out`'s, or None if it cannot be."""
        ty = getattr(arg, "ty", None)
        if isinstance(arg, relax.Tuple) or isinstance(ty, relax.TupleType):
            return None  # tensors in a tuple: left alone
        if not isinstance(ty, relax.TensorType):
            return arg  # a shape or a value argument: unchanged
        shape = static_shape(arg.ty)
        if shape is None:
            return None
        if shape == out:
            return relax.op.reshape(arg, base)
        if math.prod(shape) == 1 or _regrouped_in_front(shape, out, base):
            return arg
        return None

    @tvm.transform.module_pass(opt_level=0, name="SinkReshapes")
    def sink(mod, _ctx):
        out = rewrite_relax_functions(mod, lambda f, m: with_builder(_Sink, f, m))
        return relax.transform.DeadCodeElimination()(out)

    return sink


def _regrouped_in_front(shape: Sequence[int], out: Sequence[int], base: Sequence[int]) -> bool:
    """Whether a tensor of `shape`, broadcast against `out`, reads the same values at each
    position once `out` is regrouped into `base`: the dimensions it spans are trailing
    ones that `out` and `base` share, and what lies in front holds as many elements."""
    k = len(shape)
    if k == 0:
        return True
    if k > len(out) or k > len(base):
        return False
    return tuple(out[-k:]) == tuple(base[-k:]) and math.prod(out[:-k]) == math.prod(base[:-k])


def position_wise(call) -> bool:
    """Whether the operator call computes each output position from the same positions of
    its inputs (TVM legalizes it to a PrimFunc whose TIR pattern is elementwise or broadcast)."""
    import tvm
    from tvm import relax

    params = []
    for arg in call.args:
        if isinstance(getattr(arg, "ty", None), relax.TensorType) and not isinstance(arg, tvm.ir.GenericConst):
            params.append((static_shape(arg.ty), str(arg.ty.dtype)))
        else:
            params.append(None)
    return _pattern_of(call.op.name, str(call.attrs) if call.attrs is not None else "", tuple(params), call) in ELEMENTWISE_PATTERNS


_PATTERNS: dict[tuple, int] = {}
"""`_pattern_of`'s answers by (operator, attributes, shapes): a model asks for few."""


def _pattern_of(op_name: str, attrs: str, params: tuple, call) -> int:
    """The TIR op pattern of `call` legalized (cached by operator, attributes and shapes);
    -1 when it does not legalize to one PrimFunc."""
    import tvm
    from tvm import relax

    key = (op_name, attrs, params)
    if key in _PATTERNS:
        return _PATTERNS[key]
    bb = relax.BlockBuilder()
    variables = [relax.Var(f"a{i}", relax.TensorType(list(p[0]), p[1])) if p else None for i, p in enumerate(params)]
    args = [v if v is not None else a for v, a in zip(variables, call.args)]
    with bb.function("probe", [v for v in variables if v is not None]):
        out = bb.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
        bb.emit_func_output(out)
    try:
        mod = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(bb.get()))
    except tvm.error.TVMError:
        _PATTERNS[key] = -1
        return -1
    prims = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    pattern = int(prims[0].attrs["op_pattern"]) if len(prims) == 1 and prims[0].attrs and "op_pattern" in prims[0].attrs else -1
    _PATTERNS[key] = pattern
    return pattern
