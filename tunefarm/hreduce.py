"""Horizontal reductions: an innermost reduction loop over contiguous elements becomes one
vector expression and a tree of shuffles, in every CPU kernel this project compiles.

Why: a reduction whose innermost loop walks a contiguous axis (a softmax's max and sum
over a row, a layer norm's mean, an rfactor's partial sums) compiles to one scalar chain
per output: `acc = acc + x[k]`, a dependent add or max per element. LLVM does not turn
such a loop into vector code on its own (without reassociation it may not reorder the
sum); where a loop over outputs surrounds it, it vectorizes that loop instead, reading
each vector lane from another row: a gather per step (`vgatherqps`), which is slow on
most x86 cores and very slow under the gather-data-sampling mitigation. A softmax over
rows of 16 (a YOLOv8 DFL head, 8400 rows) ran 64 gathers per 16 rows.

What: `rewrite()`, run on each function's body after buffers are flattened and before
TVM vectorizes and unrolls loops (`tunefarm.tir_pipeline`), rewrites

    for k in range(L):                        # serial, innermost
        C[i] = C[i] <op> f(A[a + k], B[j], ...)

where `<op>` is +, max or min, `i` does not depend on `k`, every load in `f` that depends
on `k` reads `base + k` (unit stride) and nothing else uses `k`, into

    C[i] = C[i] <op> tree(f(A[a : a + L], B[j] broadcast, ...))

with `tree` halving the vector by shuffles until one lane is left (a length that is not
a power of two first folds its chunks of the largest power of two it holds). The order of
the additions changes (pairwise instead of left to right), well inside the checks'
tolerance; max and min are exact. Loops shorter than `MIN_LANES`, longer than
`MAX_LANES`, inside a vectorized loop, or of any other shape are left alone.
"""

from __future__ import annotations

from typing import Any

MIN_LANES = 8
"""Shortest loop rewritten: below it a scalar chain is as short as the shuffle tree."""

MAX_LANES = 512
"""Longest loop rewritten (one vector expression of this many lanes)."""

_COMBINERS = ("Add", "Max", "Min")


def rewrite(body: Any) -> Any:
    """`body` with every matching reduction loop rewritten (see the module docstring)."""
    import tvm_ffi
    from tvm import tirx

    inside_vector: set[int] = set()

    def mark_vectorized(loop):
        if loop.kind == tirx.ForKind.VECTORIZED:
            tvm_ffi.structural_walk(loop.body, (tirx.For, lambda inner: inside_vector.add(inner.__chandle__())))

    tvm_ffi.structural_walk(body, (tirx.For, mark_vectorized))

    def visit(loop):
        if loop.__chandle__() in inside_vector:
            return loop
        new = _rewrite_loop(loop)
        return loop if new is None else new

    return tvm_ffi.structural_map(body, (tirx.For, visit))


def _rewrite_loop(loop) -> Any | None:
    from tvm import tirx

    if loop.kind != tirx.ForKind.SERIAL or not _is_int(loop.min, 0) or not isinstance(loop.extent, tirx.IntImm):
        return None
    if getattr(loop, "step", None) is not None and not _is_int(loop.step, 1):
        return None
    lanes = int(loop.extent.value)
    if not MIN_LANES <= lanes <= MAX_LANES or _largest_power_of_two(lanes) < 2:
        return None
    k = loop.loop_var
    init, store = _init_and_update(loop.body, k)
    if not isinstance(store, tirx.BufferStore) or _dtype(store.value).lanes != 1:
        return None
    if any(_uses(ix, k) for ix in store.indices):
        return None
    combiner = type(store.value).__name__
    if combiner not in _COMBINERS:
        return None
    acc, term = _split_accumulation(store, store.value.a, store.value.b)
    if acc is None:
        return None
    vector = _vectorize(term, k, lanes, store.buffer)
    if vector is None:
        return None
    reduced = _tree(vector, lanes, getattr(tirx, combiner))
    update = tirx.BufferStore(store.buffer, getattr(tirx, combiner)(acc, reduced), list(store.indices))
    if init is None:
        return update
    if not _is_store_to(init, store.buffer, store.indices) or _uses(init.value, k) or _reads(init.value, store.buffer):
        return None
    return tirx.SeqStmt([init, update])


def _init_and_update(body, k):
    """(None, the store) for a loop body that is one store; (the init store, the update)
    for a reduction whose init was not split off: `if k == 0: C[i] = init` then the update
    (TVM's lowering of a block's init); (None, None) otherwise."""
    from tvm import tirx

    if isinstance(body, tirx.BufferStore):
        return None, body
    if not isinstance(body, tirx.SeqStmt) or len(body.seq) != 2:
        return None, None
    guard, update = body.seq
    if not isinstance(guard, tirx.IfThenElse) or guard.else_case is not None:
        return None, None
    cond = guard.condition
    if type(cond).__name__ != "EQ" or not (cond.a.same_as(k) and _is_int(cond.b, 0)):
        return None, None
    return guard.then_case, update


