"""Transposed convolutions computed without multiplying zeros.

TVM lowers a 2-D transposed convolution (ONNX ConvTranspose) as a convolution over its
input dilated with zeros: with stride s, s*s - 1 of every s*s input positions it reads
are zeros, so a 2x2 stride-2 layer (a detector's or segmenter's upsampling head) spends
three quarters of its multiply-adds on them. It also computes in NCHW only, so that in
a model converted to NHWC every transposed convolution is fenced by two transposes.

`subpixel_transposed_convs()` replaces each transposed convolution whose weights are
constant by its sub-pixel form, computed in NHWC:

    out[n, y, x, o] = sum_{t, u, c} xpad[n, q + t, r + u, c] * v[a, b, t, u, c, o]
    with q, a = divmod(y + pad_top, s_h) and r, b = divmod(x + pad_left, s_w)

Output row y takes its kernel rows from phase a only (rows a, a + s_h, ...): m_h =
ceil(k_h / s_h) of them, so each output reads an m_h x m_w window of the input,
zero-padded by m - 1 in front, and the weights are rearranged once at build time into
`v` (phase, tap, input channel, output channel; taps reversed, zeros where the kernel
is shorter than m * s). That is k_h*k_w / (m_h*m_w) = s_h*s_w times fewer multiply-adds
for a kernel that is a multiple of its stride, with any padding and output padding, and
one kernel: no crop, no interleaving copy. It is an ordinary reduction (TVM's op pattern
says out-fusable), so bias, batch norm and activation fuse into it.

The input and output stay NCHW tensors of the graph, reached through transposes
(`permute_dims`) that `tunefarm.models.transpose_sinking` then moves past elementwise
operators and cancels against the transposes ConvertLayout placed around the
convolution's neighbours.
"""

from __future__ import annotations

import math

import numpy as np

NCHW_TO_NHWC = (0, 2, 3, 1)
NHWC_TO_NCHW = (0, 3, 1, 2)


def subpixel_weights(weight: np.ndarray, strides: tuple[int, int]) -> np.ndarray:
    """A transposed convolution's weights (C, O, k_h, k_w) rearranged for the sub-pixel
    form: (s_h, s_w, m_h, m_w, C, O), taps reversed, zeros past the kernel."""
    c, o, kh, kw = weight.shape
    sh, sw = strides
    mh, mw = math.ceil(kh / sh), math.ceil(kw / sw)
    padded = np.zeros((c, o, mh * sh, mw * sw), dtype=weight.dtype)
    padded[:, :, :kh, :kw] = weight
    # kernel row a + s_h * j -> (j, a); tap t = m_h - 1 - j
    v = padded.reshape(c, o, mh, sh, mw, sw)[:, :, ::-1, :, ::-1, :]
    return np.ascontiguousarray(v.transpose(3, 5, 2, 4, 0, 1))


def subpixel_compute(data, v, out_hw: tuple[int, int], pad_front: tuple[int, int]):
    """The TE compute: `data` (N, H, W, C) and `v` from `subpixel_weights` to the output
    (N, H_out, W_out, O)."""
    from tvm import te, topi

    n, h, w, c = (int(d) for d in data.shape)
    sh, sw, mh, mw, _, o = (int(d) for d in v.shape)
    ho, wo = out_hw
    pt, pl = pad_front
    rows = max(0, (ho - 1 + pt) // sh + 1 - h)  # zero rows needed below the input
    cols = max(0, (wo - 1 + pl) // sw + 1 - w)
    xpad = topi.nn.pad(data, [0, mh - 1, mw - 1, 0], [0, rows, cols, 0], name="pad_temp")
    rt = te.reduce_axis((0, mh), name="rt")
    ru = te.reduce_axis((0, mw), name="ru")
    rc = te.reduce_axis((0, c), name="rc")

    def body(nn, yy, xx, oo):
        y, x = yy + pt, xx + pl
        return te.sum(
            xpad[nn, y // sh + rt, x // sw + ru, rc] * v[y % sh, x % sw, rt, ru, rc, oo],
            axis=[rt, ru, rc],
        )

    return te.compute((n, ho, wo, o), body, name="conv2d_transpose_nhwc")


def rewritable(call, weight: np.ndarray | None) -> bool:
    """Whether a `relax.nn.conv2d_transpose` call has the sub-pixel form: constant
    weights, one group, no dilation, NCHW/IOHW layouts, static float shapes."""
    from tunefarm.models.slices import static_shape

    a = call.attrs
    if weight is None or weight.ndim != 4 or int(a.groups) != 1:
        return False
    if any(int(d) != 1 for d in a.dilation):
        return False
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCHW", "IOHW", "NCHW"):
        return False
    if not str(weight.dtype).startswith("float"):
        return False
    shapes = [static_shape(e.ty) for e in (call.args[0], call)]
    return all(s is not None and len(s) == 4 for s in shapes)


def subpixel_transposed_convs():
    """The Relax module pass (see the module docstring)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from tunefarm.models.slices import bound_constant, rewrite_relax_functions, with_builder

    @mutator
    class _Rewrite(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv2d_transpose"):
                return call
            weight = bound_constant(self, call.args[1])
            if not rewritable(call, weight):
                return call
            a = call.attrs
            strides = (int(a.strides[0]), int(a.strides[1]))
            _, _, ho, wo = (int(d) for d in call.ty.shape.values)
            v = relax.const(subpixel_weights(weight, strides), str(weight.dtype))
            data = self.builder_.emit(relax.op.permute_dims(call.args[0], list(NCHW_TO_NHWC)))
            out = self.builder_.emit_te(
                subpixel_compute,
                data,
                v,
                (ho, wo),
                (int(a.padding[0]), int(a.padding[1])),
                primfunc_name_hint="conv2d_transpose",
            )
            return relax.op.permute_dims(out, list(NHWC_TO_NCHW))

    @tvm.transform.module_pass(opt_level=0, name="SubpixelTransposedConvs")
    def rewrite(mod, _ctx):
        return rewrite_relax_functions(mod, lambda f, m: with_builder(_Rewrite, f, m))

    return rewrite
