"""The workload as plain data: blocks, their iteration domains and their accesses.

`analyse(prim_func)` is the only place sketch generation touches TVM: it walks the
PrimFunc once and returns a `ComputeDag` of frozen dataclasses. Rules, the loop-nest
model and the features then work on that data alone (Ansor §4.1 works on the
ComputeDAG of TE stages in the same way).

Indices are kept as `Affine` forms over the block's iteration variables; an index
that is not affine (floordiv, a gather...) is approximated by the variables it uses,
with `exact=False`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from functools import cached_property, lru_cache

import numpy as np

# ----------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Affine:
    """sum(coeff * var) + const; `terms` sorted by variable name, no zero coefficients."""

    terms: tuple[tuple[str, int], ...] = ()
    const: int = 0
    exact: bool = True

    def coeff(self, var: str) -> int:
        for v, c in self.terms:
            if v == var:
                return c
        return 0

    @property
    def vars(self) -> frozenset[str]:
        return frozenset(v for v, _ in self.terms)

    def is_single_var(self) -> str | None:
        """The variable when the form is exactly `var` (coefficient 1, no constant)."""
        if self.exact and self.const == 0 and len(self.terms) == 1 and self.terms[0][1] == 1:
            return self.terms[0][0]
        return None

    @staticmethod
    def of(terms: dict[str, int], const: int = 0, exact: bool = True) -> Affine:
        items = [(v, c) for v, c in terms.items() if c]
        if len(items) > 1:
            items.sort()
        return Affine(tuple(items), const, exact)

    @staticmethod
    def var(name: str) -> Affine:
        return Affine(((name, 1),), 0, True)

    def substitute(self, env: dict[str, Affine]) -> Affine:
        """Replace variables by affine forms (variables missing from `env` stay)."""
        terms = self.terms
        if len(terms) == 1 and terms[0][1] == 1 and self.const == 0 and self.exact:
            sub = env.get(terms[0][0])  # the common case: a plain iterator
            if sub is not None:
                return sub
        acc: dict[str, int] = {}
        const = self.const
        exact = self.exact
        for v, c in self.terms:
            sub = env.get(v)
            if sub is None:
                acc[v] = acc.get(v, 0) + c
                continue
            const += c * sub.const
            exact = exact and sub.exact
            for w, d in sub.terms:
                acc[w] = acc.get(w, 0) + c * d
        return Affine.of(acc, const, exact)


@dataclass(frozen=True)
class OpCounts:
    """Arithmetic in one evaluation of a block's stored value (Ansor feature group 1)."""

    float_add_sub: int = 0
    float_mul: int = 0
    float_div_mod: int = 0
    float_cmp: int = 0  # min, max, comparisons
    float_math: int = 0  # exp, log, sqrt, tanh, ... calls
    int_add_sub: int = 0
    int_mul: int = 0
    int_div_mod: int = 0
    int_cmp: int = 0
    bool_op: int = 0
    select: int = 0  # if_then_else / Select
    cast: int = 0

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_tuple(self) -> tuple[int, ...]:
        return (
            self.float_add_sub, self.float_mul, self.float_div_mod, self.float_cmp, self.float_math,
            self.int_add_sub, self.int_mul, self.int_div_mod, self.int_cmp, self.bool_op, self.select, self.cast,
        )  # fmt: skip

    def as_array(self) -> np.ndarray:
        return np.array(self.as_tuple(), dtype=np.float64)


@dataclass(frozen=True)
class IterSpec:
    name: str
    extent: int
    kind: str  # "S" spatial or "R" reduction


@dataclass(frozen=True)
class AccessSpec:
    buffer: str
    indices: tuple[Affine, ...]
    coarse: frozenset[str] = frozenset()  # iterators read only through a floordiv/floormod that merges values


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "input", "constant" (an input that is the same in every call), "output" or "intermediate"
    scope: str = "global"  # memory: "global", or on a GPU "shared" (per block) / "local" (registers)

    @property
    def elem_bytes(self) -> int:
        return _elem_bytes(self.dtype)


