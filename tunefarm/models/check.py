"""The output check of a built model against its reference (onnxruntime, or the torch module).

One check for every path that ends a tuning run: `tunefarm tune` (embedded mode), the
farm's scheduler when it runs the model itself, and the farm's model runs on an agent of
another architecture (`services.scheduler.model_check`). The report shows the result as
it is (`ModelCheck.as_report`).

Inputs. A model's first layer may expect raw 8-bit pixels, values scaled to [0, 1), or
normalized (zero-mean, unit-variance) data, and nothing in an ONNX file says which. A
kernel can be right on one range and wrong on another (a polynomial outside the range it
was checked on, an accumulation that only loses precision with large positive values, a
sign-dependent select), so the model is compared on every float input drawn from each of
`INPUT_KINDS`:

    normal    standard normal N(0, 1): normalized images, embeddings, features
    uniform   uniform [0, 1): images scaled to [0, 1], masks, probabilities
    pixels    uniform [0, 255): raw 8-bit image values, the real range of a first layer
              without built-in normalization (and large activations everywhere after it)

Integer inputs are drawn from [0, 2) (valid token ids and indices for any vocabulary),
booleans are fair coins, in every kind.

Tolerance. Element by element, like `numpy.allclose`: an output element matches when

    |out - ref| <= ATOL_OF_SCALE * scale + RTOL * |ref|,    scale = max |ref| of that output

(on that input). An absolute term scaled by the output's magnitude lets values near zero
differ by float32 reassociation (tiled sums, folded batch norm); the relative term holds
every other element to 1e-3 of its own value, not of the largest one: an error that
touches only small values (the low end of a probability map, a border of an upsampled
map) cannot hide behind a large maximum. A non-finite reference element matches only the
same non-finite value. On the example models TVM's untuned build is within 2e-6 of
`scale`, so the bounds are three orders of magnitude above float32 noise.

Noise or error. Float32 noise is not always small against an output's own values: a
saturated sigmoid (outputs near 1e-5) carries the absolute rounding error of its
pre-activation, a sum of thousands of large terms, as a relative error of its output.
Two float32 engines that sum in different orders then differ beyond the tolerance
although neither is wrong. So an output that fails the tolerance is judged again against
an exact reference, the model run in float64 (`exact_onnx_reference`: the ONNX graph
converted to float64 and run by ONNX's own reference evaluator, independent of TVM and
onnxruntime; a torch module in double precision):

    max |out - exact| <= NOISE_FACTOR * max(max |ref - exact|, FLOAT32_EPS * scale)

that is, the tuned model is accepted when it is no further from the exact result than
the float32 reference itself is, within a factor of NOISE_FACTOR. The judgment applies
only while the float32 reference is itself close to the exact one (within
REFERENCE_AGREEMENT of `scale`); otherwise the tolerance's verdict stands. A wrong kernel
is orders of magnitude further from the exact result than rounding puts either engine,
and still fails.

Reduced precision. A model tuned in float16 (`tunefarm.models.precision`) is checked
against the same float32 reference with the bounds its precision gives (a `Tolerance`
other than `FLOAT32_TOLERANCE`: float16's rounding through the model's reductions, its
noise floor float16's epsilon); the report's tolerance names the precision and how the
bounds were derived.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

RTOL = 1e-3
"""Allowed error of an element relative to its reference value."""

ATOL_OF_SCALE = 1e-4
"""Allowed absolute error of every element, relative to the output's largest |reference|."""

ATOL_FLOOR = 1e-7
"""The absolute bound of an output whose reference is all zeros."""

NOISE_FACTOR = 10.0
"""How much further from the exact (float64) result than the float32 reference an output
that fails the tolerance may be and still count as summation-order noise."""

FLOAT32_EPS = float(np.finfo(np.float32).eps)
"""The noise floor of an output whose float32 reference happens to be exact: one unit in
the last place of its largest value."""

