"""Winograd sites of a model task: where a fused PrimFunc's 3x3 stride-1 convolution can
be computed by Winograd's F(m x m, 3 x 3) instead (`tunefarm.winograd`), and the
alternative workloads that do.

A site is found on structure alone (no operator or model names):

  the convolution  a reduction block (n, y, x, f | ry, rx, rc) whose body is
                   C[n, y, x, f] += P[n, y + ry, x + rx, rc] * W[f, ry, rx, rc] (either
                   order), initialised to 0, ry and rx of extent 3, rc over all of P's
                   and W's channels, y and x over P's rows and columns less 2: stride 1,
                   dilation 1, one group; C, P and W float32 (no casts);
  the weight       W is a parameter the workload declares constant (a model's weight:
                   its transform runs once, outside the kernel);
  the padding      P is written by a spatial block P[n, y, x, c] = if_then_else(inside,
                   D[n, y - top, x - left, c], 0) (or a `Select`, or a plain copy) whose
                   condition is exactly the box of D's rows and columns, and which no
                   other block reads; or else P is the data itself, unpadded (a parameter,
                   or what another block computes, which stays).

Each block must sit alone in its own perfect loop nest at the root (what Relax's
legalization and FuseTIR give). `winograd_alternatives(workload)` splices each tile size's
Winograd computation (`winograd_conv2d_nhwc` on D and W, writing into C) where the padding
and convolution statements were: every other block (bias, activation, residual add, ...)
is untouched, and the PrimFunc's parameters (names, shapes, dtypes, order) stay those of
the task, so an alternative's kernel takes the task's arguments. A task with no site, or
with more than one, has no alternative.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tunefarm.winograd import KERNEL, TILE_SIZES, winograd_conv2d_nhwc
from tunefarm.workloads.base import Workload, workload_from_prim_func

WINOGRAD_OUTPUT = "conv2d_winograd"
"""The name of the spliced computation's last block (the one that writes the convolution's buffer)."""


@dataclass(frozen=True)
class WinogradSite:
    """A convolution of a PrimFunc that Winograd F(m, 3) can compute (see the module docstring)."""

    conv_block: str
    pad_block: str | None  # None: the convolution reads the data unpadded
    data: str  # the buffer the padding reads (or the convolution, unpadded)
    weight: str  # a constant parameter
    output: str  # the buffer the convolution writes
    padding: tuple[int, int, int, int]  # top, left, bottom, right


def winograd_alternatives(
    workload: Workload, tile_sizes: tuple[int, ...] = TILE_SIZES
) -> tuple[Workload, ...]:
    """The task computed by Winograd F(m, 3), one workload per tile size m, when its
    PrimFunc holds exactly one Winograd site; () otherwise. Each has the task's parameters,
    constants and FLOPs (the direct convolution's work, so that throughputs compare), and
    the task's program as its `reference_mod`."""
    func = workload.mod["main"]
    sites = find_sites(func, constant_params(workload))
    if len(sites) != 1:
        return ()
    (site,) = sites
    out = []
    for m in tile_sizes:
        spliced = splice_winograd(func, site, m)
        if spliced is None:
            return ()
        alt = workload_from_prim_func(
            f"{workload.name}+winograd{m}",
            spliced,
            n_outputs=len(workload.outputs),
            flops=workload.flops,
            memory_bound=workload.memory_bound,
        ).with_constants(workload.constants)
        # its kernels are checked against the task's own (direct) program
        out.append(replace(alt, reference_mod=workload.reference_mod or workload.mod))
    return tuple(out)


def constant_params(workload: Workload) -> frozenset[str]:
    """The names of the workload's constant inputs."""
    return frozenset(workload.inputs[i].name for i in workload.constants)


def find_sites(func, constants: frozenset[str] | set[str]) -> tuple[WinogradSite, ...]:
    """The Winograd sites of a PrimFunc whose parameters named in `constants` are constant."""
    root = _root_block(func)
    if root is None:
        return ()
    blocks = [_nest_block(stmt) for stmt in _root_statements(root)]
    if any(b is None for b in blocks):  # a statement of another shape: nothing is spliced into it
        return ()
    params = {str(p.name): p for p in func.params}
    sites = []
    for block in blocks:
        conv = _convolution(block, params, constants)
        if conv is None:
            continue
        p_buf, c_buf = conv["P"], conv["C"]
        if any(b is not block and _writes(b, c_buf) for b in blocks):
            continue
        writers = [b for b in blocks if _writes(b, p_buf)]
        if len(writers) > 1:
            continue
        shared = any(b is not block and _reads(b, p_buf) for b in blocks)  # the padding must stay
        pad = _zero_padding(writers[0], p_buf) if writers and not shared else None
        if pad is None:  # no padding: the convolution reads the data (a parameter or another block's output)
            data, padding, pad_block = p_buf, (0, 0, 0, 0), None
        else:
            (data, padding), pad_block = pad, writers[0].name_hint
        sites.append(
            WinogradSite(
                block.name_hint, pad_block, str(data.name), str(conv["W"].name), str(c_buf.name), padding
            )
        )
    return tuple(sites)


def splice_winograd(func, site: WinogradSite, m: int):
    """`func` with the site's padding and convolution statements replaced by Winograd
    F(m, 3) of the same data and weight into the same buffer; None when a block name of
    the Winograd computation is already taken."""
    import tvm
    import tvm_ffi
    from tvm import te

    root_realize = func.body
    root = root_realize.block
    buffers = _buffers_by_name(func)
    data, weight, output = buffers[site.data], buffers[site.weight], buffers[site.output]
    data_t = te.placeholder(data.shape, str(data.dtype), name=str(data.name))
    weight_t = te.placeholder(weight.shape, str(weight.dtype), name=str(weight.name))
    out_t = winograd_conv2d_nhwc(data_t, weight_t, site.padding, m, name=WINOGRAD_OUTPUT)
    wino = te.create_prim_func([data_t, weight_t, out_t])
    remap = dict(zip(wino.params, (data, weight, output), strict=True))
    wino_root = wino.body.block
    wino_stmts = _root_statements(
        tvm_ffi.structural_map(wino_root, (tvm.ir.expr.Var, lambda v: remap.get(v, v)))
    )

    replaced = {site.conv_block} | ({site.pad_block} if site.pad_block else set())
    kept_names = {b.name_hint for b in _blocks(func) if b.name_hint not in replaced}
    if kept_names & {b.name_hint for b in _blocks(wino) if b.name_hint != "root"}:
        return None
    stmts = []
    for stmt in _root_statements(root):
        name = _nest_block(stmt).name_hint  # find_sites saw a block nest in every statement
        if name == site.conv_block:
            stmts.extend(wino_stmts)
        elif name != site.pad_block:
            stmts.append(stmt)
    padded = [b.writes[0].source for b in _blocks(func) if b.name_hint == site.pad_block]
    allocs = [b for b in root.alloc_buffers if not any(b.same_as(p) for p in padded)] + list(
        wino_root.alloc_buffers
    )
    new_root = tvm.s_tir.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint, tvm.tirx.SeqStmt(stmts), root.init,
        allocs, root.match_buffers, root.annotations,
    )  # fmt: skip
    return func.with_body(tvm.s_tir.SBlockRealize(root_realize.iter_values, root_realize.predicate, new_root))


