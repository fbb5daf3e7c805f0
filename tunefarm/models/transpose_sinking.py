"""Transposes moved past elementwise operators, and cancelled where two meet.

ConvertLayout computes convolutions in NHWC and places a transpose (`permute_dims`)
wherever the layout must stop: before an operator that computes in the model's own
layout, after it, at the model's outputs. A transpose is a copy kernel, and it also
ends a fused group: TVM fuses only elementwise and broadcast operators into a
convolution's epilogue, so a bias, batch norm or activation after a transpose becomes
part of the copy rather than of the convolution.

`sink_transposes()` rewrites, from the top of each function:
- `f(permute_dims(t, P), ...)` -> `permute_dims(f(t, ...), P)` when `f` computes
  position by position (asked of TVM, as `reshape_sinking` does) and every other tensor
  it reads can be read in `t`'s order: a transpose of the same axes, one value, or a
  constant (transposed once, at build time);
- `permute_dims(permute_dims(t, P), Q)` -> one transpose of the composed axes, none when
  they compose to the identity;
and then a transpose that keeps every dimension longer than one in its order (e.g.
(1, 256, 256, 1) -> (1, 1, 256, 256)) becomes the reshape it is, which the build makes a
view instead of a copy kernel.
"""

from __future__ import annotations

from collections.abc import Sequence


def composed_axes(inner: Sequence[int], outer: Sequence[int]) -> tuple[int, ...]:
    """The axes of `permute_dims(permute_dims(t, inner), outer)` as one transpose of `t`."""
    return tuple(int(inner[o]) for o in outer)


def is_identity(axes: Sequence[int]) -> bool:
    return tuple(axes) == tuple(range(len(axes)))


def moves_only_unit_dims(shape: Sequence[int], axes: Sequence[int]) -> bool:
    """Whether transposing a tensor of `shape` by `axes` keeps the dimensions longer than
    one in their order (then it is a reshape: the same elements in the same order)."""
    moved = [a for a in axes if shape[a] != 1]
    return moved == sorted(moved)


def sink_transposes():
    """The Relax module pass (see the module docstring)."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from tunefarm.models.reshape_sinking import position_wise
    from tunefarm.models.slices import bound_constant, rewrite_relax_functions, static_shape, with_builder

    def axes_of(call) -> tuple[int, ...] | None:
        shape = static_shape(call.args[0].ty)
        if shape is None:
            return None
        axes = call.attrs.axes
        return tuple(range(len(shape)))[::-1] if axes is None else tuple(int(a) for a in axes)

    def is_transpose(expr) -> bool:
        return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.permute_dims"

    @mutator
    class _Sink(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op):
                return call
            if call.op.name == "relax.permute_dims":
                return self._composed(call)
            return self._sunk(call)

        def _transpose_of(self, arg):
            """(t, axes) when `arg` is bound to `permute_dims(t, axes)`."""
            if not isinstance(arg, relax.Var):
                return None
            bound = self.lookup_binding(arg)
            if not is_transpose(bound):
                return None
            axes = axes_of(bound)
            return None if axes is None else (bound.args[0], axes)

        def _composed(self, call):
            inner = self._transpose_of(call.args[0])
            outer = axes_of(call)
            if inner is None or outer is None:
                return call
            source, axes = inner[0], composed_axes(inner[1], outer)
            return source if is_identity(axes) else relax.op.permute_dims(source, list(axes))

        def _sunk(self, call):
            out = static_shape(call.ty)
            if out is None:
                return call
            transposes = [self._transpose_of(a) for a in call.args]
            found = {t[1] for t in transposes if t is not None}
            if len(found) != 1:
                return call
            axes = next(iter(found))
            if len(axes) != len(out):
                return call
            inverse = list(np.argsort(axes))
            args = []
            for arg, transpose in zip(call.args, transposes):
                if transpose is not None:
                    if static_shape(arg.ty) != out:
                        return call  # broadcast up to the output: not read position by position
                    args.append(transpose[0])
                    continue
                moved = _moved_operand(self, arg, len(out), inverse)
                if moved is None:
                    return call
                args.append(moved)
            if not position_wise(call):
                return call
            inner = self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))
            if static_shape(inner.ty) != tuple(out[i] for i in inverse):
                return call
            return relax.op.permute_dims(self.builder_.emit(inner), list(axes))

    def _moved_operand(mutator_, arg, rank: int, inverse: list[int]):
        """`arg` read in the transposed tensor's order, or None if it cannot be."""
        ty = getattr(arg, "ty", None)
        if isinstance(arg, relax.Tuple) or isinstance(ty, relax.TupleType):
            return None
        if not isinstance(ty, relax.TensorType):
            return arg  # a shape or a value argument: unchanged
        shape = static_shape(ty)
        if shape is None or len(shape) > rank:
            return None
        if int(np.prod(shape)) == 1:
            return arg
        value = bound_constant(mutator_, arg)
        if value is None:
            return None
        value = value.reshape((1,) * (rank - len(shape)) + tuple(shape))
        return relax.const(np.ascontiguousarray(value.transpose(inverse)), str(value.dtype))

    @mutator
    class _AsReshape(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not is_transpose(call):
                return call
            shape, axes, out = static_shape(call.args[0].ty), axes_of(call), static_shape(call.ty)
            if shape is None or axes is None or out is None or not moves_only_unit_dims(shape, axes):
                return call
            return relax.op.reshape(call.args[0], list(out))

    @tvm.transform.module_pass(opt_level=0, name="SinkTransposes")
    def sink(mod, _ctx):
        out = rewrite_relax_functions(mod, lambda f, m: with_builder(_Sink, f, m))
        out = relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(out))
        return rewrite_relax_functions(out, lambda f, m: with_builder(_AsReshape, f, m))

    return sink