REFERENCE_AGREEMENT = 1e-2
"""The noise judgment applies while the float32 reference is within this fraction of
`scale` of the exact one (further apart, one of the references is wrong, not noisy)."""

CHECK_SEED = 0
"""Seed of the first input kind's arrays (kind i uses CHECK_SEED + i)."""


@dataclass(frozen=True)
class Tolerance:
    """The bounds of the check (see the module docstring): `rtol` of each element's own
    value, `atol_of_scale` of its output's largest |reference|, and the noise judgment's
    floor `noise_floor` (the model's rounding unit, relative to that largest value).
    `precision` names what the model computes in; `derivation`, for a reduced precision,
    how the bounds follow from it (for the report)."""

    rtol: float = RTOL
    atol_of_scale: float = ATOL_OF_SCALE
    noise_floor: float = FLOAT32_EPS
    precision: str = "fp32"
    derivation: dict[str, Any] | None = None


FLOAT32_TOLERANCE = Tolerance()
"""The check of a model computed in float32."""


@dataclass(frozen=True)
class InputKind:
    """How the float inputs of one check are drawn."""

    name: str
    description: str
    draw: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


INPUT_KINDS: tuple[InputKind, ...] = (
    InputKind("normal", "standard normal", lambda rng, shape: rng.standard_normal(shape)),
    InputKind("uniform", "uniform [0, 1)", lambda rng, shape: rng.random(shape)),
    InputKind("pixels", "uniform [0, 255)", lambda rng, shape: rng.uniform(0.0, 255.0, shape)),
)
"""The input kinds every tuned model is checked on; the first is also the timing input."""


def input_kind(name: str) -> InputKind:
    for kind in INPUT_KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"unknown input kind {name!r}; the kinds are {', '.join(k.name for k in INPUT_KINDS)}")


def random_inputs(
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, str],
    *,
    seed: int = CHECK_SEED,
    kind: str = "normal",
) -> dict[str, np.ndarray]:
    """Seeded inputs: floats drawn as `kind` says, integers in [0, 2), booleans."""
    draw = input_kind(kind).draw
    rng = np.random.default_rng(seed)
    feeds = {}
    for n, shape in shapes.items():
        dtype = np.dtype(dtypes.get(n, "float32"))
        if dtype.kind == "f":
            feeds[n] = draw(rng, tuple(shape)).astype(dtype)
        elif dtype.kind == "b":
            feeds[n] = rng.integers(0, 2, tuple(shape)).astype(bool)
        else:
            feeds[n] = rng.integers(0, 2, tuple(shape)).astype(dtype)
    return feeds


def check_inputs(shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]) -> dict[str, dict[str, np.ndarray]]:
    """One set of inputs per kind of `INPUT_KINDS`: {kind name: {input name: array}}."""
    return {
        kind.name: random_inputs(shapes, dtypes, seed=CHECK_SEED + i, kind=kind.name)
        for i, kind in enumerate(INPUT_KINDS)
    }


# -- comparing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputError:
    """How one output differs from its reference on one input kind."""

    input_kind: str
    output: str
    max_abs_error: float
    max_rel_error: float  # max_abs_error / scale
    scale: float  # max |reference| over its finite elements
    mismatched: int  # elements outside the tolerance
    elements: int
    worst: tuple[tuple[int, ...], float, float] | None = None  # (index, got, reference) of the worst mismatch
    problem: str = ""  # a shape or count that does not match
    # The noise judgment of an output that failed the tolerance (`judge_noise`): how far
    # it and the float32 reference are from the exact result, and whether that is noise.
    exact_error: float | None = None  # max |out - exact|
    reference_noise: float | None = None  # max |reference - exact|
    within_noise: bool = False

    @property
    def ok(self) -> bool:
        return not self.problem and (self.mismatched == 0 or self.within_noise)

    def describe(self) -> str:
        where = f"output {self.output} on {self.input_kind} input"
        if self.problem:
            return f"{where}: {self.problem}"
        text = f"{where}: {self.mismatched} of {self.elements} elements differ, max abs error {self.max_abs_error:.3g}"
        if self.worst is not None:
            index, got, want = self.worst
            text += f" (worst at {list(index)}: {got:.6g}, reference {want:.6g})"
        if self.exact_error is not None and self.reference_noise is not None:
            verdict = "within" if self.within_noise else "beyond"
            text += (
                f"; against float64: {self.exact_error:.3g} vs the reference's own {self.reference_noise:.3g},"
                f" {verdict} {NOISE_FACTOR:g}x its noise"
            )
        return text


