"""Winograd convolution: a 3x3, stride-1 2-D convolution in fewer multiplications.

F(m x m, 3 x 3) (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks",
2016) computes an m x m tile of output from an (m+2) x (m+2) tile of input with

    Y = A^T [ (G g G^T) * (B^T d B) ] A        (* elementwise, summed over input channels)

where g is a 3x3 filter, d an input tile, and A (alpha x m), B (alpha x alpha), G (alpha x 3),
alpha = m + 2, fixed matrices (`WinogradTransform`). Per output tile and channel pair the
direct convolution does 9 m^2 multiply-adds, Winograd alpha^2 (16 for m = 2 against 36, 36
for m = 4 against 144), plus the transforms, whose cost is shared over the channels.
F(4,3)'s matrices have larger entries (4, 5, 8, 1/24), so its float32 rounding error is
larger than F(2,3)'s (measured in tests/test_winograd.py).

`winograd_conv2d_nhwc(data, weight, padding, m)` is the TE computation, in the layouts the
model pipeline gives convolutions (NHWC data, OHWI weight, NHWC output: see
`tunefarm.models.tasks.CONV_LAYOUTS`). It has exactly the direct convolution's parameters
(the data and weight placeholders are the caller's, so their shape and index dtypes too),
so it can stand in for one. Its blocks:

  data_pad           the input, zero padded, and out to whole tiles at the bottom and right
  weight_transform   U[eps, nu, ci, co] = (G g G^T): annotated with `PREPROC_ATTR`, so that
                     it runs once outside the timed kernel (`tunefarm.layout`; a model folds
                     it into the weight at build time), and reads the weight alone
  input_transform    V[eps, nu, n, th, tw, ci] = (B^T d B) of each tile
  batched_gemm       M[eps, nu, n, th, tw, co] = sum over ci of V * U: one GEMM (tiles x CI
                     times CI x CO) per tile position (eps, nu)
  inverse_transform  Y[n, th, i, tw, j, co] = (A^T M A)[i, j] of each tile
  conv2d_winograd    out[n, h, w, co] = Y at the tile and position of (h, w) (a reshape,
                     cut to the output size)

The matrices are constant expressions, not buffers: an entry is a chain of selects on
the iterators that index it (`iter == const`, `table_entry`), which the search detects as
a constant table and unrolls (`tunefarm.search.space.dag.BlockSpec.table_iters`), so that
TVM folds every entry to a constant and drops the zero terms. Each product puts the table
entries first, `(entry * entry) * x`: TVM vectorizes before it unrolls, and its
simplifier folds `broadcast(0) * x` to zero but not `x * broadcast(0)` (with the entries
last, F(4,3)'s input transform kept all 1296 products instead of 484 and ran 22x slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from tunefarm.errors import WorkloadError
from tunefarm.layout import PREPROC_ATTR

TILE_SIZES = (2, 4)
"""The output tile sizes m with transform matrices here: F(2x2, 3x3) and F(4x4, 3x3)."""

KERNEL = 3
"""The filter size r of every transform here."""

Matrix = tuple[tuple[Fraction, ...], ...]


@dataclass(frozen=True)
class WinogradTransform:
    """The matrices of F(m x m, r x r), stored transposed as they are applied: `AT` (m x
    alpha, inverse), `BT` (alpha x alpha, input), `G` (alpha x r, filter)."""

    m: int
    r: int
    AT: Matrix
    BT: Matrix
    G: Matrix

    @property
    def alpha(self) -> int:
        """The input tile size, m + r - 1."""
        return self.m + self.r - 1


def _matrix(rows: Sequence[Sequence[int | str]]) -> Matrix:
    return tuple(tuple(Fraction(x) for x in row) for row in rows)


# Lavin & Gray (2016), section 4.1 (F(2,3)) and 4.2 (F(4,3)); interpolation points
# 0, 1, -1 (and infinity) for m = 2, and 0, 1, -1, 2, -2 (and infinity) for m = 4.
_F23 = WinogradTransform(
    m=2,
    r=3,
    AT=_matrix([[1, 1, 1, 0], [0, 1, -1, -1]]),
    BT=_matrix([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]),
    G=_matrix([[1, 0, 0], ["1/2", "1/2", "1/2"], ["1/2", "-1/2", "1/2"], [0, 0, 1]]),
)

_F43 = WinogradTransform(
    m=4,
    r=3,
    AT=_matrix([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]),
    BT=_matrix(
        [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ]
    ),
    G=_matrix(
        [
            ["1/4", 0, 0],
            ["-1/6", "-1/6", "-1/6"],
            ["-1/6", "1/6", "-1/6"],
            ["1/24", "1/12", "1/6"],
            ["1/24", "-1/12", "1/6"],
            [0, 0, 1],
        ]
    ),
)


def transform(m: int) -> WinogradTransform:
    """The matrices of F(m x m, 3 x 3); m is one of `TILE_SIZES`."""
    found = {t.m: t for t in (_F23, _F43)}.get(m)
    if found is None:
        raise WorkloadError(f"Winograd tile size m={m} has no transform here; choose one of {TILE_SIZES}")
    return found


@dataclass(frozen=True)
class WinogradShape:
    """The sizes of one Winograd convolution: output, tiles, padded input."""

    n: int
    h: int
    w: int
    ci: int
    co: int
    padding: tuple[int, int, int, int]  # top, left, bottom, right
    m: int

    @property
    def out_h(self) -> int:
        return self.h + self.padding[0] + self.padding[2] - KERNEL + 1

    @property
    def out_w(self) -> int:
        return self.w + self.padding[1] + self.padding[3] - KERNEL + 1

    @property
    def tiles_h(self) -> int:
        return -(-self.out_h // self.m)

    @property
    def tiles_w(self) -> int:
        return -(-self.out_w // self.m)

    @property
    def alpha(self) -> int:
        return self.m + KERNEL - 1

    @property
    def direct_flops(self) -> float:
        """The direct convolution's FLOPs (a multiply-add counts 2): the work it stands for."""
        return 2.0 * self.n * self.out_h * self.out_w * self.co * self.ci * KERNEL * KERNEL