# -- structure -----------------------------------------------------------------------------------


def _root_block(func):
    import tvm

    body = getattr(func, "body", None)
    if not isinstance(body, tvm.s_tir.SBlockRealize) or body.block.name_hint != "root":
        return None
    return body.block


def _root_statements(root) -> list:
    import tvm

    return list(root.body.seq) if isinstance(root.body, tvm.tirx.SeqStmt) else [root.body]


def _blocks(func) -> list:
    import tvm
    import tvm_ffi

    found: list = []
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, found.append))
    return found


def _buffers_by_name(func) -> dict[str, Any]:
    """The parameters and the root block's buffers, by name."""
    return {str(b.name): b for b in [*func.body.block.alloc_buffers, *func.params]}


def _nest_block(stmt):
    """The block of a perfect loop nest `for ...: block` whose block iterators are bound
    to the loops one to one, in order, over their whole extents; None otherwise."""
    import tvm

    loops = []
    while isinstance(stmt, tvm.tirx.For):
        loops.append(stmt)
        stmt = stmt.body
    if not isinstance(stmt, tvm.s_tir.SBlockRealize) or not _is_true(stmt.predicate):
        return None
    block = stmt.block
    if len(loops) != len(block.iter_vars) or len(stmt.iter_values) != len(loops):
        return None
    for loop, value, iv in zip(loops, stmt.iter_values, block.iter_vars, strict=True):
        if not value.same_as(loop.loop_var) or not _is_int(loop.min, 0) or not _is_int(iv.dom.min, 0):
            return None
        if not _is_int(loop.extent, _int(iv.dom.extent)):
            return None
    return block


