"""Example user workloads for `tunefarm tune-op my_ops.py:FUNCTION`.

Each function returns TE tensors, inputs first, outputs last. Keyword arguments are
shape parameters: `tunefarm tune-op examples/my_ops.py:capsule_conv2d --shape CI=16`.
"""

import tvm
from tvm import te


def capsule_conv2d(N=1, H=16, W=16, CI=32, CO=32, K=3, stride=1, pad=1, CAP=4):
    """Capsule convolution (NHWC with CAPxCAP pose matrices per capsule, as in the Ansor
    paper's operator benchmark): out[n,h,w,co,i,j] = sum over rh, rw, ci, k of
    data[n, h*s+rh, w*s+rw, ci, i, k] * weight[rh, rw, ci, co, k, j]."""
    data = te.placeholder((N, H, W, CI, CAP, CAP), name="data")
    weight = te.placeholder((K, K, CI, CO, CAP, CAP), name="weight")
    ph, pw = H + 2 * pad, W + 2 * pad
    padded = te.compute(
        (N, ph, pw, CI, CAP, CAP),
        lambda n, h, w, c, i, j: tvm.tirx.if_then_else(
            tvm.tirx.all(h >= pad, h < H + pad, w >= pad, w < W + pad),
            data[n, h - pad, w - pad, c, i, j],
            tvm.tirx.const(0.0, "float32"),
        ),
        name="padded",
    )
    oh, ow = (ph - K) // stride + 1, (pw - K) // stride + 1
    rh = te.reduce_axis((0, K), name="rh")
    rw = te.reduce_axis((0, K), name="rw")
    rc = te.reduce_axis((0, CI), name="rc")
    rk = te.reduce_axis((0, CAP), name="rk")
    out = te.compute(
        (N, oh, ow, CO, CAP, CAP),
        lambda n, h, w, co, i, j: te.sum(
            padded[n, h * stride + rh, w * stride + rw, rc, i, rk] * weight[rh, rw, rc, co, rk, j],
            axis=[rh, rw, rc, rk],
        ),
        name="capsule_conv2d",
    )
    return [data, weight, out]


def bias_gelu(M=256, N=1024):
    """A dense layer's epilogue: tanh-approximated GELU of x + bias."""
    x = te.placeholder((M, N), name="x")
    bias = te.placeholder((N,), name="bias")
    y = te.compute((M, N), lambda i, j: x[i, j] + bias[j], name="biased")
    c = 0.7978845608028654
    out = te.compute(
        (M, N),
        lambda i, j: 0.5 * y[i, j] * (1.0 + te.tanh(c * (y[i, j] + 0.044715 * y[i, j] * y[i, j] * y[i, j]))),
        name="gelu",
    )
    return [x, bias, out]