def compare_output(
    got: np.ndarray, want: np.ndarray, *, input_kind: str, output: str, tolerance: Tolerance = FLOAT32_TOLERANCE
) -> OutputError:
    """`got` against `want` element by element, within `tolerance` (see the module docstring)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return OutputError(input_kind, output, math.inf, math.inf, 0.0, want.size, want.size,
                           problem=f"shape {list(got.shape)}, the reference's {list(want.shape)}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    scale = float(np.max(np.abs(w), initial=0.0, where=finite))
    atol = tolerance.atol_of_scale * scale if scale > 0 else ATOL_FLOOR
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w)
        close = np.where(finite, err <= atol + tolerance.rtol * np.abs(w), (g == w) | (np.isnan(g) & np.isnan(w)))
    bad = ~close
    err = np.where(finite, np.nan_to_num(err, nan=np.inf), np.where(close, 0.0, np.inf))
    max_abs = float(err.max()) if err.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    worst = None
    n_bad = int(bad.sum())
    if n_bad:
        flat = int(np.argmax(np.where(bad, err, -1.0)))
        at = tuple(int(i) for i in np.unravel_index(flat, w.shape))
        worst = (at, float(g[at]), float(w[at]))
    return OutputError(input_kind, output, max_abs, max_rel, scale, n_bad, int(w.size), worst)


def judge_noise(
    error: OutputError, got: np.ndarray, want: np.ndarray, exact: np.ndarray, *, noise_floor: float = FLOAT32_EPS
) -> OutputError:
    """`error` (an output that failed the tolerance) judged against the exact result: within
    noise when `got` is at most NOISE_FACTOR times further from `exact` than the float32
    reference `want` is, or than `noise_floor` of the scale (see the module docstring)."""
    if error.problem or np.shape(exact) != np.shape(want):
        return error
    e = np.asarray(exact, dtype=np.float64)
    finite = np.isfinite(e)
    if not finite.all():
        return error  # non-finite values were compared exactly already
    with np.errstate(invalid="ignore", over="ignore"):
        ours = float(np.max(np.abs(np.asarray(got, np.float64) - e), initial=0.0))
        noise = float(np.max(np.abs(np.asarray(want, np.float64) - e), initial=0.0))
    floor = noise_floor * error.scale
    agree = noise <= REFERENCE_AGREEMENT * error.scale
    within = bool(agree and math.isfinite(ours) and ours <= NOISE_FACTOR * max(noise, floor))
    return replace(error, exact_error=ours, reference_noise=noise, within_noise=within)


def compare_outputs(
    got: Sequence[np.ndarray],
    want: Sequence[np.ndarray],
    *,
    input_kind: str,
    names: Sequence[str] | None = None,
    tolerance: Tolerance = FLOAT32_TOLERANCE,
) -> list[OutputError]:
    """Every output against its reference; a count that differs is one failed entry."""
    if len(got) != len(want):
        return [OutputError(input_kind, "*", math.inf, math.inf, 0.0, 0, 0,
                            problem=f"{len(got)} outputs, the reference has {len(want)}")]
    names = list(names) if names is not None and len(names) == len(want) else [str(i) for i in range(len(want))]
    return [
        compare_output(g, w, input_kind=input_kind, output=n, tolerance=tolerance) for g, w, n in zip(got, want, names)
    ]


@dataclass(frozen=True)
class ModelCheck:
    """A built model against its reference on every input kind."""

    reference: str  # "onnxruntime" or "torch"
    errors: tuple[OutputError, ...]  # per input kind, per output
    exact_reference: str = ""  # what gave the float64 results of the noise judgment ("" if none ran)
    tolerance: Tolerance = FLOAT32_TOLERANCE

    @property
    def ok(self) -> bool:
        return bool(self.errors) and all(e.ok for e in self.errors)

    @property
    def max_abs_error(self) -> float:
        return max((e.max_abs_error for e in self.errors), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((e.max_rel_error for e in self.errors), default=0.0)

    def problem(self) -> str:
        """The first mismatch in words ("" when the check passed)."""
        return next((e.describe() for e in self.errors if not e.ok), "")

    def as_report(self) -> dict[str, Any]:
        """The check as the report stores it (plain data)."""
        return {
            "ok": self.ok,
            "reference": self.reference,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "tolerance": tolerance_report(self.tolerance),
            "outputs": [
                {
                    "input": e.input_kind,
                    "output": e.output,
                    "max_abs_error": e.max_abs_error,
                    "max_rel_error": e.max_rel_error,
                    "scale": e.scale,
                    "mismatched": e.mismatched,
                    "elements": e.elements,
                    "ok": e.ok,
                    **({"worst": {"index": list(e.worst[0]), "got": e.worst[1], "reference": e.worst[2]}}
                       if e.worst else {}),
                    **({"problem": e.problem} if e.problem else {}),
                    **(
                        {"exact_error": e.exact_error, "reference_noise": e.reference_noise, "within_noise": e.within_noise}
                        if e.exact_error is not None
                        else {}
                    ),
                }
                for e in self.errors
            ],
            **({"exact_reference": self.exact_reference} if self.exact_reference else {}),
            **({"problem": self.problem()} if not self.ok else {}),
        }


def tolerance_report(tolerance: Tolerance = FLOAT32_TOLERANCE) -> dict[str, Any]:
    """The tolerance as the report states it; a reduced precision's names the precision
    and its derivation (a float32 model's report is as it always was)."""
    reduced = tolerance != FLOAT32_TOLERANCE
    floor = f"{tolerance.precision} eps ({tolerance.noise_floor:.3g})" if reduced else "float32 eps"
    return {
        **({"precision": tolerance.precision} if reduced else {}),
        "rtol": tolerance.rtol,
        "atol_of_scale": tolerance.atol_of_scale,
        "rule": "|out - ref| <= atol_of_scale * max|ref| + rtol * |ref|, every element",
        "noise_factor": NOISE_FACTOR,
        "noise_rule": (
            f"else, per output: max|out - exact| <= noise_factor * max(max|ref - exact|, {floor} * max|ref|),"
            " exact = the model in float64"
        ),
        **({"derivation": tolerance.derivation} if reduced and tolerance.derivation else {}),
        "inputs": {k.name: k.description for k in INPUT_KINDS},
    }


def tolerance_text(tolerance: Tolerance = FLOAT32_TOLERANCE) -> str:
    """The tolerance in one line, for the terminal."""
    text = f"|out - ref| <= {tolerance.atol_of_scale:g} x max|ref| + {tolerance.rtol:g} x |ref| per element"
    return text if tolerance == FLOAT32_TOLERANCE else f"{text} ({tolerance.precision})"


def check_model(
    run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
    reference: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
    inputs: Mapping[str, dict[str, np.ndarray]],
    *,
    reference_name: str,
    output_names: Sequence[str] | None = None,
    exact: ExactReference | None = None,
    tolerance: Tolerance = FLOAT32_TOLERANCE,
) -> ModelCheck:
    """Run the model and the reference on each kind's inputs (`check_inputs`) and compare
    within `tolerance`; outputs that fail it are judged against `exact` (float64) when given."""
    errors: list[OutputError] = []
    for kind, feeds in inputs.items():
        errors += check_outputs(list(run(feeds)), list(reference(feeds)), feeds, input_kind=kind,
                                names=output_names, exact=exact, tolerance=tolerance)  # fmt: skip
    return ModelCheck(reference_name, tuple(errors), exact_name(errors, exact), tolerance)


def check_outputs(
    got: Sequence[np.ndarray],
    want: Sequence[np.ndarray],
    feeds: dict[str, np.ndarray],
    *,
    input_kind: str,
    names: Sequence[str] | None = None,
    exact: ExactReference | None = None,
    tolerance: Tolerance = FLOAT32_TOLERANCE,
) -> list[OutputError]:
    """The outputs of one input kind (`feeds`) against the reference's within `tolerance`;
    those that fail it are judged against the exact results of `feeds` when `exact` is
    given (and keep the tolerance's verdict when the exact reference cannot run this model)."""
    found = compare_outputs(got, want, input_kind=input_kind, names=names, tolerance=tolerance)
    if exact is None or all(e.ok for e in found) or len(found) != len(want):
        return found
    try:
        exact_out = list(exact.run(feeds))
    except Exception:  # no float64 run of this graph
        return found
    if len(exact_out) != len(want):
        return found
    floor = tolerance.noise_floor
    return [e if e.ok else judge_noise(e, g, w, x, noise_floor=floor) for e, g, w, x in zip(found, got, want, exact_out)]


def exact_name(errors: Sequence[OutputError], exact: ExactReference | None) -> str:
    """What gave the float64 results of `errors`' noise judgment ("" when none was made)."""
    return exact.name if exact is not None and any(e.exact_error is not None for e in errors) else ""


# -- the exact (float64) reference ---------------------------------------------------------------


@dataclass(frozen=True)
class ExactReference:
    """The model's outputs computed in float64, for the noise judgment."""

    name: str  # e.g. "ONNX reference evaluator, float64"
    run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]