def _convolution(block, params: dict[str, Any], constants) -> dict[str, Any] | None:
    """{"C", "P", "W"}: the buffers of a convolution block (see the module docstring)."""
    import tvm

    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    if sorted(kinds) != [0, 0, 0, 0, 2, 2, 2] or block.match_buffers or block.alloc_buffers:
        return None
    store = block.body
    if not isinstance(store, tvm.tirx.BufferStore) or not _is_zero_init(block.init, store):
        return None
    c_buf, out_idx = store.buffer, list(store.indices)
    value = store.value
    if not isinstance(value, tvm.tirx.Add) or len(out_idx) != 4:
        return None
    acc, prod = value.a, value.b
    if not _is_load_of(acc, c_buf, out_idx):
        acc, prod = prod, acc
    if not _is_load_of(acc, c_buf, out_idx) or not isinstance(prod, tvm.tirx.Mul):
        return None
    spatial = {iv.var: iv for iv in block.iter_vars if int(iv.iter_type) == 0}
    reduce = {iv.var: iv for iv in block.iter_vars if int(iv.iter_type) == 2}
    if not all(isinstance(i, tvm.tirx.Var) and i in spatial for i in out_idx) or len(set(out_idx)) != 4:
        return None
    n, y, x, f = out_idx
    for p_load, w_load in ((prod.a, prod.b), (prod.b, prod.a)):
        if not isinstance(p_load, tvm.ir.TensorLoad) or not isinstance(w_load, tvm.ir.TensorLoad):
            continue
        w_idx, p_idx = list(w_load.indices), list(p_load.indices)
        if len(w_idx) != 4 or len(p_idx) != 4 or not w_idx[0].same_as(f):
            continue
        ry, rx, rc = w_idx[1:]
        if (
            not all(isinstance(r, tvm.tirx.Var) and r in reduce for r in (ry, rx, rc))
            or len({ry, rx, rc}) != 3
        ):
            continue
        if not (
            p_idx[0].same_as(n)
            and p_idx[3].same_as(rc)
            and _equal(p_idx[1], y + ry)
            and _equal(p_idx[2], x + rx)
        ):
            continue
        p_buf, w_buf = p_load.source, w_load.source
        w_param = params.get(str(w_buf.name))
        if w_param is None or not w_param.same_as(w_buf) or str(w_buf.name) not in constants:
            return None
        if any(str(b.dtype) != "float32" for b in (c_buf, p_buf, w_buf)):
            return None
        ext = {v: _int(iv.dom.extent) for v, iv in {**spatial, **reduce}.items()}
        ps, ws, cs = (tuple(_int(s) for s in b.shape) for b in (p_buf, w_buf, c_buf))
        if (ext[ry], ext[rx]) != (KERNEL, KERNEL) or ws != (ext[f], KERNEL, KERNEL, ext[rc]):
            return None
        if ps != (ext[n], ext[y] + KERNEL - 1, ext[x] + KERNEL - 1, ext[rc]) or cs != (
            ext[n],
            ext[y],
            ext[x],
            ext[f],
        ):
            return None
        return {"C": c_buf, "P": p_buf, "W": w_buf}
    return None


