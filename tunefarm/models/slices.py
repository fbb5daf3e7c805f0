"""Concatenations and splits without copies: slices of one buffer.

A concatenation whose pieces lie back to back in memory (every dimension before the axis
is 1, as in a batch-1 NCHW channel concat) needs no copy if every piece's producer writes
straight into its slice of the output; a split of that kind is a set of views of its input.
TVM's Relax pipeline runs both as copy kernels (FuseOps fuses them with injective
neighbours at best: a Resize into the concat it feeds). In a YOLO-like detector that is
~20 kernels per inference that only move data. This module removes them.

Two steps, because fusion decides what a kernel is and memory is only explicit after the
VM lowering:

1. `mark_slice_ops()` (a Relax pass, before LegalizeOps): every `concat` and `split`
   whose slices are contiguous and 64-byte aligned (`ALIGNMENT`: the runtime hands out a
   view as an ordinary tensor only at such offsets) becomes a `call_tir` of its own
   PrimFunc, marked opaque so that FuseOps leaves it alone, with the byte offset of each
   slice in the attribute `SLICES_ATTR` and which side holds the slices in `ROLE_ATTR`
   (`"inputs"`: a concat's inputs are slices of its output; `"outputs"`: a split's).
2. `place_slices()` (a Relax pass, after CallTIRRewrite, before StaticPlanBlockMemory):
   `plan_placement` gives every tensor that is a slice of another one its place (root
   tensor, byte offset); every tree of such tensors is one allocation, its members views
   of it (`R.memory.view` + `R.memory.ensure_zero_offset`), and the copy calls whose
   slices were all placed are dropped. A concat whose pieces cannot all be placed (a piece
   is a function parameter or a constant, the same tensor twice, slices that would
   overlap unrelated tensors) keeps its copy kernel.

A tree's buffer is allocated outside the static memory planner (`R.memory.alloc_storage`):
a slice may outlive the tensor it belongs to (a feature map used after the concat that
holds it), which the planner, reusing a buffer after its tensor's last use, does not know.
The runtime's reference counts keep the buffer alive while any view of it is.

`removed_copy_calls(fused_mod)` says which calls the build drops (for task extraction: a
dropped call is no kernel to tune); it runs the same lowering and plan as the build.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SLICES_ATTR = "tunefarm.slice_offsets"
"""PrimFunc attribute of a marked concat/split: the byte offset of each slice in the whole."""

ROLE_ATTR = "tunefarm.slice_role"
"""PrimFunc attribute: "inputs" (the inputs are slices of the one output: concat) or
"outputs" (the outputs are slices of the one input: split)."""

ALIGNMENT = 64
"""Byte alignment every slice offset must have. The VM passes a view with a nonzero
byte offset to a kernel only through `ensure_zero_offset`, which moves the data pointer
for offsets that are multiples of the runtime's allocation alignment (64) and copies
otherwise (which would lose a producer's writes)."""

_OPAQUE = 8
"""TVM's OpPatternKind kOpaque: FuseOps never fuses such a function with anything."""


# -- step 1: mark ----------------------------------------------------------------------------


def contiguous_offsets(shapes: Sequence[Sequence[int]], axis: int, itemsize: int) -> list[int] | None:
    """Byte offsets of tensors of `shapes` laid back to back along `axis`, when that is how
    their concatenation lies in memory (every dimension before `axis` is 1) and every
    offset is a multiple of `ALIGNMENT`; else None."""
    if not shapes or any(len(s) != len(shapes[0]) for s in shapes):
        return None
    axis = axis % len(shapes[0])
    if any(d != 1 for s in shapes for d in s[:axis]):
        return None
    offsets, at = [], 0
    for s in shapes:
        offsets.append(at)
        n = itemsize
        for d in s:
            n *= d
        at += n
    return offsets if all(o % ALIGNMENT == 0 for o in offsets) else None


def mark_slice_ops():
    """The Relax pass of step 1 (see the module docstring)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Mark(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op):
                return call
            new = None
            if call.op.name == "relax.concat":
                new = self._concat(call)
            elif call.op.name == "relax.split":
                new = self._split(call)
            return call if new is None else new

        def _concat(self, call):
            parts = call.args[0]
            if not isinstance(parts, relax.Tuple):
                return None
            shapes = [static_shape(p.ty) for p in parts.fields]
            out = static_shape(call.ty)
            if out is None or any(s is None for s in shapes):
                return None
            dtype = str(call.ty.dtype)
            axis = int(call.attrs.axis) if call.attrs.axis is not None else 0
            offsets = contiguous_offsets(shapes, axis, _itemsize(dtype))
            if offsets is None:
                return None
            func = _concatenate_prim_func(shapes, dtype, axis)
            gv = self.builder_.add_func(_marked(func, offsets, "inputs"), "concatenate_slices")
            return relax.call_tir(gv, list(parts.fields), call.ty)

        def _split(self, call):
            data = call.args[0]
            shape = static_shape(data.ty)
            outs = [static_shape(t) for t in call.ty.fields]
            if shape is None or any(s is None for s in outs):
                return None
            dtype = str(data.ty.dtype)
            axis = int(call.attrs.axis)
            offsets = contiguous_offsets(outs, axis, _itemsize(dtype))
            if offsets is None:
                return None
            func = _split_prim_func(shape, outs, dtype, axis)
            gv = self.builder_.add_func(_marked(func, offsets, "outputs"), "split_slices")
            return relax.call_tir(gv, [data], list(call.ty.fields))

    @tvm.transform.module_pass(opt_level=0, name="MarkSliceOps")
    def mark(mod, _ctx):
        return rewrite_relax_functions(mod, lambda f, m: with_builder(_Mark, f, m))

    return mark


def _concatenate_prim_func(shapes: Sequence[Sequence[int]], dtype: str, axis: int):
    """The concatenation of tensors of `shapes` along `axis` as a PrimFunc (TE): one
    parameter per piece, then the output."""
    from tvm import te, topi

    tensors = [te.placeholder(s, dtype, f"p{i}") for i, s in enumerate(shapes)]
    return te.create_prim_func([*tensors, topi.concatenate(tensors, axis)])


def _split_prim_func(shape: Sequence[int], outs: Sequence[Sequence[int]], dtype: str, axis: int):
    """The split of a tensor of `shape` along `axis` into tensors of `outs` as a PrimFunc
    (TE): the input, then one output per piece."""
    from tvm import te, topi

    x = te.placeholder(shape, dtype, "x")
    bounds = [int(s[axis % len(s)]) for s in outs]
    indices = [sum(bounds[: i + 1]) for i in range(len(bounds) - 1)]
    return te.create_prim_func([x, *topi.split(x, indices, axis)])


def keep_marks_opaque():
    """A Relax pass for after AnnotateTIROpPattern: the marked functions stay opaque
    (whatever pattern the analysis found for them), so FuseOps leaves them alone."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="KeepSliceOpsOpaque")
    def keep(mod, _ctx):
        functions = {}
        for gv, f in mod.functions.items():
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and SLICES_ATTR in f.attrs:
                f = f.with_attr("op_pattern", _OPAQUE)
            functions[gv] = f
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)

    return keep


