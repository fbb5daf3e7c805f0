"""Kernels that take a constant operand in a rewritten layout (Ansor §4.2 "layout rewrite").

A schedule may store a constant input (a model weight; `Workload.constants`) in the order
its inner loops read it: the weight of a tiled GEMM becomes contiguous panels of the
innermost tiles. The schedule says so the way TVM's MetaSchedule does (its RewriteLayout
postproc), so that TVM's own passes understand it: a `cache_read` of the input into a new
buffer, that copy block annotated with `PREPROC_ATTR`, and a `transform_layout` of the new
buffer. The copy is the layout transform; it must run once, never in the timed kernel:

- single kernels (the builder, `kernel_library_module`): the scheduled function is split
  with Relax's `SplitLayoutRewritePreproc` into the kernel and the transform, and the
  library gets three functions:
    `main(inputs..., outputs...)`       the kernel; each rewritten input in its new layout
    `main_weight_prepack(originals..., rewritten...)`  the transform, to run once
    `main_layouts(uint8[4096])`         which inputs are rewritten, their shapes and maps,
                                        as zero-padded JSON (`KernelLayouts`)
  A library without layout rewrite has only `main`, as before.
- runners (`pretransform`): read `main_layouts`, transform the constants once, time
  `main` on the transformed copies; outputs are compared with the reference as usual.
- whole models (`fold_layout_rewrites`): `SplitLayoutRewritePreproc` turns each call into
  a transform call and a kernel call, and `FoldConstant` evaluates the transforms of the
  model's constant weights at build time.

A workload may also hold such a block itself: a transform that computes a new constant
from a weight rather than copying it (a Winograd convolution's U = G g G^T,
`tunefarm.winograd`). The search leaves it out of the kernel (`ComputeDag.outside`) and
never moves it, so it is split off the same way, and the kernel takes the transformed
weight; a layout rewrite of that computed constant makes the block write it in the new
layout directly (no copy).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PREPROC_ATTR = "meta_schedule.layout_rewrite_preproc"
"""Block annotation of a layout transform (TVM's key: its split and fold passes look for it)."""

KERNEL = "main"
TRANSFORM = "main_weight_prepack"
LAYOUTS = "main_layouts"

LAYOUTS_BYTES = 4096
"""Size of the uint8 buffer `main_layouts` fills with its JSON (zero padded)."""

LAYOUTS_VERSION = 1


@dataclass(frozen=True)
class RewrittenInput:
    """One input the kernel takes in a rewritten layout."""

    input: int  # position among the kernel's inputs
    name: str
    shape: tuple[int, ...]  # the rewritten shape
    dtype: str
    mapping: str  # e.g. "B[v0, v1] -> [v1 // 128, v0 // 16, v1 % 128 // 16, v0 % 16, v1 % 16]"

    def describe(self) -> str:
        shape = ", ".join(str(s) for s in self.shape)
        return f"input {self.input} ({self.name}) as {self.dtype}[{shape}]: {self.mapping}"


@dataclass(frozen=True)
class KernelLayouts:
    """The rewritten inputs of a kernel library, in the order `main_weight_prepack` takes them."""

    rewritten: tuple[RewrittenInput, ...]

    def to_json(self) -> str:
        items = [
            {"input": r.input, "name": r.name, "shape": list(r.shape), "dtype": r.dtype, "mapping": r.mapping}
            for r in self.rewritten
        ]
        return json.dumps({"version": LAYOUTS_VERSION, "transform": TRANSFORM, "rewritten": items})

    @staticmethod
    def from_json(text: str) -> KernelLayouts:
        data = json.loads(text)
        if data.get("version") != LAYOUTS_VERSION:
            raise ValueError(
                f"layout description version {data.get('version')!r}, expected {LAYOUTS_VERSION}"
            )
        return KernelLayouts(
            tuple(
                RewrittenInput(int(r["input"]), str(r["name"]), tuple(int(s) for s in r["shape"]), str(r["dtype"]),
                               str(r["mapping"]))
                for r in data["rewritten"]
            )
        )  # fmt: skip


# -- scheduled modules ------------------------------------------------------------------------


def has_layout_rewrite(func) -> bool:
    """Whether a (scheduled) PrimFunc holds a layout-transform block."""
    import tvm_ffi
    from tvm.s_tir import SBlock

    found = []
    tvm_ffi.structural_walk(func.body, (SBlock, lambda b: found.append(PREPROC_ATTR in b.annotations)))
    return any(found)


def kernel_library_module(mod):
    """The IRModule a kernel library is compiled from: `mod` itself when its "main" has no
    layout rewrite, else {main: the kernel, main_weight_prepack: the transform,
    main_layouts: the description}."""
    import tvm

    func = mod[KERNEL]
    if not has_layout_rewrite(func):
        return mod
    kernel, transform, layouts = split_layout_rewrite(func)
    return tvm.IRModule(
        {
            KERNEL: kernel.with_attr("global_symbol", KERNEL),
            TRANSFORM: transform.with_attr("global_symbol", TRANSFORM),
            LAYOUTS: layouts_function(layouts),
        }
    )


def split_layout_rewrite(func) -> tuple[Any, Any, KernelLayouts]:
    """(kernel, transform, layouts) of a PrimFunc with layout-transform blocks, split by
    Relax's `SplitLayoutRewritePreproc` (the pass a model build uses) on a one-call wrapper."""
    from tvm import relax

    params = list(func.params)
    written = _written_buffers(func)
    n_inputs = len(params)
    while n_inputs > 0 and str(params[n_inputs - 1].name) in written:
        n_inputs -= 1
    inputs = [relax.Var(str(p.name), relax.TensorType(_shape(p), str(p.dtype))) for p in params[:n_inputs]]
    out_types = [relax.TensorType(_shape(p), str(p.dtype)) for p in params[n_inputs:]]
    bb = relax.BlockBuilder()
    with bb.function("entry", inputs):
        gv = bb.add_func(func.without_attr("global_symbol"), "kernel")
        out = bb.emit(relax.call_tir(gv, inputs, out_types if len(out_types) > 1 else out_types[0]))
        bb.emit_func_output(out)
    split = relax.transform.SplitLayoutRewritePreproc()(bb.get())
    kernel = split["kernel_prepacked"]
    transform = split["kernel_weight_prepack"]
    names = [str(p.name) for p in params[:n_inputs]]
    tparams = list(transform.params)
    half = len(tparams) // 2
    maps = _transform_maps(transform)
    rewritten = tuple(
        RewrittenInput(
            input=names.index(str(pre.name)),
            name=str(pre.name),
            shape=_shape(post),
            dtype=str(post.dtype),
            mapping=maps.get(str(post.name), ""),
        )
        for pre, post in zip(tparams[:half], tparams[half:])
    )
    return kernel, transform, KernelLayouts(rewritten)


def layouts_function(layouts: KernelLayouts):
    """A PrimFunc that writes the layouts' JSON, zero padded, into a uint8[LAYOUTS_BYTES]."""
    from tvm import tirx

    data = layouts.to_json().encode()
    if len(data) >= LAYOUTS_BYTES:
        raise ValueError(f"layout description of {len(data)} bytes does not fit {LAYOUTS_BYTES}")
    out = tirx.decl_buffer((LAYOUTS_BYTES,), "uint8", name="out")
    stmts = [
        tirx.BufferStore(out, tirx.const(b, "uint8"), [tirx.const(i, "int32")]) for i, b in enumerate(data)
    ]
    i = tirx.Var("i", "int32")
    pad = tirx.BufferStore(out, tirx.const(0, "uint8"), [i])
    stmts.append(tirx.For(i, len(data), LAYOUTS_BYTES - len(data), tirx.ForKind.SERIAL, pad))
    return tirx.PrimFunc([out], tirx.SeqStmt(stmts)).with_attr("global_symbol", LAYOUTS)


# -- libraries ----------------------------------------------------------------------------------


def read_layouts(lib) -> KernelLayouts | None:
    """The layout description of a loaded kernel library, None when it rewrites nothing."""
    import tvm

    if not lib.implements_function(LAYOUTS, True):
        return None
    buf = tvm.runtime.empty((LAYOUTS_BYTES,), "uint8", tvm.cpu(0))
    lib[LAYOUTS](buf)
    return KernelLayouts.from_json(bytes(buf.numpy()).rstrip(b"\0").decode())


def pretransform(lib, inputs: Sequence[Any]) -> list[Any]:
    """The kernel's inputs with each rewritten one replaced by its transformed copy
    (computed once here by the library's `main_weight_prepack`); `inputs` unchanged
    when the library rewrites nothing."""
    import tvm

    layouts = read_layouts(lib)
    out = list(inputs)
    if layouts is None or not layouts.rewritten:
        return out
    dev = tvm.cpu(0)
    copies = [tvm.runtime.empty(r.shape, r.dtype, dev) for r in layouts.rewritten]
    lib[TRANSFORM](*[inputs[r.input] for r in layouts.rewritten], *copies)
    for r, c in zip(layouts.rewritten, copies):
        out[r.input] = c
    return out


# -- whole models ---------------------------------------------------------------------------------


def fold_layout_rewrites(mod):
    """A Relax module whose scheduled PrimFuncs may hold layout-transform blocks, with every
    transform split into its own call and folded into the constant it transforms."""
    import tvm
    from tvm import relax

    t = relax.transform
    return tvm.transform.Sequential(
        [t.SplitLayoutRewritePreproc(), t.FoldConstant(), t.DeadCodeElimination()]
    )(mod)


# -- helpers ---------------------------------------------------------------------------------------


def _shape(buf) -> tuple[int, ...]:
    return tuple(int(s) for s in buf.shape)


def _written_buffers(func) -> set[str]:
    import tvm
    import tvm_ffi

    names: set[str] = set()
    tvm_ffi.structural_walk(func.body, (tvm.tirx.BufferStore, lambda s: names.add(str(s.buffer.name))))
    return names


def _transform_maps(transform) -> dict[str, str]:
    """{rewritten buffer: "W[v0, v1] -> [...]"} read off the transform's copy stores; a
    transform that computes its buffer (a Winograd weight transform) rather than copies
    it: "computed from W -> [...]"."""
    import tvm
    import tvm_ffi

    out: dict[str, str] = {}

    def visit(store) -> None:
        value = store.value
        dst = ", ".join(str(i) for i in store.indices)
        if isinstance(value, tvm.ir.TensorLoad):
            src = ", ".join(str(i) for i in value.indices)
            out[str(store.buffer.name)] = f"{value.source.name}[{src}] -> [{dst}]"
            return
        loads: list = []
        tvm_ffi.structural_walk(value, (tvm.ir.TensorLoad, loads.append))
        sources = sorted({str(x.source.name) for x in loads} - {str(store.buffer.name)})
        if sources:
            out.setdefault(str(store.buffer.name), f"computed from {', '.join(sources)} -> [{dst}]")

    tvm_ffi.structural_walk(transform.body, (tvm.tirx.BufferStore, visit))
    return out
