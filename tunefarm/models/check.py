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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

RTOL = 1e-3
"""Allowed error of an element relative to its reference value."""

ATOL_OF_SCALE = 1e-4
"""Allowed absolute error of every element, relative to the output's largest |reference|."""

ATOL_FLOOR = 1e-7
"""The absolute bound of an output whose reference is all zeros."""

CHECK_SEED = 0
"""Seed of the first input kind's arrays (kind i uses CHECK_SEED + i)."""


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

    @property
    def ok(self) -> bool:
        return not self.problem and self.mismatched == 0

    def describe(self) -> str:
        where = f"output {self.output} on {self.input_kind} input"
        if self.problem:
            return f"{where}: {self.problem}"
        text = f"{where}: {self.mismatched} of {self.elements} elements differ, max abs error {self.max_abs_error:.3g}"
        if self.worst is not None:
            index, got, want = self.worst
            text += f" (worst at {list(index)}: {got:.6g}, reference {want:.6g})"
        return text


def compare_output(got: np.ndarray, want: np.ndarray, *, input_kind: str, output: str) -> OutputError:
    """`got` against `want` element by element (see the module docstring)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return OutputError(input_kind, output, math.inf, math.inf, 0.0, want.size, want.size,
                           problem=f"shape {list(got.shape)}, the reference's {list(want.shape)}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    scale = float(np.max(np.abs(w), initial=0.0, where=finite))
    atol = ATOL_OF_SCALE * scale if scale > 0 else ATOL_FLOOR
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w)
        close = np.where(finite, err <= atol + RTOL * np.abs(w), (g == w) | (np.isnan(g) & np.isnan(w)))
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


def compare_outputs(
    got: Sequence[np.ndarray], want: Sequence[np.ndarray], *, input_kind: str, names: Sequence[str] | None = None
) -> list[OutputError]:
    """Every output against its reference; a count that differs is one failed entry."""
    if len(got) != len(want):
        return [OutputError(input_kind, "*", math.inf, math.inf, 0.0, 0, 0,
                            problem=f"{len(got)} outputs, the reference has {len(want)}")]
    names = list(names) if names is not None and len(names) == len(want) else [str(i) for i in range(len(want))]
    return [compare_output(g, w, input_kind=input_kind, output=n) for g, w, n in zip(got, want, names)]


@dataclass(frozen=True)
class ModelCheck:
    """A built model against its reference on every input kind."""

    reference: str  # "onnxruntime" or "torch"
    errors: tuple[OutputError, ...]  # per input kind, per output

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
            "tolerance": tolerance_report(),
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
                }
                for e in self.errors
            ],
            **({"problem": self.problem()} if not self.ok else {}),
        }


def tolerance_report() -> dict[str, Any]:
    return {
        "rtol": RTOL,
        "atol_of_scale": ATOL_OF_SCALE,
        "rule": "|out - ref| <= atol_of_scale * max|ref| + rtol * |ref|, every element",
        "inputs": {k.name: k.description for k in INPUT_KINDS},
    }


def tolerance_text() -> str:
    """The tolerance in one line, for the terminal."""
    return f"|out - ref| <= {ATOL_OF_SCALE:g} x max|ref| + {RTOL:g} x |ref| per element"


def check_model(
    run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
    reference: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
    inputs: Mapping[str, dict[str, np.ndarray]],
    *,
    reference_name: str,
    output_names: Sequence[str] | None = None,
) -> ModelCheck:
    """Run the model and the reference on each kind's inputs (`check_inputs`) and compare."""
    errors: list[OutputError] = []
    for kind, feeds in inputs.items():
        errors += compare_outputs(list(run(feeds)), list(reference(feeds)), input_kind=kind, names=output_names)
    return ModelCheck(reference_name, tuple(errors))
