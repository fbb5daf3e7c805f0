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
- `reshape(permute_dims(t, P), S)` -> `permute_dims(reshape(t, S'), Q)` when every run of
  dimensions the reshape merges or splits is a run of `t`'s, in order
  (`reshape_of_transposed`): a model that flattens an NCHW tensor, `(1, C, H, W) ->
  (1, C, H*W)`, flattens the NHWC one instead;
- `concat` of tensors transposed alike -> the transpose of their concat along the
  matching axis; `split` of a transpose -> transposes of the split's parts;
- `softmax` / `log_softmax` along an axis, and `sum`, `mean`, `max`, `min`, `prod` over
  axes, of a transpose -> the transpose of the same operator along the matching axes
  (`reduced_axes_order` when the reduced dimensions are dropped);
so that the transposes ConvertLayout puts after the convolutions of a detection head
(each level concatenated, flattened, concatenated with the others, split into boxes and
classes, a softmax over the boxes' bins) travel down to the model's output as one, where
they were a transposing copy per level and a softmax over a strided axis;
and then a transpose that keeps every dimension longer than one in its order (e.g.
(1, 256, 256, 1) -> (1, 1, 256, 256)) becomes the reshape it is, which the build makes a
view instead of a copy kernel.
"""

from __future__ import annotations

import math
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


def reshape_of_transposed(shape: Sequence[int], axes: Sequence[int], out: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(s, q) such that `reshape(permute_dims(t, axes), out)` equals
    `permute_dims(reshape(t, s), q)` for a tensor `t` of `shape`, or None when there are
    none: every run of the transposed tensor's dimensions that the reshape merges or
    splits must be a run of `t`'s dimensions in the same order (dimensions of length one
    aside, which go anywhere: `s` puts the output's ones first)."""
    if math.prod(shape) != math.prod(out):
        return None
    rank = {a: r for r, a in enumerate(a for a in range(len(shape)) if shape[a] != 1)}
    moved = [rank[a] for a in axes if shape[a] != 1]  # squeezed transposed dim -> squeezed t dim
    sizes = [shape[a] for a in axes if shape[a] != 1]
    wanted = [j for j in range(len(out)) if out[j] != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(sizes):
        ins, outs, p_in, p_out = [i], [j], sizes[i], out[wanted[j]]
        i, j = i + 1, j + 1
        while p_in != p_out:
            if p_in < p_out:
                p_in *= sizes[i]
                ins.append(i)
                i += 1
            else:
                p_out *= out[wanted[j]]
                outs.append(j)
                j += 1
        groups.append((ins, outs))
    group_of: dict[int, int] = {}
    for g, (ins, _) in enumerate(groups):
        ranks = [moved[i] for i in ins]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            return None
        group_of.update((r, g) for r in ranks)
    units = [j for j in range(len(out)) if out[j] == 1]
    position = {j: k for k, j in enumerate(units)}
    s = [1] * len(units)
    done: set[int] = set()
    for r in range(len(moved)):
        g = group_of[r]
        if g in done:
            continue
        done.add(g)
        for k in groups[g][1]:
            position[wanted[k]] = len(s)
            s.append(out[wanted[k]])
    return tuple(s), tuple(position[j] for j in range(len(out)))


def reduced_axes_order(axes: Sequence[int], reduced: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For a reduction without kept dimensions over dimensions `reduced` of
    `permute_dims(t, axes)`: the dimensions of `t` to reduce instead, and the transpose
    that puts the result in the original result's order."""
    t_reduced = tuple(sorted(int(axes[a]) for a in reduced))
    kept = [a for a in range(len(axes)) if a not in t_reduced]
    return t_reduced, tuple(kept.index(int(axes[i])) for i in range(len(axes)) if i not in set(reduced))


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

    REDUCTIONS = {
        "relax.sum": lambda: relax.op.sum,
        "relax.mean": lambda: relax.op.mean,
        "relax.max": lambda: relax.op.max,
        "relax.min": lambda: relax.op.min,
        "relax.prod": lambda: relax.op.prod,
    }

    @mutator
    class _Sink(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op):
                return call
            name = call.op.name
            if name == "relax.permute_dims":
                return self._composed(call)
            if name == "relax.reshape":
                return self._reshaped(call)
            if name == "relax.concat":
                return self._concatenated(call)
            if name == "relax.split":
                return self._split(call)
            if name in ("relax.nn.softmax", "relax.nn.log_softmax"):
                return self._along_axis(call)
            if name in REDUCTIONS:
                return self._reduced(call)
            return self._sunk(call)

        def _bound(self, expr):
            """What `expr` stands for: a variable's bound value, through tuple items of
            bound tuples (a split's outputs)."""
            if isinstance(expr, relax.Var):
                bound = self.lookup_binding(expr)
                expr = expr if bound is None else bound
            if isinstance(expr, relax.TupleGetItem):
                tup = self._bound(expr.tuple_value)
                if isinstance(tup, relax.Tuple):
                    return self._bound(tup.fields[int(expr.index)])
            return expr

        def _transpose_of(self, arg):
            """(t, axes) when `arg` is bound to `permute_dims(t, axes)`."""
            if not isinstance(arg, relax.Var | relax.TupleGetItem):
                return None
            bound = self._bound(arg)
            if not is_transpose(bound):
                return None
            axes = axes_of(bound)
            return None if axes is None else (bound.args[0], axes)

        def _transposed(self, inner, axes):
            inner = self.builder_.emit(inner)
            return inner if is_identity(axes) else relax.op.permute_dims(inner, list(axes))

        def _reshaped(self, call):
            found = self._transpose_of(call.args[0])
            out = static_shape(call.ty)
            shape = None if found is None else static_shape(found[0].ty)
            if found is None or out is None or shape is None:
                return call
            moved = reshape_of_transposed(shape, found[1], out)
            if moved is None:
                return call
            s, q = moved
            return self._transposed(relax.op.reshape(found[0], list(s)), q)

        def _concatenated(self, call):
            fields = self._bound(call.args[0])
            if not isinstance(fields, relax.Tuple):
                return call
            found = [self._transpose_of(f) for f in fields.fields]
            if any(f is None for f in found) or len({f[1] for f in found}) != 1:
                return call
            axes = found[0][1]
            axis = int(call.attrs.axis) % len(axes)
            return self._transposed(relax.op.concat([f[0] for f in found], axis=axes[axis]), axes)

        def _split(self, call):
            found = self._transpose_of(call.args[0])
            if found is None:
                return call
            source, axes = found
            axis = int(call.attrs.axis) % len(axes)
            sections = call.attrs.indices_or_sections
            sections = int(sections) if isinstance(sections, tvm.tirx.IntImm | int) else [int(v) for v in sections]
            parts = self.builder_.emit(relax.op.split(source, sections, axis=axes[axis]))
            count = len(call.ty.fields)
            return relax.Tuple(
                [self.builder_.emit(relax.op.permute_dims(relax.TupleGetItem(parts, i), list(axes))) for i in range(count)]
            )

        def _along_axis(self, call):
            """softmax(permute_dims(t, P), axis=a) -> permute_dims(softmax(t, axis=P[a]), P)."""
            found = self._transpose_of(call.args[0])
            if found is None:
                return call
            source, axes = found
            axis = int(call.attrs.axis) % len(axes)
            op = relax.op.nn.softmax if call.op.name == "relax.nn.softmax" else relax.op.nn.log_softmax
            return self._transposed(op(source, axis=axes[axis]), axes)

        def _reduced(self, call):
            found = self._transpose_of(call.args[0])
            if found is None or call.attrs.axis is None:
                return call
            source, axes = found
            reduced = sorted({int(a) % len(axes) for a in call.attrs.axis})
            op = REDUCTIONS[call.op.name]()
            if bool(call.attrs.keepdims):
                t_axes = sorted(int(axes[a]) for a in reduced)
                return self._transposed(op(source, axis=t_axes, keepdims=True), axes)
            t_axes, order = reduced_axes_order(axes, reduced)
            return self._transposed(op(source, axis=list(t_axes), keepdims=False), order)

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