def _marked(func, offsets: list[int], role: str):
    func = func.without_attr("global_symbol")  # the build names it after its GlobalVar
    return func.with_attrs({SLICES_ATTR: [int(o) for o in offsets], ROLE_ATTR: role, "op_pattern": _OPAQUE})


# -- step 2: plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyCall:
    """A marked concat/split call in the lowered function: `pieces` are slices of `whole`."""

    binding: int  # index of its binding in the function's flat binding list
    function: str  # the PrimFunc's GlobalVar name
    whole: str  # tensor variable names, resolved to the allocation they are
    pieces: tuple[str, ...]
    offsets: tuple[int, ...]


@dataclass
class Placement:
    """Where each placed tensor lives: `parent[v] = (u, byte offset of v in u)`."""

    parent: dict[str, tuple[str, int]] = field(default_factory=dict)
    removed: list[CopyCall] = field(default_factory=list)  # copy calls that need not run
    kept: list[CopyCall] = field(default_factory=list)  # copy calls that still copy

    def root(self, v: str) -> tuple[str, int]:
        """The tensor `v` ultimately lives in, and its byte offset there."""
        off = 0
        while v in self.parent:
            v, d = self.parent[v]
            off += d
        return v, off


def plan_placement(
    calls: Sequence[CopyCall], alloc_bytes: dict[str, int]
) -> Placement:
    """Place the slices of `calls` (in program order). `alloc_bytes` holds the size of
    every tensor the function allocates itself (only those can be placed: a parameter or
    a constant lives where the caller put it)."""
    plan = Placement()
    for call in calls:
        trial = dict(plan.parent)
        if _place(call, trial, alloc_bytes) and _disjoint(trial, alloc_bytes):
            plan.parent = trial
            plan.removed.append(call)
        else:
            plan.kept.append(call)
    return plan


