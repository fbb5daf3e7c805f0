"""Split an imported model into fused subgraphs and extract its tuning tasks.

`fuse(mod)` runs the fusion pipeline; `extract_tasks(model)` lists the distinct fused
PrimFuncs the model's "main" calls, each as an ordinary `Workload` with a weight (how
many times the model calls it). `merge_tasks` shares identical tasks between models.

The pipeline (`fusion_passes()`), in order:

- fold_constant_layouts: a reshape or transpose of a constant (ONNX convolutions' biases
  become 1xCx1x1 reshapes) becomes the reshaped or transposed constant; FoldConstant would compile one
  LLVM function per reshape (63 in the YOLO-like example: 25 of its 41 s of fusion); it
  runs again after ConvertLayout for the weights' and biases' transposes;
- FoldBatchnormToConv2D: folds an inference batch-norm into the preceding conv2d's
  weights (PyTorch-imported graphs still carry batch-norm; ONNX exports usually fold it);
- DecomposeOpsForInference: rewrites the batch-norms and layer-norms left into
  elementwise arithmetic that fuses with its neighbours;
- CanonicalizeBindings: removes the variable-to-variable bindings the decomposition
  leaves; without it FuseOps does not fuse the ReLU after a decomposed batch-norm;
- ConvertLayout (`CONV_LAYOUTS`): 2-D convolutions compute in NHWC with OHWI weights,
  and the layout propagates through the ops between them (elementwise, pooling, resize,
  concat, split), with a transpose only where it must stop (the model's inputs and
  outputs, a reshape). Channels innermost let a kernel vectorize over output channels
  whatever the image size: at 10x10 an NCHW kernel has rows of 10 to vectorize. Measured
  on a YOLO-like model's convolutions, 32 trials each: 128->128 3x3 at 10x10 0.281 ms
  NCHW, 0.148 ms NHWC; 64->64 3x3 at 20x20 0.200 ms, 0.160 ms; 48->32 1x1 at 80x80 equal.
  A channel concat or split of an NHWC batch-1 tensor is no longer contiguous slices, so
  it is a copy kernel (mark_slice_ops still removes those that are);
- subpixel_transposed_convs (`tunefarm.models.transposed_conv`): a transposed
  convolution with constant weights computes in NHWC in sub-pixel form (no multiply-adds
  on the zeros TVM's legalization dilates the input with: 4x fewer for a 2x2/2 head);
- sink_transposes (`tunefarm.models.transpose_sinking`): a transpose moves below the
  elementwise operators that read it, so that they fuse into its producer, and two
  transposes that meet compose (none when they cancel); in MobileNetV3-Small the
  hard-swish after each convolution fused into it (68 tasks -> 51), in DBNet-style heads
  no transpose is left around the transposed convolutions; it also moves below
  reshapes, concats, splits, softmax and reductions, so a YOLO-style head's transposing
  copy per level and its softmax over a strided axis become one transpose at the output;
- sink_reshapes (`tunefarm.models.reshape_sinking`): an elementwise chain after a
  reshape (an exporter's flattened MatMul reshaped back: a transformer's GELU, its
  residual add) computes in the reshape's source shape, so that it fuses into the
  MatMul; in BERT-base's layer, 12 tasks -> 11 and no elementwise kernel left after a
  dense layer;
- conversion_passes (`tunefarm.models.precision`), only when reduced precision is asked
  for: Relax's ToMixedPrecision (float16 operands, float32 accumulation) and the weights'
  casts folded; a float32 model goes through none of it;
- mark_slice_ops (`tunefarm.models.slices`): a concat or split whose slices lie back to
  back in memory becomes a call of its own opaque function, which fusion leaves alone
  and the build replaces by views of one buffer (no copy kernel);
- LegalizeOps: every Relax operator becomes a call_tir of a TIR PrimFunc (TOPI);
- AnnotateTIROpPattern: tags each PrimFunc (elementwise, broadcast, injective,
  reduction, out-fusable such as conv2d) so that FuseOps knows what may fuse;
- keep_marks_opaque: the marked concat/split functions stay opaque;
- FoldConstant: computes everything that depends only on weights (reshaped biases,
  transposed dense weights) at compile time, so it is not a task;
- FuseOps + FuseTIR: groups e.g. conv2d+add+relu and merges each group into one
  PrimFunc; FuseTIR also deduplicates structurally equal fused functions;
- DeadCodeElimination: drops the functions no longer called.

A task's workload name is derived from the function's content so that identical
subgraphs of different models get identical names and keys: FuseTIR's name with its
per-module numbering removed ("fused_conv2d10_add7_relu4" -> "fused_conv2d_add_relu")
followed by the shapes of the inputs, e.g.
"fused_conv2d_add_relu(1x64x56x56,64x64x3x3,1x64x1x1)"; `Workload.key` adds the
structural hash. Functions that only reshape (TVM's `has_reshape_pattern`) are not tasks:
the build turns their calls into views (RewriteDataflowReshape), so no kernel runs; nor
are the concat/split calls the build turns into slices of one buffer
(`tunefarm.models.slices`). They are listed in `ModelTasks.elided`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tunefarm.errors import ModelError
from tunefarm.models.precision import FP32, conversion_passes
from tunefarm.workloads.base import Workload, workload_from_prim_func

CONV_LAYOUTS = {"relax.nn.conv2d": ["NHWC", "OHWI"], "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}
"""The data and weight layouts ConvertLayout gives convolutions (see the module docstring).
A transposed convolution keeps NCHW, the only layout TVM's legalization lowers: left to
ConvertLayout's inference it would take NHWC from its producer and never be lowered.
`subpixel_transposed_convs` then computes those it can in NHWC."""

CONV_LAYOUT_CHOICES: dict[str, dict[str, list[str]] | None] = {"nhwc": CONV_LAYOUTS, "model": None}
"""The layouts a user can choose for convolutions, by name (`tunefarm tune --conv-layout`):
"nhwc" (`CONV_LAYOUTS`, the default: vectorized over channels, faster on small images)
or "model" (the model's own, e.g. NCHW: channel concats and splits stay views)."""


def fusion_passes(conv_layouts: dict[str, list[str]] | None = CONV_LAYOUTS, precision: str = FP32) -> list:
    """The passes `fuse` runs, in order (see the module docstring for why each);
    `conv_layouts=None` keeps the model's own layouts (no ConvertLayout); `precision`
    other than fp32 converts the model after its layouts, before legalization
    (`tunefarm.models.precision`)."""
    from tvm import relax

    from tunefarm.models import slices
    from tunefarm.models.reshape_sinking import sink_reshapes
    from tunefarm.models.transpose_sinking import sink_transposes
    from tunefarm.models.transposed_conv import subpixel_transposed_convs

    t = relax.transform
    layout = (
        [t.ConvertLayout(conv_layouts), fold_constant_layouts(), subpixel_transposed_convs(), sink_transposes()]
        if conv_layouts
        else []
    )
    return [
        fold_constant_layouts(),
        t.FoldBatchnormToConv2D(),
        t.DecomposeOpsForInference(),
        t.CanonicalizeBindings(),
        *layout,
        sink_reshapes(),
        *conversion_passes(precision),
        slices.mark_slice_ops(),
        t.LegalizeOps(),
        t.AnnotateTIROpPattern(),
        slices.keep_marks_opaque(),
        t.FoldConstant(),
        t.FuseOps(),
        t.FuseTIR(),
        t.DeadCodeElimination(),
    ]


def fold_constant_layouts():
    """A module pass: `R.reshape(c, shape)` and `R.permute_dims(c, axes)` of a constant `c`
    (or of a variable bound to one) -> the constant reshaped or transposed, in numpy."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from tunefarm.models.slices import bound_constant

    @mutator
    class _Fold(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            op, args = call.op, call.args
            if not isinstance(op, tvm.ir.Op) or op.name not in ("relax.reshape", "relax.permute_dims"):
                return call
            data = bound_constant(self, args[0])
            if data is None:
                return call
            if op.name == "relax.reshape":
                folded = data.reshape([int(d) for d in call.ty.shape.values])
            else:
                axes = call.attrs.axes
                folded = np.ascontiguousarray(np.transpose(data, None if axes is None else [int(a) for a in axes]))
            return relax.const(folded, str(data.dtype))

    @tvm.transform.module_pass(opt_level=0, name="FoldConstantLayouts")
    def fold(mod, _ctx):
        functions = {
            gv: _Fold().visit_expr(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()
        }
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)

    return fold


def fuse(mod, conv_layouts: dict[str, list[str]] | None = CONV_LAYOUTS, precision: str = FP32):
    """The fused module: a Relax "main" that calls one PrimFunc per fused subgraph, in
    `precision` (`tunefarm.models.precision`)."""
    import tvm

    try:
        fused = tvm.transform.Sequential(fusion_passes(conv_layouts, precision))(mod)
        if conv_layouts and _unlowered_ops(fused):
            # An operator whose lowering does not take the converted layout stays a
            # Relax operator the VM cannot run: the model's own layout, unless that
            # leaves such operators too (then the build names them).
            own = tvm.transform.Sequential(fusion_passes(None, precision))(mod)
            if len(_unlowered_ops(own)) < len(_unlowered_ops(fused)):
                return own
        return fused
    except Exception as exc:
        raise ModelError(f"fusing the model failed: {type(exc).__name__}: {_first_line(exc)}") from None


def _unlowered_ops(fused_mod) -> set[str]:
    """The Relax operators other than call_tir left in the fused module's main."""
    import tvm
    from tvm import relax

    ops: set[str] = set()

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name != "relax.call_tir":
            ops.add(e.op.name)

    relax.analysis.post_order_visit(fused_mod["main"], visit)
    return ops


@dataclass(frozen=True)
class ModelTask:
    """One distinct fused subgraph of a model, as an ordinary workload."""

    workload: Workload
    weight: int  # calls of this function per model run
    const_inputs: tuple[int, ...]  # workload input indices bound to constants (weights) in every call
    global_vars: tuple[str, ...]  # names of the fused module's PrimFuncs this task stands for

    @property
    def key(self) -> str:
        return self.workload.key

    @property
    def name(self) -> str:
        return self.workload.name

    @property
    def flops(self) -> float:
        """FLOPs of one call."""
        return self.workload.flops

    @property
    def shape_summary(self) -> str:
        """e.g. "1x64x56x56, 64x64x3x3, 1x64x1x1 -> 1x64x56x56"."""
        ins = ", ".join(_shape_text(t.shape) for t in self.workload.inputs)
        outs = ", ".join(_shape_text(t.shape) for t in self.workload.outputs)
        return f"{ins} -> {outs}"


@dataclass(frozen=True)
class TaskRow:
    """One line of a task table."""

    name: str
    key: str
    shapes: str
    weight: int
    flops: float  # one call
    total_flops: float  # weight x flops
    share: float  # total_flops / the model's FLOPs (0 when the model has none)


@dataclass(frozen=True)
class ModelTasks:
    """A fused model and its tuning tasks, in the order main first calls them."""

    name: str
    fused_mod: object  # tvm.IRModule: Relax "main" plus the fused PrimFuncs
    tasks: tuple[ModelTask, ...]
    elided: tuple[str, ...] = ()  # PrimFuncs whose calls the build turns into views (reshapes, slices)
    precision: str = FP32  # what the fused module computes in (`tunefarm.models.precision`)

    @property
    def total_flops(self) -> float:
        """FLOPs of one model run over all tasks (weights applied)."""
        return sum(t.weight * t.flops for t in self.tasks)

    def task(self, key: str) -> ModelTask:
        for t in self.tasks:
            if t.key == key:
                return t
        raise KeyError(key)

    def table(self) -> list[TaskRow]:
        total = self.total_flops
        return [
            TaskRow(
                t.name,
                t.key,
                t.shape_summary,
                t.weight,
                t.flops,
                t.weight * t.flops,
                (t.weight * t.flops / total) if total else 0.0,
            )
            for t in self.tasks
        ]


@dataclass(frozen=True)
class SharedTask:
    """A task of several models (same workload key), with each model's weight."""

    workload: Workload
    weights: tuple[tuple[str, int], ...]  # (model name, weight), in the order the models were given
    const_inputs: tuple[int, ...]  # constant in every call of every model

    @property
    def key(self) -> str:
        return self.workload.key

    @property
    def weight(self) -> int:
        return sum(w for _, w in self.weights)


def extract_tasks(
    model: Any,
    *,
    name: str | None = None,
    fused: bool = False,
    conv_layouts: dict[str, list[str]] | None = CONV_LAYOUTS,
    precision: str = FP32,
) -> ModelTasks:
    """Fuse `model` (an `ImportedModel` or a Relax IRModule) and list its tasks.

    With `fused=True` the IRModule is taken as already fused (the output of `fuse`, in
    `precision`); `conv_layouts` and `precision` are `fuse`'s.
    """
    import tvm

    mod = getattr(model, "mod", model)
    name = name or getattr(model, "name", None) or "model"
    if not isinstance(mod, tvm.IRModule) or "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelError(f"{name}: expected an IRModule with a Relax main function")
    fused_mod = mod if fused else fuse(mod, conv_layouts, precision)
    return ModelTasks(name, fused_mod, *_tasks_of(fused_mod, name), precision=precision)


def merge_tasks(models: Sequence[ModelTasks]) -> tuple[SharedTask, ...]:
    """The distinct tasks of several models, identical ones (same key) shared.

    Order: first appearance, model by model. A model given twice counts twice.
    """
    merged: dict[str, tuple[Workload, list[tuple[str, int]], set[int]]] = {}
    for m in models:
        for t in m.tasks:
            if t.key not in merged:
                merged[t.key] = (t.workload, [], set(t.const_inputs))
            wl, weights, consts = merged[t.key]
            weights.append((m.name, t.weight))
            consts &= set(t.const_inputs)
    return tuple(SharedTask(wl, tuple(w), tuple(sorted(c))) for wl, w, c in merged.values())


# -- internals ------------------------------------------------------------------------------


@dataclass
class _Group:
    func: Any
    gv_names: list[str]
    weight: int
    n_inputs: int
    consts: set[int]


def _call_tir_calls(main) -> list:
    """main's call_tir calls, in program order."""
    import tvm
    from tvm import relax

    op = tvm.ir.Op.get("relax.call_tir")
    calls: list = []
    relax.analysis.post_order_visit(
        main, lambda e: calls.append(e) if isinstance(e, relax.Call) and e.op.same_as(op) else None
    )
    return calls


def _tasks_of(fused_mod, model_name: str) -> tuple[tuple[ModelTask, ...], tuple[str, ...]]:
    import tvm
    import tvm_ffi
    from tvm import relax

    from tunefarm.models.slices import removed_copy_calls

    groups: dict[int, list[_Group]] = {}  # structural hash -> groups (equal within a list)
    order: list[_Group] = []
    elided: list[str] = []
    removed = removed_copy_calls(fused_mod)
    for call in _call_tir_calls(fused_mod["main"]):
        gv = call.args[0]
        func = fused_mod[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        if removed[gv.name_hint] > 0 or bool(relax.analysis.has_reshape_pattern(func)):
            removed[gv.name_hint] -= 1
            if gv.name_hint not in elided:
                elided.append(gv.name_hint)
            continue
        args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
        consts = {i for i, a in enumerate(args) if isinstance(a, tvm.ir.GenericConst)}
        bare = func.without_attr("global_symbol")
        h = int(tvm_ffi.structural_hash(bare))
        group = next((g for g in groups.get(h, []) if tvm_ffi.structural_equal(g.func, bare)), None)
        if group is None:
            group = _Group(bare, [], 0, len(args), consts)
            groups.setdefault(h, []).append(group)
            order.append(group)
        group.weight += 1
        group.consts &= consts
        if gv.name_hint not in group.gv_names:
            group.gv_names.append(gv.name_hint)
    tasks = []
    for g in order:
        n_outputs = len(g.func.params) - g.n_inputs
        if n_outputs <= 0:  # symbolic-shape arguments (tir_vars) or a malformed call
            raise ModelError(
                f"{model_name}: {g.gv_names[0]} is called with more arguments than it has outputs for"
            )
        shapes = [_shape_text(tuple(int(d) for d in p.shape)) for p in list(g.func.params)[: g.n_inputs]]
        wl_name = f"{canonical_name(g.gv_names[0])}({','.join(shapes)})"
        try:
            wl = workload_from_prim_func(wl_name, g.func, n_outputs=n_outputs).with_constants(g.consts)
        except Exception as exc:
            raise ModelError(
                f"{model_name}: {g.gv_names[0]} cannot be a workload: {_first_line(exc)}"
            ) from None
        tasks.append(ModelTask(wl, g.weight, tuple(sorted(g.consts)), tuple(g.gv_names)))
    return tuple(tasks), tuple(elided)


_NUMBERED = re.compile(r"(?<=[A-Za-z_])\d+$")


def canonical_name(global_name: str) -> str:
    """FuseTIR's function name without its per-module numbering:
    "fused_conv2d10_add7_relu4" -> "fused_conv2d_add_relu", "reshape4" -> "reshape"."""
    return "_".join(
        _NUMBERED.sub("", part) if not part.isdigit() else part for part in global_name.split("_")
    )


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__