def _zero_padding(block, p_buf):
    """(data buffer, (top, left, bottom, right)) of a block that zero-pads a buffer's rows
    and columns into `p_buf` (see the module docstring); None otherwise."""
    import tvm

    if any(int(iv.iter_type) != 0 for iv in block.iter_vars) or block.init is not None or block.match_buffers:
        return None
    store = block.body
    if (
        not isinstance(store, tvm.tirx.BufferStore)
        or not store.buffer.same_as(p_buf)
        or len(block.iter_vars) != 4
    ):
        return None
    vs = [iv.var for iv in block.iter_vars]
    if not all(i.same_as(v) for i, v in zip(store.indices, vs, strict=True)):
        return None
    value, cond = store.value, None
    if isinstance(value, tvm.tirx.Select):
        cond, load, zero = value.condition, value.true_value, value.false_value
    elif isinstance(value, tvm.ir.expr.Call) and str(value.op.name).endswith("if_then_else"):
        cond, load, zero = value.args
    else:
        load, zero = value, tvm.tirx.const(0.0, "float32")
    if not isinstance(load, tvm.ir.TensorLoad) or not _is_float(zero, 0.0) or len(load.indices) != 4:
        return None
    data = load.source
    offsets = [_constant(idx - v) for idx, v in zip(load.indices, vs, strict=True)]
    if any(o is None for o in offsets) or offsets[0] != 0 or offsets[3] != 0 or str(data.dtype) != "float32":
        return None
    ds, ps = tuple(_int(s) for s in data.shape), tuple(_int(s) for s in p_buf.shape)
    top, left = -offsets[1], -offsets[2]
    padding = (top, left, ps[1] - ds[1] - top, ps[2] - ds[2] - left)
    if ds[0] != ps[0] or ds[3] != ps[3] or min(padding) < 0:
        return None
    box = [(0, ps[0]), (top, top + ds[1]), (left, left + ds[2]), (0, ps[3])]
    if cond is None:
        return (data, padding) if padding == (0, 0, 0, 0) else None
    bounds = _box_of(cond, vs, [(0, s) for s in ps])
    return (data, padding) if bounds == box else None


def _box_of(cond, vs, domain: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The box [lo, hi) per iterator a conjunction of `v >= c`, `v < c` (and the like)
    leaves of `domain`; None when a term is of another form."""
    import tvm

    box = list(domain)
    terms, stack = [], [cond]
    while stack:
        t = stack.pop()
        if isinstance(t, tvm.tirx.And):
            stack += [t.a, t.b]
        else:
            terms.append(t)
    for t in terms:
        if not isinstance(t, (tvm.tirx.LE, tvm.tirx.LT, tvm.tirx.GE, tvm.tirx.GT)):
            return None
        a, b = t.a, t.b
        flip = False
        if not isinstance(a, tvm.tirx.Var):
            a, b, flip = b, a, True
        k = _constant(b)
        pos = next((i for i, v in enumerate(vs) if v.same_as(a)), None)
        if pos is None or k is None:
            return None
        # the term as `var OP k`
        op = type(t)
        if flip:
            op = {
                tvm.tirx.LE: tvm.tirx.GE,
                tvm.tirx.LT: tvm.tirx.GT,
                tvm.tirx.GE: tvm.tirx.LE,
                tvm.tirx.GT: tvm.tirx.LT,
            }[op]
        lo, hi = box[pos]
        if op is tvm.tirx.GE:
            lo = max(lo, k)
        elif op is tvm.tirx.GT:
            lo = max(lo, k + 1)
        elif op is tvm.tirx.LT:
            hi = min(hi, k)
        else:
            hi = min(hi, k + 1)
        box[pos] = (lo, hi)
    return box


def _reads(block, buf) -> bool:
    return any(r.source.same_as(buf) for r in block.reads)


def _writes(block, buf) -> bool:
    return any(w.source.same_as(buf) for w in block.writes)


def _is_zero_init(init, store) -> bool:
    import tvm

    return (
        isinstance(init, tvm.tirx.BufferStore)
        and init.buffer.same_as(store.buffer)
        and all(a.same_as(b) for a, b in zip(init.indices, store.indices, strict=True))
        and _is_float(init.value, 0.0)
    )


def _is_load_of(expr, buf, indices) -> bool:
    import tvm

    return (
        isinstance(expr, tvm.ir.TensorLoad)
        and expr.source.same_as(buf)
        and all(a.same_as(b) for a, b in zip(expr.indices, indices, strict=True))
    )


def _equal(a, b) -> bool:
    import tvm.sym

    return bool(tvm.sym.Analyzer().can_prove_equal(a, b))


def _constant(expr) -> int | None:
    import tvm
    import tvm.sym

    e = tvm.sym.Analyzer().simplify(expr)
    return int(e.value) if isinstance(e, tvm.tirx.IntImm) else None


def _is_float(expr, value: float) -> bool:
    import tvm

    return isinstance(expr, tvm.tirx.FloatImm) and float(expr.value) == value and str(expr.ty) == "float32"


def _is_int(expr, value: int) -> bool:
    import tvm

    return isinstance(expr, tvm.tirx.IntImm) and int(expr.value) == value


def _is_true(expr) -> bool:
    import tvm

    return expr is True or (isinstance(expr, tvm.tirx.IntImm) and int(expr.value) == 1)


def _int(expr) -> int:
    return int(expr)