@lru_cache(maxsize=64)
def _elem_bytes(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize) if dtype != "bool" else 1


@dataclass(frozen=True)
class BlockSpec:
    """One leaf block: `write[...] = f(reads...)`, possibly a reduction with an init."""

    name: str
    iters: tuple[IterSpec, ...]
    reads: tuple[AccessSpec, ...]  # without a reduction's read of its own output
    write: AccessSpec
    ops: OpCounts
    has_init: bool = False
    has_branch: bool = False  # if_then_else / select in the value
    has_expensive_op: bool = False  # exp, log, ... : Ansor does not inline these on CPU
    table_iters: tuple[str, ...] = ()  # iterators that pick entries of a constant table (`_ValueWalker`)
    multiply_accumulate: tuple[str, str] | None = None  # (a, b): `out += cast?(a[...]) * cast?(b[...])` (`_mac_operands`)

    @property
    def spatial(self) -> tuple[IterSpec, ...]:
        return tuple(it for it in self.iters if it.kind == "S")

    @property
    def reduce(self) -> tuple[IterSpec, ...]:
        return tuple(it for it in self.iters if it.kind == "R")

    @property
    def is_reduction(self) -> bool:
        return any(it.kind == "R" for it in self.iters)

    @property
    def untabled(self) -> tuple[IterSpec, ...]:
        """The iterators that pick no table entry."""
        return tuple(it for it in self.iters if it.name not in self.table_iters)

    def iter(self, name: str) -> IterSpec:
        for it in self.iters:
            if it.name == name:
                return it
        raise KeyError(name)


@dataclass(frozen=True)
class ComputeDag:
    """Blocks in program order (a topological order) and every buffer they touch.

    `outside`: the blocks left out of the kernel, each a transform of a constant input
    (annotated `PREPROC_ATTR`, e.g. a Winograd weight transform) that runs once before
    the kernel (`tunefarm.layout`); the buffer each writes is a "constant" here."""

    blocks: tuple[BlockSpec, ...]
    buffers: tuple[BufferSpec, ...]
    outside: tuple[str, ...] = ()

    @cached_property
    def _by_name(self) -> dict[str, BlockSpec]:
        return {b.name: b for b in self.blocks}

    @cached_property
    def _buffers(self) -> dict[str, BufferSpec]:
        return {b.name: b for b in self.buffers}

    @cached_property
    def _derived(self) -> dict[tuple, ComputeDag]:
        return {}

    def derived(self, step: tuple, derive: Callable[[], ComputeDag]) -> ComputeDag:
        """The DAG `derive()` gives, made once per `step` (a transform's name and
        arguments: `derive` must be a pure function of this DAG and them) and kept: every
        program of a sketch applies the same transforms to the same DAGs, and the DAGs it
        derives keep their own lookups (`block`, `buffer`) and derived DAGs."""
        out = self._derived.get(step)
        if out is None:
            out = self._derived[step] = derive()
        return out

    def block(self, name: str) -> BlockSpec:
        return self._by_name[name]

    def buffer(self, name: str) -> BufferSpec:
        return self._buffers[name]

    def has_block(self, name: str) -> bool:
        return name in self._by_name

    def writer_of(self, buffer: str) -> BlockSpec | None:
        for b in self.blocks:
            if b.write.buffer == buffer:
                return b
        return None

    def consumers(self, name: str) -> list[BlockSpec]:
        buf = self.block(name).write.buffer
        return [b for b in self.blocks if b.name != name and any(a.buffer == buf for a in b.reads)]

    def producers(self, name: str) -> list[BlockSpec]:
        out = []
        for a in self.block(name).reads:
            w = self.writer_of(a.buffer)
            if w is not None and w.name != name and w not in out:
                out.append(w)
        return out

    def is_output(self, name: str) -> bool:
        return self.buffer(self.block(name).write.buffer).role == "output"

    def replace_blocks(self, blocks: Iterable[BlockSpec], buffers: Iterable[BufferSpec] | None = None) -> ComputeDag:
        return ComputeDag(tuple(blocks), tuple(buffers) if buffers is not None else self.buffers, self.outside)


