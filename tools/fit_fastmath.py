"""Derive the polynomial coefficients used by `tunefarm.fastmath`.

Each polynomial is a weighted least-squares fit in float64 on Chebyshev nodes of its
interval (close to the minimax fit at these degrees), rounded to float32. The weights
make the fit minimise the *relative* error of the final function. Prints the tuples that
`tunefarm/fastmath.py` holds, and the truncation error of each fit (in float64, before
float32 evaluation, which adds about one rounding).

    python tools/fit_fastmath.py
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)
LN2 = math.log(2.0)


def fit(f, lo, hi, deg, weight, *, var=lambda t: t, n=4000):
    """Coefficients c[0..deg] (lowest first) of the polynomial in `var(t)` fitting f on [lo, hi]."""
    t = np.cos(np.pi * (np.arange(n) + 0.5) / n) * (hi - lo) / 2 + (hi + lo) / 2
    vander = np.vander(var(t), deg + 1, increasing=True)
    w = weight(t)
    c, *_ = np.linalg.lstsq(vander * w[:, None], f(t) * w, rcond=None)
    return c.astype(np.float32).astype(np.float64)


def poly(c, u):
    return np.polyval(c[::-1], u)


def report(name, c, err):
    print(f"{name} = ({', '.join(repr(float(np.float32(v))) for v in c)})  # max rel error {err:.2e}")


def main() -> None:
    # exp(r) = 1 + r + r^2 q(r) on |r| <= ln2/2 (the reduced argument).
    r = np.linspace(-LN2 / 2, LN2 / 2, 200_001)
    r = r[r != 0]
    c = fit(lambda t: (np.expm1(t) - t) / t**2, -LN2 / 2, LN2 / 2, 4, lambda t: t**2 / np.exp(t))
    report("EXP_Q", c, np.abs((1 + r + r * r * poly(c, r)) / np.exp(r) - 1).max())

    # tanh(x) = x + x^3 p(x^2) on |x| < 0.625.
    x = np.linspace(1e-4, 0.625, 200_001)
    c = fit(
        lambda t: (np.tanh(t) - t) / t**3, 1e-3, 0.625, 4, lambda t: t**2 / np.tanh(t), var=lambda t: t * t
    )
    report("TANH_P", c, np.abs((x + x**3 * poly(c, x * x)) / np.tanh(x) - 1).max())

    # erf(x) = x p(x^2) / q(x^2) on |x| <= 4, q(0) = 1.
    x = np.linspace(1e-4, 4.0, 200_001)
    p, q = fit_rational(lambda t: _erf(t) / t, 1e-4, 4.0, 6, 5, var=lambda t: t * t)
    err = np.abs(x * poly(p, x * x) / poly(q, x * x) / _erf(x) - 1).max()
    report("ERF_P", p, err)
    report("ERF_Q", q, err)


def fit_rational(f, lo, hi, m, n, *, var, n_nodes=6000, iterations=30):
    """p (degree m) and q (degree n, q[0] = 1) with p(var(t)) / q(var(t)) fitting f on [lo, hi]
    in relative error: Sanathanan-Koerner iteration (linearised least squares, weighted by
    the last denominator), with Lawson-style reweighting towards the minimax fit."""
    t = np.cos(np.pi * (np.arange(n_nodes) + 0.5) / n_nodes) * (hi - lo) / 2 + (hi + lo) / 2
    u, y = var(t), f(t)
    q_prev = np.ones_like(u)
    w = np.ones_like(u)
    for _ in range(iterations):
        a = np.hstack(
            [np.vander(u, m + 1, increasing=True), -y[:, None] * np.vander(u, n + 1, increasing=True)[:, 1:]]
        )
        scale = w / (q_prev * np.abs(y))
        c, *_ = np.linalg.lstsq(a * scale[:, None], y * scale, rcond=None)
        p, q = c[: m + 1], np.concatenate([[1.0], c[m + 1 :]])
        q_prev = poly(q, u)
        err = np.abs(poly(p, u) / q_prev - y) / np.abs(y)
        w = w * (err / err.max()) ** 0.3
        w /= w.max()
    return p.astype(np.float32).astype(np.float64), q.astype(np.float32).astype(np.float64)


if __name__ == "__main__":
    main()