def _place(call: CopyCall, parent: dict[str, tuple[str, int]], sizes: dict[str, int]) -> bool:
    """Add `call`'s constraints to `parent` (in place); False when they cannot hold."""
    view = Placement(parent)
    if call.whole not in sizes or len(set(call.pieces)) != len(call.pieces):
        return False
    wanted: dict[str, int] = {}  # root of a piece -> its offset in `whole`
    for piece, off in zip(call.pieces, call.offsets):
        root, inner = view.root(piece)
        at = off - inner
        if root not in sizes or root == view.root(call.whole)[0] or wanted.get(root, at) != at:
            return False
        if at < 0 or at + sizes[root] > sizes[call.whole]:
            return False
        wanted[root] = at
    for root, at in wanted.items():
        parent[root] = (call.whole, at)
    return True


def _disjoint(parent: dict[str, tuple[str, int]], sizes: dict[str, int]) -> bool:
    """No two placed tensors share bytes unless one contains the other (a slice of it)."""
    view = Placement(parent)
    trees: dict[str, list[tuple[int, int, str]]] = {}
    for v in set(parent) | {p for p, _ in parent.values()}:
        root, off = view.root(v)
        trees.setdefault(root, []).append((off, off + sizes[v], v))

    def ancestors(v: str) -> set[str]:
        out = set()
        while v in parent:
            v = parent[v][0]
            out.add(v)
        return out

    for members in trees.values():
        members.sort()
        for i, (_, hi, v) in enumerate(members):
            for lo2, _, w in members[i + 1 :]:
                if lo2 >= hi:
                    break
                if v not in ancestors(w) and w not in ancestors(v):
                    return False
    return True


# -- step 2: rewrite --------------------------------------------------------------------------


@dataclass
class _Lowered:
    """What the plan needs from a lowered Relax function, by variable name."""

    bindings: list[Any]  # flat
    alloc_bytes: dict[str, int]
    alloc_binding: dict[str, int]  # allocation name -> index of its binding
    calls: list[CopyCall]


def _scan(func, mod) -> _Lowered:
    import tvm
    from tvm import relax

    alloc_op = tvm.ir.Op.get("relax.builtin.alloc_tensor")
    bindings = [b for block in func.body.blocks for b in block.bindings]
    alias: dict[str, str] = {}
    tuples: dict[str, list[str | None]] = {}
    alloc_bytes: dict[str, int] = {}
    alloc_binding: dict[str, int] = {}
    calls: list[CopyCall] = []

    def resolve(e) -> str | None:
        if not isinstance(e, relax.Var):
            return None
        return alias.get(e.name, e.name)

    for i, b in enumerate(bindings):
        name, value = b.var.name, getattr(b, "value", None)
        if isinstance(value, relax.Var):
            src = resolve(value)
            if src is not None:
                alias[name] = src
                if src in tuples:
                    tuples[name] = tuples[src]
        elif isinstance(value, relax.Tuple):
            tuples[name] = [resolve(f) for f in value.fields]
        elif isinstance(value, relax.TupleGetItem):
            fields = tuples.get(resolve(value.tuple_value) or "")
            if fields is not None and fields[value.index] is not None:
                alias[name] = fields[value.index]
        elif isinstance(value, relax.Call) and value.op.same_as(alloc_op):
            shape = static_shape(b.var.ty)
            if shape is not None:
                n = _itemsize(str(b.var.ty.dtype))
                for d in shape:
                    n *= d
                alloc_bytes[name] = n
                alloc_binding[name] = i
        elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
            callee = mod[value.op] if value.op in mod.functions else None
            attrs = getattr(callee, "attrs", None)
            if attrs is None or SLICES_ATTR not in attrs:
                continue
            args = [resolve(a) for a in value.args]
            if any(a is None for a in args):
                continue
            offsets = tuple(int(o) for o in attrs[SLICES_ATTR])
            if str(attrs[ROLE_ATTR]) == "inputs":
                whole, pieces = args[-1], args[:-1]
            else:
                whole, pieces = args[0], args[1:]
            if len(pieces) == len(offsets):
                calls.append(CopyCall(i, value.op.name_hint, whole, tuple(pieces), offsets))
    return _Lowered(bindings, alloc_bytes, alloc_binding, calls)