# ----------------------------------------------------------------------- the TVM walk


class UnsupportedProgram(Exception):
    """The PrimFunc has a shape the search space does not model (nested blocks...)."""


_EXPENSIVE_CALLS = ("exp", "log", "pow", "tanh", "sigmoid", "erf", "exp2", "exp10", "log2", "log10")


def analyse(func, constants: Iterable[int] = ()) -> ComputeDag:
    """Walk a PrimFunc (in the form `te.create_prim_func` or TVMScript gives) once.
    `constants`: positions of the inputs that are constant (their role is "constant").

    A block annotated `PREPROC_ATTR` (a transform of a constant input that runs once,
    outside the kernel: `tunefarm.layout`) is no block of the kernel: it is left out of
    the DAG (`ComputeDag.outside`; the schedule never touches it, so it stays at the
    root where Relax's split finds it), and the buffer it writes is a constant to the
    blocks that read it. It must read constant inputs only: UnsupportedProgram otherwise."""
    from tvm.s_tir import SBlockRealize

    from tunefarm.layout import PREPROC_ATTR

    root_realize = func.body
    if not isinstance(root_realize, SBlockRealize):
        raise UnsupportedProgram("the PrimFunc body is not a root block")
    root = root_realize.block
    buffers: dict[str, BufferSpec] = {}
    params = list(func.params)
    written = set()
    blocks: list[BlockSpec] = []
    outside: list[BlockSpec] = []
    for loops, realize in _leaf_blocks(root.body):
        spec = _block_spec(loops, realize)
        (outside if PREPROC_ATTR in realize.block.annotations else blocks).append(spec)
        written.add(spec.write.buffer)
    if not blocks:
        raise UnsupportedProgram("the PrimFunc has no blocks to schedule")
    constant = set(constants)
    for i, p in enumerate(params):
        role = "output" if str(p.name) in written else "constant" if i in constant else "input"
        buffers[str(p.name)] = _buffer_spec(p, role)
    computed_once = {b.write.buffer for b in outside}
    for b in root.alloc_buffers:
        buffers[str(b.name)] = _buffer_spec(b, "constant" if str(b.name) in computed_once else "intermediate")
    for b in outside:
        _check_outside_block(b, buffers)
    names = [b.name for b in blocks + outside]
    if len(set(names)) != len(names):
        raise UnsupportedProgram("block names are not unique")
    return ComputeDag(tuple(blocks), tuple(buffers.values()), tuple(b.name for b in outside))


def _check_outside_block(block: BlockSpec, buffers: dict[str, BufferSpec]) -> None:
    """A block run once outside the kernel reads one constant input and writes a buffer of
    the function's own (what Relax's SplitLayoutRewritePreproc splits off)."""
    read = {a.buffer for a in block.reads}
    if len(read) != 1 or buffers[next(iter(read))].role != "constant" or buffers[block.write.buffer].role != "constant":
        what = ", ".join(f"{n} ({buffers[n].role})" for n in sorted(read)) or "nothing"
        raise UnsupportedProgram(
            f"block {block.name} is marked to run once outside the kernel, so it must read one constant input "
            f"and write an intermediate buffer; it reads {what}: declare its input constant (a weight)"
        )


def _buffer_spec(buf, role: str) -> BufferSpec:
    return BufferSpec(str(buf.name), tuple(int(s) for s in buf.shape), str(buf.dtype), role)


def _leaf_blocks(stmt, loops=()):
    """Yield (enclosing loops, SBlockRealize) for every leaf block under `stmt`."""
    import tvm
    from tvm.s_tir import SBlockRealize

    if isinstance(stmt, tvm.tirx.SeqStmt):
        for s in stmt.seq:
            yield from _leaf_blocks(s, loops)
    elif isinstance(stmt, tvm.tirx.For):
        yield from _leaf_blocks(stmt.body, (*loops, stmt))
    elif isinstance(stmt, SBlockRealize):
        if not isinstance(stmt.block.body, tvm.tirx.BufferStore):
            raise UnsupportedProgram(f"block {stmt.block.name_hint} does not hold a single store")
        yield loops, stmt
    else:
        raise UnsupportedProgram(f"unsupported statement {type(stmt).__name__} between blocks")