def _is_store_to(stmt, buffer, indices) -> bool:
    from tvm import tirx

    return (isinstance(stmt, tirx.BufferStore) and stmt.buffer.same_as(buffer) and len(stmt.indices) == len(indices)
            and all(_same(a, b) for a, b in zip(stmt.indices, indices)))


def _split_accumulation(store, a, b):
    """(the load of the stored element, the other operand), or (None, None)."""
    for acc, term in ((a, b), (b, a)):
        if _is_load_of(acc, store.buffer, store.indices) and not _reads(term, store.buffer):
            return acc, term
    return None, None


def _vectorize(expr, k, lanes: int, written) -> Any | None:
    """`expr` over `lanes` consecutive values of `k` as one vector expression, or None
    when it has a node this rewrite does not handle or uses `k` other than as a unit-stride
    load index."""
    from tvm import ir, tirx
    from tvm.sym import detect_linear_equation

    if not _uses(expr, k):
        return tirx.Broadcast(expr, lanes)
    if isinstance(expr, ir.TensorLoad):
        if expr.source.same_as(written) or len(expr.indices) != 1:
            return None
        coeffs = detect_linear_equation(expr.indices[0], [k])
        if len(coeffs) != 2 or not _is_int(coeffs[0], 1):
            return None
        return tirx.BufferLoad(expr.source, [tirx.Ramp(coeffs[1], 1, lanes)])
    name = type(expr).__name__
    if name in ("Add", "Sub", "Mul", "Div", "Max", "Min"):
        lhs, rhs = _vectorize(expr.a, k, lanes, written), _vectorize(expr.b, k, lanes, written)
        if lhs is None or rhs is None:
            return None
        return getattr(tirx, name)(lhs, rhs)
    if name == "Cast":
        inner = _vectorize(expr.value, k, lanes, written)
        return None if inner is None else tirx.Cast(str(_dtype(expr).with_lanes(lanes)), inner)
    if name == "Call" and _is_pure_elementwise(expr):
        args = [_vectorize(arg, k, lanes, written) for arg in expr.args]
        if any(arg is None for arg in args):
            return None
        return tirx.call_intrin(str(_dtype(expr).with_lanes(lanes)), expr.op.name, *args)
    return None


_ELEMENTWISE_CALLS = frozenset({"tirx.exp", "tirx.exp2", "tirx.log", "tirx.sqrt", "tirx.rsqrt", "tirx.tanh", "tirx.sigmoid",
                                "tirx.erf", "tirx.fabs", "tirx.floor", "tirx.ceil", "tirx.round", "tirx.pow"})


def _is_pure_elementwise(call) -> bool:
    op = getattr(call.op, "name", "")
    return op in _ELEMENTWISE_CALLS


def _tree(vector, lanes: int, combine) -> Any:
    """One lane: the `combine` of all `lanes` lanes of `vector`, chunks first, then halves.
    Each level is bound to a variable (a `Let`): a tree of expressions would copy the
    level below it into both halves, doubling the expression per level."""
    from tvm import tirx

    width = _largest_power_of_two(lanes)
    levels = []  # (variable, value) pairs, each value reading the variable before it

    def bind(value):
        var = tirx.Var(f"hreduce{len(levels)}", str(_dtype(value)))
        levels.append((var, value))
        return var

    acc = bind(vector)
    if width < lanes:
        chunks = [_lanes(acc, start, width) for start in range(0, lanes, width)]
        folded = chunks[0]
        for chunk in chunks[1:]:
            folded = combine(folded, chunk)
        acc = bind(folded)
    while width > 1:
        width //= 2
        acc = combine(_lanes(acc, 0, width), _lanes(acc, width, width))
        if width > 1:
            acc = bind(acc)
    for var, value in reversed(levels):
        acc = tirx.Let(var, value, acc)
    return acc


def _lanes(vector, start: int, count: int):
    from tvm import tirx

    if start == 0 and count == _dtype(vector).lanes:
        return vector
    return tirx.Shuffle([vector], [tirx.IntImm("int32", start + i) for i in range(count)])


def _dtype(expr):
    return expr.ty.dtype


def _largest_power_of_two(n: int) -> int:
    return n & -n


def _is_int(expr, value: int) -> bool:
    from tvm import tirx

    return isinstance(expr, tirx.IntImm) and int(expr.value) == value


def _uses(expr, var) -> bool:
    import tvm_ffi
    from tvm import ir

    found = []
    tvm_ffi.structural_walk(expr, (ir.Var, lambda v: found.append(True) if v.same_as(var) else None))
    return bool(found)


def _reads(expr, buffer) -> bool:
    import tvm_ffi
    from tvm import ir

    found = []
    tvm_ffi.structural_walk(expr, (ir.TensorLoad, lambda load: found.append(True) if load.source.same_as(buffer) else None))
    return bool(found)


def _is_load_of(expr, buffer, indices) -> bool:
    from tvm import ir

    if not isinstance(expr, ir.TensorLoad) or not expr.source.same_as(buffer) or len(expr.indices) != len(indices):
        return False
    return all(_same(a, b) for a, b in zip(expr.indices, indices))


def _same(a, b) -> bool:
    import tvm_ffi

    return a.same_as(b) or tvm_ffi.structural_equal(a, b)
