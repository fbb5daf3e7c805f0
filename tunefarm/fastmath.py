"""Vectorizable float32 exp, tanh and erf for kernels built by TVM's LLVM backend.

Why: on the LLVM target TVM lowers ``tirx.exp`` to ``llvm.exp``, ``tirx.erf`` to a call
of ``erff`` and ``tirx.tanh`` to two ``llvm.exp``. LLVM has no vector code for these on
x86 (TVM's LLVM offers no vector math library): it splits every vector into lanes and
calls libm's ``expf``/``erff`` once per element (a tuned softmax had 32 ``call expf@PLT``
in its 16-lane exp loop, with spills and a ``vzeroupper`` around each). Softmax, GELU,
SiLU and sigmoid then run far below memory speed.

What: `install()` registers this module's lowerings as the ``llvm.FLowerIntrinsic`` rules
of ``tirx.exp``, ``tirx.tanh`` and ``tirx.erf`` (above TVM's own priority). TVM's
``LowerIntrin`` pass then expands every float32 call, scalar or vector, into plain
arithmetic (polynomials, bit operations, selects) that LLVM vectorizes like any other
expression. It acts at code generation, so it reaches every PrimFunc compiled for an
LLVM target in a process that called it: tuned candidates, `tvm.compile` of a whole
Relax model, MetaSchedule builds (in their worker processes, which must call it too).
``tirx.sigmoid`` needs no rule: TVM legalizes it to ``1 / (1 + exp(-x))``, which then
takes the new exp. Other dtypes (float64, float16, ...) keep TVM's lowering. (TVM does
not mark erf vectorizable, so it serializes a loop containing erf; LLVM's loop vectorizer
then vectorizes the polynomial: measured as fast as a TVM-vectorized loop.)

How (each function is a few lines below):
- exp: Cody-Waite reduction ``x = n ln2 + r``, ``|r| <= ln2/2``; ``exp(r) = 1 + r + r^2 q(r)``;
  ``2^n`` built from exponent bits in two halves, so subnormal results and the overflow
  to inf are rounded once, like libm.
- tanh: ``x + x^3 p(x^2)`` for ``|x| < 0.625``; ``1 - 2 / (exp(2|x|) + 1)`` above (no
  cancellation there: tanh >= 0.55); the sign copied from x.
- erf: a rational ``x p(x^2) / q(x^2)`` on ``|x| <= 4`` (erf rounds to 1 beyond), capped at 1;
  the sign copied from x.
- NaN is detected from the bits (integer compare) and passed through: TVM's LLVM target
  assumes no NaNs (``NoNaNsFPMath``), and a float ``x != x`` test is folded to false there.

Coefficients come from ``tools/fit_fastmath.py`` (least squares on Chebyshev nodes,
weighted for relative error, rounded to float32). Maximum relative error against float64
over *every* float32 input whose result is a normal float (an exhaustive run over all
2^32 bit patterns; ``tests/test_fastmath.py`` checks dense sweeps against these bounds):

=======  =========  ==========================================================
op       max rel    special values (all checked)
=======  =========  ==========================================================
exp      1.19e-7    NaN->NaN, exp(-inf)=0, exp(+inf)=inf, x > 88.7228 -> inf;
                    subnormal results within 0.8 subnormal ulp, 0 below -103.97
tanh     1.45e-7    NaN->NaN, tanh(+-inf)=+-1, tanh(-0)=-0, tiny x -> x
erf      3.66e-7    NaN->NaN, erf(+-inf)=+-1, erf(-0)=-0; subnormal results
                    within 0.94 subnormal ulp
sigmoid  1.92e-7    NaN->NaN, sigmoid(-inf)=0, sigmoid(+inf)=1; TVM's formula
                    gives 0 below x = -88.72 (true value < 3e-39, subnormal)
=======  =========  ==========================================================

For comparison, TVM's own lowerings: exp (glibc expf) 6e-8; tanh 9.5e-5 and
tanh(1e-30) = 0 (its ``1 - exp(-2x)`` cancels near 0); erf (glibc erff) 7e-8.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# -- coefficients (tools/fit_fastmath.py) ---------------------------------------------

EXP_Q = (
    0.49999988079071045,
    0.166665181517601,
    0.04166953265666962,
    0.008368915878236294,
    0.0013751407386735082,
)
"""exp(r) = 1 + r + r^2 q(r), |r| <= ln2/2; truncation error 3.8e-9."""

TANH_P = (
    -0.3333331346511841,
    0.13332247734069824,
    -0.053801972419023514,
    0.020828615874052048,
    -0.005903876852244139,
)
"""tanh(x) = x + x^3 p(x^2), |x| < TANH_SMALL; truncation error 1.2e-8."""

ERF_P = (
    1.128379225730896,
    0.18520858883857727,
    0.05431608483195305,
    0.0038496239576488733,
    0.000379545905161649,
    4.683017778006615e-06,
    -1.3193719894388778e-08,
)
ERF_Q = (
    1.0,
    0.49747025966644287,
    0.11395927518606186,
    0.015461904928088188,
    0.0013074864400550723,
    6.309372110990807e-05,
)
"""erf(x) = x p(x^2) / q(x^2), |x| <= ERF_CLAMP; error 5.2e-8 with these float32 coefficients."""

LOG2E = 1.4426950408889634
LN2_HI = 0.693359375
"""ln 2 split for Cody-Waite: LN2_HI has 9 significant bits, so n * LN2_HI is exact for |n| < 2^15."""
LN2_LO = -2.1219444005469057e-4
EXP_CLAMP = (-105.0, 89.0)
"""exp's argument is clamped here first: exp(-105) rounds to 0 and exp(89) overflows to inf,
so the clamp only keeps the integer conversion in range (and maps -inf/+inf to 0/inf)."""
TANH_SMALL = 0.625
TANH_CLAMP = 10.0
"""tanh(10) = 1 - 4e-9 rounds to 1.0f; clamping keeps exp(2|x|) finite."""
ERF_CLAMP = 4.0
"""erf(4) = 1 - 1.5e-8 rounds to 1.0f."""

RULE_LEVEL = 20
"""Priority of our ``llvm.FLowerIntrinsic`` rules; TVM registers its own at 10."""

# -- expression builders (float32 PrimExprs, scalar or vector) -------------------------


def _const(x: Any, value: float) -> Any:
    """A float32 constant shaped like `x` (broadcast for vectors)."""
    from tvm import tirx

    return tirx.const(float(np.float32(value)), str(x.ty.dtype))


def _horner(coeffs: tuple[float, ...], u: Any) -> Any:
    """c[0] + c[1] u + ... (LowerIntrin turns each multiply-add into an fma)."""
    acc = _const(u, coeffs[-1])
    for c in coeffs[-2::-1]:
        acc = acc * u + _const(u, c)
    return acc


def _int_like(x: Any, dtype: str = "int32") -> str:
    lanes = x.ty.dtype.lanes
    return dtype if lanes == 1 else f"{dtype}x{lanes}"


def _is_nan(x: Any) -> Any:
    """NaN test on the bits: |bits| > bits(inf). Immune to no-NaN assumptions of the backend."""
    from tvm import tirx

    bits = tirx.reinterpret(_int_like(x), x)
    return (bits & 0x7FFFFFFF) > 0x7F800000


def _with_sign_of(magnitude: Any, x: Any) -> Any:
    """`magnitude` (sign bit clear) with the sign bit of `x`: copysign, -0.0 included."""
    from tvm import tirx

    itype = _int_like(x)
    sign = tirx.reinterpret(itype, x) & -0x80000000
    return tirx.reinterpret(str(x.ty.dtype), tirx.reinterpret(itype, magnitude) | sign)


def _pow2(k: Any, like: Any) -> Any:
    """2^k for integer k in [-126, 127], from the exponent bits."""
    from tvm import tirx

    return tirx.reinterpret(str(like.ty.dtype), (k + 127) << 23)


def _exp_parts(x: Any) -> tuple[Any, Any]:
    """(p, k) with exp(x) = p * 2^k, p in [0.7, 1.42], k an int32 PrimExpr."""
    from tvm import tirx

    n = tirx.floor(x * _const(x, LOG2E) + _const(x, 0.5))
    r = x - n * _const(x, LN2_HI) - n * _const(x, LN2_LO)  # Cody-Waite: exact n * LN2_HI
    p = _const(x, 1.0) + r + r * r * _horner(EXP_Q, r)
    return p, tirx.Cast(_int_like(x), n)


def _exp_in_range(x: Any) -> Any:
    """exp(x) for -87 <= x <= 88 (normal results): a single power of two."""
    p, k = _exp_parts(x)
    return p * _pow2(k, x)


def _exp_finite(x: Any) -> Any:
    """exp(x) for any non-NaN x (±inf included, via the clamp)."""
    from tvm import tirx

    x = tirx.min(tirx.max(x, _const(x, EXP_CLAMP[0])), _const(x, EXP_CLAMP[1]))
    p, k = _exp_parts(x)  # k in [-152, 129]
    k_hi = k >> 1
    return p * _pow2(k_hi, x) * _pow2(k - k_hi, x)  # each half a normal power of two


def exp_f32(x: Any) -> Any:
    """exp(x) for a float32 PrimExpr (scalar or vector)."""
    from tvm import tirx

    return tirx.Select(_is_nan(x), x, _exp_finite(x))


def tanh_f32(x: Any) -> Any:
    """tanh(x) for a float32 PrimExpr (scalar or vector)."""
    from tvm import tirx

    ax = tirx.abs(x)
    a2 = ax * ax
    small = ax + ax * a2 * _horner(TANH_P, a2)
    one = _const(x, 1.0)
    e = _exp_in_range(_const(x, 2.0) * tirx.min(ax, _const(x, TANH_CLAMP)))
    large = one - _const(x, 2.0) / (e + one)
    y = _with_sign_of(tirx.Select(ax < _const(x, TANH_SMALL), small, large), x)
    return tirx.Select(_is_nan(x), x, y)


def erf_f32(x: Any) -> Any:
    """erf(x) for a float32 PrimExpr (scalar or vector)."""
    from tvm import tirx

    a = tirx.min(tirx.abs(x), _const(x, ERF_CLAMP))
    t = a * a
    y = tirx.min(a * _horner(ERF_P, t) / _horner(ERF_Q, t), _const(x, 1.0))  # never above 1
    return tirx.Select(_is_nan(x), x, _with_sign_of(y, x))


BUILDERS: dict[str, Callable[[Any], Any]] = {"tirx.exp": exp_f32, "tirx.tanh": tanh_f32, "tirx.erf": erf_f32}
"""The TIR ops this module lowers, and the float32 expression that replaces each call."""

# -- registration ----------------------------------------------------------------------

_lock = threading.Lock()
_registered = False
_enabled = False


def install() -> None:
    """Make every later LLVM build in this process use the vectorizable lowerings.

    Idempotent and cheap after the first call (call it in each build process, before
    `tvm.compile`). Process-wide: it changes TVM's op registry, not one module.
    """
    global _registered, _enabled
    with _lock:
        if not _registered:
            for op_name, builder in BUILDERS.items():
                _register(op_name, builder)
            _registered = True
        _enabled = True


def uninstall() -> None:
    """Back to TVM's own lowerings for later builds (the rules stay registered, inert)."""
    global _enabled
    _enabled = False


def is_installed() -> bool:
    return _enabled


@contextlib.contextmanager
def installed(enabled: bool = True) -> Iterator[None]:
    """Builds inside the block use (or, with ``enabled=False``, do not use) the lowerings."""
    was = _enabled
    _set(enabled)
    try:
        yield
    finally:
        _set(was)


def _set(enabled: bool) -> None:
    if enabled:
        install()
    else:
        uninstall()


def _register(op_name: str, builder: Callable[[Any], Any]) -> None:
    import tvm

    original = tvm.ir.Op.get(op_name).get_attr("llvm.FLowerIntrinsic")  # None: TVM's default rule applies

    def lower(call: Any) -> Any:
        dtype = call.ty.dtype
        if _enabled and dtype.type_code == 2 and dtype.bits == 32:  # float32, any lanes
            return builder(call.args[0])
        # Returning the call unchanged lets LowerIntrin try its next rule (default.*).
        return original(call) if original is not None else call

    tvm.tirx.register_intrin_lowering(op_name, "llvm", f=lower, level=RULE_LEVEL)