def _block_spec(loops, realize) -> BlockSpec:
    block = realize.block
    iters = []
    for iv in block.iter_vars:
        kind = {0: "S", 2: "R"}.get(int(iv.iter_type))
        if kind is None:
            raise UnsupportedProgram(f"block {block.name_hint} has an iterator that is neither spatial nor reduction")
        iters.append(IterSpec(str(iv.var.name), int(iv.dom.extent), kind))
    # Trivial binding: loop k drives iterator k (the form TE and T.grid produce).
    loop_vars = [str(lp.loop_var.name) for lp in loops]
    bound = [str(v.name) if hasattr(v, "name") else None for v in realize.iter_values]
    if len(loops) != len(iters) or bound != loop_vars:
        raise UnsupportedProgram(f"block {block.name_hint} is not bound one loop per iterator")
    for lp, it in zip(loops, iters):
        if int(lp.extent) != it.extent:
            raise UnsupportedProgram(f"block {block.name_hint}: loop extent differs from its iterator's")
    store = block.body
    iter_names = {it.name for it in iters}
    walker = _ValueWalker(iter_names)
    walker.visit(store.value)
    write = AccessSpec(str(store.buffer.name), tuple(_affine(i, iter_names) for i in store.indices))
    reads = tuple(a for a in walker.loads if a.buffer != write.buffer)
    return BlockSpec(
        name=str(block.name_hint),
        iters=tuple(iters),
        reads=reads,
        write=write,
        ops=walker.counts(),
        has_init=block.init is not None,
        has_branch=walker.branch,
        has_expensive_op=walker.expensive,
        table_iters=tuple(it.name for it in iters if it.name in walker.table_iters),
        multiply_accumulate=_mac_operands(store, write) if block.init is not None else None,
    )


def _mac_operands(store, write: AccessSpec) -> tuple[str, str] | None:
    """The two buffers of a multiply-accumulate `out[w] = out[w] + cast?(a[...]) *
    cast?(b[...])` (a GEMM's or a convolution's body as TE writes it), None for any other
    value: what a tensor-core rule needs to know it may replace the body by an MMA."""
    import tvm

    value = store.value
    if type(value).__name__ != "Add":
        return None

    def own_load(e) -> bool:
        return isinstance(e, tvm.ir.TensorLoad) and str(e.source.name) == write.buffer

    def operand(e) -> str | None:
        if type(e).__name__ == "Cast":
            e = e.value
        return str(e.source.name) if isinstance(e, tvm.ir.TensorLoad) and not own_load(e) else None

    product = value.b if own_load(value.a) else value.a if own_load(value.b) else None
    if product is None or type(product).__name__ != "Mul":
        return None
    a, b = operand(product.a), operand(product.b)
    return (a, b) if a is not None and b is not None and a != b else None


