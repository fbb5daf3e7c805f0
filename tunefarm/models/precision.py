"""The precision a whole model computes in: float32 (the default) or, on request, float16
operands with float32 accumulation (`tunefarm tune --precision fp16`, a farm job's
`precision`), which NVIDIA's tensor cores compute.

A model stays float32 unless the run asks for reduced precision; reduced precision is
refused for a target without tensor cores' kind of arithmetic (a CPU target:
`check_precision`). The search never chooses it: the tensor-core rule takes a block only
where its operands already are float16 (`tunefarm.search.space.tensor_core`).

The conversion (`conversion_passes`, run by `tunefarm.models.tasks.fusion_passes` after
the layout passes and before legalization) is Relax's `ToMixedPrecision(out_dtype=
"float32")`, as TVM 0.27 does it:

- matmul, dense and conv2d (its "always" ops) take float16 operands and accumulate in
  float32 (`out_dtype="float32"`), their result cast back to float16: after legalization
  and fusion a matmul task is `out[i, j] += f32(a[i, k]) * f32(b[k, j])` on float16
  inputs into a float32 buffer, followed by the fused cast and epilogue (bias, relu), the
  tensor-core form; a convolution task is the same on its window (float16 in, float32
  accumulator), which stays on the SIMT sketches (the tensor-core rule takes
  matrix multiplies only);
- elementwise ops, pooling and layer norm ("follow" ops) compute in float16 where their
  inputs are float16; softmax and the reductions it cannot prove safe ("never" ops)
  compute in float32, their inputs cast up;
- the model's inputs and outputs keep their float32 types: the first kernel casts the
  input down, the last one's result is cast up, so the built model is called and checked
  like the float32 one.

The weights' casts (`astype` of a constant) are folded into float16 constants here
(`fold_constant_casts`), in numpy: left to FoldConstant, each would be compiled into an
LLVM function of its own.

The check of a reduced-precision model (`tolerance`): float16 operands and results are
rounded to 11 significant bits, so the model is as far from the float32 reference as
that rounding carries through its layers, not as float32 reassociation puts it. With
u = FLOAT16_EPS / 2 the unit roundoff and L the reductions one inference runs (each
block that sums, once per call: a matmul, a convolution, a layer norm's mean and
variance, a softmax's sum), each element may differ by

    |out - ref| <= ROUNDINGS * u * sqrt(L) * (max|ref| + |ref|)

A reduction of float16-rounded products is off by about sqrt(2) u of its own magnitude
(the products' rounding errors random-walk as the products do), its float16 result by
u more, and an elementwise op by u; ROUNDINGS bounds one layer's share of those (a few
sigmas of the worst of many elements), and the layers' errors random-walk in turn, hence
sqrt(L). A kernel that computes something else is off by the size of its values, far
beyond this (tests/test_fp16_models.py: an injected wrong kernel fails).

float16's range ends at 65504: a model whose values grow beyond it (a BERT layer's
pre-softmax scores on the check's pixel-range inputs, uniform [0, 255)) computes inf and
NaN there, and fails its check on that input kind. That is the reduced precision's limit,
reported as such (`tunefarm.models.check`'s problem names the non-finite values), not
hidden by the tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tunefarm.errors import UsageError
from tunefarm.gpu import GpuLimits, is_gpu
from tunefarm.models.check import FLOAT32_TOLERANCE, Tolerance

FP32 = "fp32"
FP16 = "fp16"
PRECISIONS = (FP32, FP16)
"""The precisions a model may be tuned in: `FP32` (the default) computes as imported;
`FP16` converts it to float16 operands with float32 accumulation."""

FLOAT16_EPS = float(np.finfo(np.float16).eps)
"""2^-10: the gap between 1 and the next float16. Its half is the unit roundoff."""

ROUNDINGS = 8
"""One layer's float16 roundings, in units of u, that an element's error may reach (see
the module docstring). On the example models, CPU builds of their float16 conversions on
the check's inputs, the largest error was 4 u of the output's scale for the conv + matmul
+ layer norm + softmax mix (L = 6, bound 19.6 u), 1.25 u for a two-layer MLP (L = 2,
11.3 u), 1 u for small_cnn (L = 7) and a BERT-base layer (L = 14) where finite: at most
a fifth of the bound."""


def check_precision(precision: str, target: dict[str, Any], *, option: str = "--precision") -> str:
    """`precision` when `target` may compute in it; `UsageError` naming `option` for an
    unknown precision or reduced precision on a target without tensor cores (a CPU
    target, or a GPU older than sm_70)."""
    if precision not in PRECISIONS:
        raise UsageError(f"{option} {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if precision == FP32:
        return precision
    if not is_gpu(target):
        raise UsageError(
            f"{option} {precision} needs a CUDA target (float16 operands with float32 accumulation run on "
            f"NVIDIA tensor cores); the target is {target.get('kind')!r}: leave {option} at {FP32}"
        )
    if not GpuLimits.of(target).tensor_cores:
        raise UsageError(
            f"{option} {precision} needs tensor cores (sm_70 or newer); the target's arch is {target.get('arch')!r}"
        )
    return precision


def conversion_passes(precision: str) -> list:
    """The passes that convert a Relax model to `precision` (none for `FP32`)."""
    if precision == FP32:
        return []
    from tvm import relax

    t = relax.transform
    return [t.ConvertToDataflow(), t.ToMixedPrecision(out_dtype="float32"), fold_constant_casts()]


def fold_constant_casts():
    """A module pass: `R.astype(c, dtype)` of a constant `c` (or of a variable bound to
    one) -> the constant cast in numpy."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Fold(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.astype":
                return call
            data = call.args[0]
            if isinstance(data, relax.Var):
                data = self.lookup_binding(data)
            if not isinstance(data, tvm.ir.GenericConst):
                return call
            dtype = str(call.attrs.dtype)
            return relax.const(data.value.numpy().astype(dtype), dtype)

    @tvm.transform.module_pass(opt_level=0, name="FoldConstantCasts")
    def fold(mod, _ctx):
        functions = {
            gv: _Fold().visit_expr(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()
        }
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)

    return fold