def place_slices():
    """The Relax pass of step 2 (see the module docstring)."""
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="PlaceSlices")
    def place(mod, _ctx):
        functions = {}
        for gv, f in mod.functions.items():
            if isinstance(f, relax.Function) and isinstance(f.body, relax.SeqExpr):
                f = _apply(f, mod)
            functions[gv] = f
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)

    return place


def _apply(func, mod):
    import tvm
    from tvm import relax
    from tvm.relax.op import memory

    low = _scan(func, mod)
    plan = plan_placement(low.calls, low.alloc_bytes)
    if not plan.removed:
        return func
    view = plan
    members: dict[str, list[str]] = {}
    for v in set(plan.parent) | {p for p, _ in plan.parent.values()}:
        members.setdefault(view.root(v)[0], []).append(v)
    dropped = {c.binding for c in plan.removed}
    first = {root: min(low.alloc_binding[v] for v in vs) for root, vs in members.items()}
    by_name = {b.var.name: b for b in low.bindings}
    root_var = {root: by_name[root].var for root in members}
    out = []
    for i, b in enumerate(low.bindings):
        for root, at in first.items():
            if at == i:  # the tree's one buffer, before its first member is allocated
                storage = relax.Var(f"{root}_storage", relax.ObjectType())
                shape = by_name[root].var.ty.shape
                dtype = str(by_name[root].var.ty.dtype)
                out.append(
                    relax.VarBinding(
                        storage,
                        memory.alloc_storage(relax.ShapeExpr([low.alloc_bytes[root]]), 0, "global", "uint8"),
                    )
                )
                out.append(relax.VarBinding(root_var[root], memory.alloc_tensor(storage, 0, shape, dtype)))
        if i in dropped:
            continue
        name = b.var.name
        if name in root_var:
            continue  # allocated with its tree above
        if name in plan.parent:
            root, off = view.root(name)
            raw = relax.Var(f"{name}_slice", b.var.ty)
            offset = relax.prim_value(tvm.tirx.IntImm("int64", off))
            out.append(relax.VarBinding(raw, memory.view(root_var[root], b.var.ty.shape, None, offset)))
            out.append(relax.VarBinding(b.var, memory.ensure_zero_offset(raw)))
            continue
        out.append(b)
    body = relax.SeqExpr([relax.BindingBlock(out)], func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def removed_copy_calls(fused_mod) -> Counter:
    """How many calls of each marked function (by GlobalVar name) the build drops."""
    import tvm
    from tvm import relax

    t = relax.transform
    lowered = tvm.transform.Sequential(
        [t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite()]
    )(fused_mod)
    counts: Counter = Counter()
    for f in lowered.functions.values():
        if isinstance(f, relax.Function) and isinstance(f.body, relax.SeqExpr):
            low = _scan(f, lowered)
            counts.update(c.function for c in plan_placement(low.calls, low.alloc_bytes).removed)
    return counts


# -- helpers ----------------------------------------------------------------------------------


def bound_constant(mutator_, expr):
    """The value (numpy) of `expr` when it is a constant or a variable a `PyExprMutator`
    saw bound to one; None otherwise."""
    import tvm
    from tvm import relax

    if isinstance(expr, relax.Var):
        expr = mutator_.lookup_binding(expr)
    return expr.value.numpy() if isinstance(expr, tvm.ir.GenericConst) else None


def static_shape(ty) -> tuple[int, ...] | None:
    """A tensor type's shape as integers; None when it has none or a symbolic dimension."""
    import tvm

    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(d, tvm.tirx.IntImm) for d in values):
        return None
    return tuple(int(d) for d in values)


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def with_builder(mutator_cls, func, mod):
    """Run a PyExprMutator over `func` with a builder on `mod` (new PrimFuncs go there)."""
    m = mutator_cls(mod)
    new = m.visit_expr(func)
    return new, m.builder_.get()


def rewrite_relax_functions(mod, rewrite):
    import tvm
    from tvm import relax

    out = mod
    for gv, f in list(mod.functions.items()):
        if isinstance(f, relax.Function):
            new, out = rewrite(f, out)
            out = tvm.IRModule(
                {g: (new if g.same_as(gv) else fn) for g, fn in out.functions.items()},
                attrs=mod.attrs,
                global_infos=mod.global_infos,
            )
    return out