class _ValueWalker:
    """Counts operations and collects loads in a stored value.

    Also finds the iterators that index a constant table: those a select's condition
    compares for equality with an integer constant (`iter == 3`), the form an entry of a
    constant matrix takes (`tunefarm.winograd.table_entry`). Once their loops are
    unrolled, every such select folds to a constant (the `UnrollTableStep` sketch step).
    Bounds tests (a padding's `1 <= y < 9`) are no equality and index no table."""

    def __init__(self, iter_names: set[str]):
        self.iter_names = iter_names
        self.loads: list[AccessSpec] = []
        self.n: dict[str, int] = {}
        self.branch = False
        self.expensive = False
        self.table_iters: set[str] = set()

    def _note_table_iters(self, cond) -> None:
        name = type(cond).__name__
        if name in ("And", "Or"):
            self._note_table_iters(cond.a)
            self._note_table_iters(cond.b)
        elif name == "EQ":
            for x, y in ((cond.a, cond.b), (cond.b, cond.a)):
                if type(x).__name__ == "Var" and str(x.name) in self.iter_names and type(y).__name__ == "IntImm":
                    self.table_iters.add(str(x.name))

    def counts(self) -> OpCounts:
        return OpCounts(**self.n)

    def _count(self, key: str) -> None:
        self.n[key] = self.n.get(key, 0) + 1

    def visit(self, e) -> None:
        import tvm

        name = type(e).__name__
        is_float = "float" in _dtype(e)
        prefix = "float" if is_float else "int"
        if isinstance(e, tvm.ir.TensorLoad):
            acc = AccessSpec(str(e.source.name), tuple(_affine(i, self.iter_names) for i in e.indices),
                             _coarse_iters(e.indices, self.iter_names))  # fmt: skip
            if acc not in self.loads:
                self.loads.append(acc)
            return
        if name in ("Add", "Sub"):
            self._count(f"{prefix}_add_sub")
        elif name == "Mul":
            self._count(f"{prefix}_mul")
        elif name in ("Div", "Mod", "FloorDiv", "FloorMod"):
            self._count(f"{prefix}_div_mod")
        elif name in ("Min", "Max"):
            self._count("float_cmp" if is_float else "int_cmp")
        elif name in ("EQ", "NE", "LT", "LE", "GT", "GE"):
            a_float = "float" in _dtype(e.a)
            self._count("float_cmp" if a_float else "int_cmp")
        elif name in ("And", "Or", "Not"):
            self._count("bool_op")
        elif name == "Select":
            self._count("select")
            self.branch = True
            self._note_table_iters(e.condition)
        elif name == "Cast":
            self._count("cast")
        elif name == "Call":
            op = str(getattr(e.op, "name", ""))
            short = op.split(".")[-1]
            if short == "if_then_else":
                self._count("select")
                self.branch = True
                self._note_table_iters(e.args[0])
            elif op.startswith("tirx.") or op.startswith("tir."):
                self._count("float_math" if is_float else "int_mul")
                if short in _EXPENSIVE_CALLS:
                    self.expensive = True
        for child in _children(e):
            self.visit(child)


def _children(e):
    name = type(e).__name__
    if name in ("IntImm", "FloatImm", "Var", "StringImm"):
        return ()
    if name == "Call":
        return tuple(e.args)
    if name == "Select":
        return (e.condition, e.true_value, e.false_value)
    if name == "Cast":
        return (e.value,)
    if name == "Not":
        return (e.a,)
    if hasattr(e, "a") and hasattr(e, "b"):
        return (e.a, e.b)
    return ()


def _affine(e, iter_names: set[str]) -> Affine:
    """An index expression as an Affine over block iterators (approximate if not affine)."""
    terms, const = _linear(e)
    if terms is not None:
        return Affine.of(terms, const)
    used: dict[str, int] = {}
    _collect_vars(e, used)
    return Affine.of({v: 1 for v in used if v in iter_names}, 0, exact=False)


def _linear(e) -> tuple[dict[str, int] | None, int]:
    name = type(e).__name__
    if name == "IntImm":
        return {}, int(e.value)
    if name == "Var":
        return {str(e.name): 1}, 0
    if name == "Cast":
        return _linear(e.value)
    if name in ("Add", "Sub"):
        ta, ca = _linear(e.a)
        tb, cb = _linear(e.b)
        if ta is None or tb is None:
            return None, 0
        sign = 1 if name == "Add" else -1
        out = dict(ta)
        for v, c in tb.items():
            out[v] = out.get(v, 0) + sign * c
        return out, ca + sign * cb
    if name == "Mul":
        ta, ca = _linear(e.a)
        tb, cb = _linear(e.b)
        if ta is None or tb is None:
            return None, 0
        if not ta:
            return {v: c * ca for v, c in tb.items()}, ca * cb
        if not tb:
            return {v: c * cb for v, c in ta.items()}, ca * cb
        return None, 0
    return None, 0