def normalize_padding(padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of an int (all four), a pair (height, width) or a 4-tuple."""
    if isinstance(padding, int):
        pads = (padding,) * 4
    else:
        pads = tuple(int(p) for p in padding)
        if len(pads) == 2:
            pads = (pads[0], pads[1], pads[0], pads[1])
    if len(pads) != 4 or any(p < 0 for p in pads):
        raise WorkloadError(f"padding must be an int, (h, w) or (top, left, bottom, right) >= 0, got {padding!r}")
    return pads  # type: ignore[return-value]


def winograd_shape(data_shape, weight_shape, padding, m: int) -> WinogradShape:
    """The sizes of F(m, 3) on NHWC data and OHWI weights of these shapes; WorkloadError
    when the weight is not 3x3 over the data's channels or the output would be empty."""
    n, h, w, ci = (int(s) for s in data_shape)
    co, kh, kw, wci = (int(s) for s in weight_shape)
    if (kh, kw) != (KERNEL, KERNEL):
        raise WorkloadError(f"Winograd F(m, 3) needs a 3x3 filter, got {kh}x{kw}")
    if wci != ci:
        raise WorkloadError(f"the weight has {wci} input channels, the data {ci} (groups are not supported)")
    if m < 1:
        raise WorkloadError(f"the output tile size m must be positive, got {m}")
    shape = WinogradShape(n, h, w, ci, co, normalize_padding(padding), m)
    if shape.out_h < 1 or shape.out_w < 1:
        raise WorkloadError(f"a 3x3 filter leaves no output of a {h}x{w} input padded by {shape.padding}")
    return shape


def table_entry(matrix: Matrix, row, col):
    """matrix[row, col] as a TIR expression of the index expressions `row`, `col`: a chain
    of selects over the non-zero entries (`row == i and col == j`), 0 elsewhere."""
    import tvm

    tirx = tvm.tirx
    value = tirx.const(0.0, "float32")
    for i, line in enumerate(matrix):
        for j, x in enumerate(line):
            if x != 0:
                cond = tirx.all(row == i, col == j)
                value = tirx.Select(cond, tirx.const(float(x), "float32"), value)
    return value


def winograd_conv2d_nhwc(
    data, weight, padding: int | Sequence[int], m: int | WinogradTransform, name: str = "conv2d_winograd"
):
    """The output tensor of F(m x m, 3 x 3) on TE placeholders `data` (NHWC) and `weight`
    (OHWI), stride 1, dilation 1, one group, float32 (see the module docstring). `m`: a
    tile size (`TILE_SIZES`), or the matrices of an F(m x m, 3 x 3) of one's own."""
    import tvm
    from tvm import te

    tirx = tvm.tirx
    tf = m if isinstance(m, WinogradTransform) else transform(m)
    if tf.r != KERNEL:
        raise WorkloadError(f"the transform is F({tf.m}, {tf.r}); a 3x3 filter needs F(m, {KERNEL})")
    m = tf.m
    sh = winograd_shape(data.shape, weight.shape, padding, m)
    if str(data.dtype) != "float32" or str(weight.dtype) != "float32":
        raise WorkloadError(f"Winograd convolution is float32 here, got {data.dtype} data and {weight.dtype} weights")
    a = tf.alpha
    index = _index_dtype(data.shape[0])

    def dims(*sizes: int) -> tuple:
        """Shapes in the data's index type (a Relax model's convolutions have int64 shapes)."""
        return tuple(tirx.const(x, index) for x in sizes)

    top, left, _, _ = sh.padding
    padded_h, padded_w = sh.tiles_h * m + KERNEL - 1, sh.tiles_w * m + KERNEL - 1

    def pad(n, y, x, c):
        inside = tirx.all(y >= top, y < top + sh.h, x >= left, x < left + sh.w)
        return tirx.if_then_else(inside, data[n, y - top, x - left, c], tirx.const(0.0, "float32"))

    data_pad = te.compute(dims(sh.n, padded_h, padded_w, sh.ci), pad, name="data_pad")

    r = te.reduce_axis(dims(0, KERNEL), name="r")
    s = te.reduce_axis(dims(0, KERNEL), name="s")
    u = te.compute(
        dims(a, a, sh.ci, sh.co),
        lambda eps, nu, ci, co: te.sum(
            table_entry(tf.G, eps, r) * table_entry(tf.G, nu, s) * weight[co, r, s, ci], axis=[r, s]
        ),
        name="weight_transform",
        attrs={PREPROC_ATTR: tirx.const(1, "int32")},
    )

    ra = te.reduce_axis(dims(0, a), name="ra")
    rb = te.reduce_axis(dims(0, a), name="rb")
    v = te.compute(
        dims(a, a, sh.n, sh.tiles_h, sh.tiles_w, sh.ci),
        lambda eps, nu, n, th, tw, ci: te.sum(
            table_entry(tf.BT, eps, ra) * table_entry(tf.BT, nu, rb) * data_pad[n, th * m + ra, tw * m + rb, ci],
            axis=[ra, rb],
        ),
        name="input_transform",
    )

    rc = te.reduce_axis(dims(0, sh.ci), name="rc")
    prod = te.compute(
        dims(a, a, sh.n, sh.tiles_h, sh.tiles_w, sh.co),
        lambda eps, nu, n, th, tw, co: te.sum(v[eps, nu, n, th, tw, rc] * u[eps, nu, rc, co], axis=rc),
        name="batched_gemm",
    )

    ka = te.reduce_axis(dims(0, a), name="ka")
    kb = te.reduce_axis(dims(0, a), name="kb")
    y = te.compute(
        dims(sh.n, sh.tiles_h, m, sh.tiles_w, m, sh.co),
        lambda n, th, i, tw, j, co: te.sum(
            table_entry(tf.AT, i, ka) * table_entry(tf.AT, j, kb) * prod[ka, kb, n, th, tw, co], axis=[ka, kb]
        ),
        name="inverse_transform",
    )

    fdiv, fmod = tirx.floordiv, tirx.floormod
    return te.compute(
        dims(sh.n, sh.out_h, sh.out_w, sh.co),
        lambda n, h, w, co: y[n, fdiv(h, m), fmod(h, m), fdiv(w, m), fmod(w, m), co],
        name=name,
    )


def _index_dtype(size) -> str:
    """The integer type of a shape entry (`.ty` in TVM 0.27, `.dtype` before; a plain int: int32)."""
    if isinstance(size, int):
        return "int32"
    return str(getattr(size, "ty", None) or size.dtype)