def exact_onnx_reference(onnx_bytes: bytes) -> ExactReference:
    """The ONNX graph converted to float64 (`float64_onnx`) and run by ONNX's reference
    evaluator (numpy, independent of TVM and onnxruntime). The conversion is done on first
    use; a graph it cannot convert or run raises then (the check keeps its verdict)."""
    state: dict[str, Any] = {}

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if "evaluator" not in state:
            import onnx
            from onnx.reference import ReferenceEvaluator

            state["evaluator"] = ReferenceEvaluator(float64_onnx(onnx.load_from_string(onnx_bytes)))
        wide = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        return [np.asarray(x) for x in state["evaluator"].run(None, wide)]

    return ExactReference("ONNX reference evaluator, float64", run)


def exact_torch_reference(module: Any, input_names: Sequence[str]) -> ExactReference:
    """A copy of the torch module in double precision."""

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import copy

        import torch

        wide = copy.deepcopy(module).double()
        args = [torch.from_numpy(feeds[n].astype(np.float64) if feeds[n].dtype.kind == "f" else feeds[n])
                for n in input_names]
        with torch.no_grad():
            out = wide(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.detach().numpy() for o in outs]

    return ExactReference("torch, float64", run)


def float64_onnx(model: Any) -> Any:
    """A copy of the ONNX `model` computing in float64: float32 initializers, constants,
    graph inputs, outputs and value infos become float64, and casts to float32 cast to
    float64 instead (integer tensors are left alone)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    float32, float64 = TensorProto.FLOAT, TensorProto.DOUBLE

    def widen(tensor: Any) -> None:
        if tensor.data_type == float32:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))

    graphs = [wide.graph]
    while graphs:
        g = graphs.pop()
        for init in g.initializer:
            widen(init)
        for info in [*g.input, *g.output, *g.value_info]:
            if info.type.tensor_type.elem_type == float32:
                info.type.tensor_type.elem_type = float64
        for node in g.node:
            for attr in node.attribute:
                if node.op_type in ("Cast", "CastLike", "RandomNormal", "RandomUniform", "EyeLike") and attr.name in ("to", "dtype") and attr.i == float32:
                    attr.i = float64
                if attr.type == onnx.AttributeProto.TENSOR:
                    widen(attr.t)
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)
    return wide