def _coarse_iters(indices, iter_names: set[str]) -> frozenset[str]:
    """The iterators an access reads only through `floordiv(a*v + ..., c)` or
    `floormod(a*v + ..., c)` with |a| < c: consecutive values of such an iterator read the
    same element (`y // 2`), or its values repeat (`y % 2`), so the access has reuse along
    it although it uses it (a sub-pixel convolution's input and weights)."""
    fine: set[str] = set()
    coarse: set[str] = set()

    def walk(e) -> None:
        name = type(e).__name__
        if name == "Var":
            fine.add(str(e.name))
            return
        if name in ("FloorDiv", "FloorMod") and type(e.b).__name__ == "IntImm" and int(e.b.value) > 1:
            terms, _ = _linear(e.a)
            if terms is not None:
                for v, c in terms.items():
                    (coarse if abs(c) < int(e.b.value) else fine).add(v)
                return
        for c in _children(e):
            walk(c)

    for i in indices:
        walk(i)
    return frozenset((coarse - fine) & iter_names)


def _collect_vars(e, out: dict[str, int]) -> None:
    if type(e).__name__ == "Var":
        out[str(e.name)] = 1
        return
    for c in _children(e):
        _collect_vars(c, out)
    if type(e).__name__ == "TensorLoad":
        for i in e.indices:
            _collect_vars(i, out)


# ------------------------------------------------------------ pure derived predicates


def access_misses_spatial(block: BlockSpec, access: AccessSpec) -> bool:
    """Some spatial iterator (extent > 1) does not appear in the access, or only through a
    division that merges its values (`AccessSpec.coarse`): data reuse."""
    used = set().union(*(ix.vars for ix in access.indices)) - access.coarse if access.indices else set()
    return any(it.extent > 1 and it.name not in used for it in block.spatial)


def needs_multi_level_tiling(block: BlockSpec) -> bool:
    """A reduction with data reuse (Ansor's "HasDataReuse", §4.1): some input access
    misses a spatial axis.

    Ansor also tiles spatial blocks with two such inputs (an elementwise op with
    broadcasts); MetaSchedule never tiles spatial blocks, and we follow MetaSchedule:
    tiling a broadcast add buys no reuse a vectorized row loop does not already have,
    and it multiplies the sketches (layer_norm: 18 instead of 9)."""
    if not block.is_reduction:
        return False
    return any(access_misses_spatial(block, a) for a in block.reads)


def is_simple_access(block: BlockSpec, access: AccessSpec) -> bool:
    """Every index is exact and uses at most one iterator with coefficient 1."""
    for ix in access.indices:
        if not ix.exact or len(ix.terms) > 1 or any(c != 1 for _, c in ix.terms):
            return False
    return True


def is_strictly_inlineable(dag: ComputeDag, block: BlockSpec) -> bool:
    """Ansor's CPU AlwaysInline condition: a spatial, non-output block with simple
    accesses and no branch. Ansor also keeps every block with an expensive operation
    (exp, sigmoid, ...) out of line, so that inlining never computes it more than once per
    element. We inline such a block when its single consumer reads each element once, at
    the position it writes (`fusible_consumer`): nothing is computed twice, and the
    producer's tile can then fuse that consumer. A SiLU epilogue, x * sigmoid(x), is such a
    pair; kept out of line, the sigmoid left a convolution with two consumers, so no fused
    epilogue, and a separate pass over the output whose parallel and vector annotations
    the search had to find (a YOLO-like model's 80-channel convolution spent its best
    programs in a serial, scalar sigmoid)."""
    if block.is_reduction or dag.is_output(block.name) or not dag.consumers(block.name):
        return False
    if block.has_branch:
        return False
    if block.has_expensive_op and fusible_consumer(dag, block) is None:
        return False
    if block.write.indices != tuple(Affine.of({it.name: 1}) for it in block.iters):
        return False
    return all(is_simple_access(block, a) for a in block.reads)


def is_elementwise_write(block: BlockSpec) -> bool:
    """The block writes its buffer at exactly its spatial iterators (in some order)."""
    names = [ix.is_single_var() for ix in block.write.indices]
    spatial = [it.name for it in block.spatial]
    return None not in names and sorted(names) == sorted(spatial)