# -- the check's tolerance ----------------------------------------------------------------------


def tolerance(precision: str, reductions: int) -> Tolerance:
    """The check's tolerance for a model in `precision` that runs `reductions` reducing
    blocks per inference (`reductions_per_run`): float32's for `FP32`."""
    if precision == FP32:
        return FLOAT32_TOLERANCE
    if precision != FP16:
        raise ValueError(f"no tolerance for the precision {precision!r}")
    u = FLOAT16_EPS / 2
    layers = max(1, int(reductions))
    bound = ROUNDINGS * u * math.sqrt(layers)
    derivation = {
        "unit_roundoff": u,
        "roundings_per_layer": ROUNDINGS,
        "reductions_per_run": layers,
        "rule": "rtol = atol_of_scale = roundings_per_layer * unit_roundoff * sqrt(reductions_per_run),"
        " unit_roundoff = float16 eps / 2",
    }
    return Tolerance(rtol=bound, atol_of_scale=bound, noise_floor=FLOAT16_EPS, precision=precision,
                     derivation=derivation)  # fmt: skip


def reductions_per_run(fused_mod) -> int:
    """The reducing blocks one inference of the fused model runs: per PrimFunc its blocks
    with a reduction iterator, times the calls of it in main."""
    import tvm
    import tvm_ffi
    from tvm import relax

    calls: dict[str, int] = {}
    op = tvm.ir.Op.get("relax.call_tir")

    def note(e):
        if isinstance(e, relax.Call) and e.op.same_as(op):
            calls[e.args[0].name_hint] = calls.get(e.args[0].name_hint, 0) + 1

    relax.analysis.post_order_visit(fused_mod["main"], note)
    total = 0
    for gv, func in fused_mod.functions.items():
        if gv.name_hint not in calls or not isinstance(func, tvm.tirx.PrimFunc):
            continue
        blocks: list = []
        tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, blocks.append))
        reducing = sum(any(int(iv.iter_type) == tvm.tirx.IterVar.CommReduce for iv in b.iter_vars) for b in blocks)
        total += reducing * calls[gv.name_hint]
    return total