def fusible_consumer(dag: ComputeDag, block: BlockSpec) -> BlockSpec | None:
    """Ansor's "single element-wise matched consumer": the only consumer is spatial and
    reads our output at exactly the position it writes its own."""
    consumers = dag.consumers(block.name)
    if len(consumers) != 1:
        return None
    c = consumers[0]
    if c.is_reduction or not is_elementwise_write(c) or not is_elementwise_write(block):
        return None
    mine = [a for a in c.reads if a.buffer == block.write.buffer]
    if len(mine) != 1 or mine[0].indices != c.write.indices:
        return None
    if tuple(int(s) for s in dag.buffer(block.write.buffer).shape) != tuple(
        int(s) for s in dag.buffer(c.write.buffer).shape
    ):
        return None
    return c


def layout_rewritable(dag: ComputeDag, block: BlockSpec) -> list[str]:
    """The constant inputs `block` may read in a layout of its own (`LayoutRewriteStep`):
    read by this block alone, by one access, each index one distinct iterator (or 0 on a
    dimension of extent 1), so that the new layout is a reordering of tile loops."""
    out = []
    for acc in block.reads:
        buf = dag.buffer(acc.buffer)
        if buf.role != "constant" or acc.buffer in out:
            continue
        if sum(a.buffer == acc.buffer for a in block.reads) != 1:
            continue
        if any(b.name != block.name and any(a.buffer == acc.buffer for a in b.reads) for b in dag.blocks):
            continue
        used: list[str] = []
        ok = True
        for ix, extent in zip(acc.indices, buf.shape):
            v = ix.is_single_var()
            if v is not None and v not in used:
                used.append(v)
            elif not (ix.exact and not ix.terms and ix.const == 0 and int(extent) == 1):
                ok = False
        if ok and used:
            out.append(acc.buffer)
    return out


def spatial_size(block: BlockSpec) -> int:
    return int(np.prod([it.extent for it in block.spatial], dtype=np.int64)) if block.spatial else 1


def reduce_size(block: BlockSpec) -> int:
    return int(np.prod([it.extent for it in block.reduce], dtype=np.int64)) if block.reduce else 1


def inline_into_consumers(dag: ComputeDag, name: str) -> ComputeDag:
    """The DAG after `compute_inline(name)`: every consumer reads what the block read,
    at composed indices, and does its arithmetic once per use."""
    return dag.derived(("inline", name), lambda: _inline_into_consumers(dag, name))


def _inline_into_consumers(dag: ComputeDag, name: str) -> ComputeDag:
    block = dag.block(name)
    out_buf = block.write.buffer
    blocks = []
    for b in dag.blocks:
        if b.name == name:
            continue
        uses = [a for a in b.reads if a.buffer == out_buf]
        if not uses:
            blocks.append(b)
            continue
        reads = [a for a in b.reads if a.buffer != out_buf]
        ops = b.ops
        for use in uses:
            env = {}
            for ix, dst in zip(block.write.indices, use.indices):
                v = ix.is_single_var()
                if v is not None:
                    env[v] = dst
            for a in block.reads:
                new = AccessSpec(a.buffer, tuple(ix.substitute(env) for ix in a.indices))
                if new not in reads:
                    reads.append(new)
            ops = ops + block.ops
        blocks.append(
            replace(
                b,
                reads=tuple(reads),
                ops=ops,
                multiply_accumulate=None if out_buf in (b.multiply_accumulate or ()) else b.multiply_accumulate,
                has_branch=b.has_branch or block.has_branch,
                has_expensive_op=b.has_expensive_op or block.has_expensive_op,
            )
        )
    return dag.replace_blocks(blocks)


def _dtype(e) -> str:
    """The scalar type of an expression (`.ty` in TVM 0.27, `.dtype` before)."""
    ty = getattr(e, "ty", None)
    if ty is not None:
        return str(ty)
    return str(getattr(e, "dtype", ""))
