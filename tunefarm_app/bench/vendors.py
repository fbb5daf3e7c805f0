"""Vendor-library peers: the benchmark ops written with numpy (OpenBLAS) and PyTorch (CPU,
or for a CUDA target on this machine's GPU: cuBLAS and cuDNN, TF32 off).

Runs inside a vendor child process (`python -m tunefarm_app.bench.peers vendor ...`), never in
the bench process: numpy's and torch's thread pools would otherwise fight over the cores
with each other and with TVM's.

Each `bind_*` function returns a `VendorCall`, the op bound to its inputs in advance (its
outputs are checked against the workload's reference before timing), or None when the
library has no implementation of the op. Outputs are written into preallocated arrays
where the library allows it, as the TVM kernels do. On a GPU a call only launches the op;
`time_call` waits for the device once per sample, as TVM's GPU timer does.

numpy convolutions follow the registry's reference (one BLAS GEMM per kernel tap), but in
float32: the reference computes in float64, which would time dgemm instead of sgemm. The
depthwise convolution is a multiply-add per tap (a GEMM per channel would be 1x1 matrices).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tunefarm.workloads.registry import LAYER_NORM_EPS, OPS

Thunk = Callable[[], list[np.ndarray]]
"""Runs the op once on the bound inputs; returns its outputs."""


def _no_sync() -> None:
    pass


@dataclass(frozen=True)
class VendorCall:
    """A vendor op bound to its inputs: `run` calls it once (on a GPU: launches it),
    `outputs` calls it and returns its outputs as numpy arrays, `sync` waits until the
    device has finished what was launched."""

    run: Callable[[], object]
    outputs: Thunk
    sync: Callable[[], None] = _no_sync

MIN_TIMING_SECS = 0.2
"""A vendor op is called until the timed samples add up to at least this long."""

MIN_SAMPLE_SECS = 0.005
"""Each timed sample runs the op enough times to last at least this long (timer resolution)."""

MIN_SAMPLES = 5
"""Fewest timed samples, however long the op takes."""

WARMUP_CALLS = 3
"""Untimed calls before timing (page faults, thread-pool start, lazy initialisation)."""


@dataclass(frozen=True)
class VendorTiming:
    median_secs: float  # median over the samples of the per-call time
    samples: int
    calls: int  # timed calls in all


def resolve_params(registry: str, params: dict[str, int]) -> dict[str, int]:
    """All parameters of a registry op, defaults filled in."""
    return OPS[registry].resolve(params)


# -- timing --------------------------------------------------------------------------------


def time_call(call: VendorCall) -> VendorTiming:
    """Warm up, then time samples of `calls_per_sample` calls (the device synchronised at
    each sample's start and end) until MIN_TIMING_SECS have passed (and at least
    MIN_SAMPLES samples); the result is the median per-call time."""
    fn, sync = call.run, call.sync
    for _ in range(WARMUP_CALLS):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = time.perf_counter() - t0
    per_sample = max(1, math.ceil(MIN_SAMPLE_SECS / max(one, 1e-9)))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < MIN_SAMPLES or time.perf_counter() - start < MIN_TIMING_SECS:
        t0 = time.perf_counter()
        for _ in range(per_sample):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / per_sample)
    return VendorTiming(statistics.median(samples), len(samples), len(samples) * per_sample)


# -- numpy ---------------------------------------------------------------------------------


def bind_numpy(registry: str, p: dict[str, int], inputs: Sequence[np.ndarray]) -> VendorCall | None:
    """The op in numpy, or None when there is none."""
    maker = _NUMPY.get(registry)
    thunk = maker(p, [np.ascontiguousarray(a) for a in inputs]) if maker else None
    return VendorCall(thunk, thunk) if thunk else None


def _np_matmul(relu: bool) -> Callable[[dict[str, int], list[np.ndarray]], Thunk]:
    def bind(p: dict[str, int], inputs: list[np.ndarray]) -> Thunk:
        a, b = inputs
        out = np.empty(a.shape[:-1] + b.shape[-1:], np.float32)

        def run() -> list[np.ndarray]:
            np.matmul(a, b, out=out)
            if relu:
                np.maximum(out, 0.0, out=out)
            return [out]

        return run

    return bind


@dataclass(frozen=True)
class _ConvShape:
    """A 2-D convolution's geometry from registry parameters (1x1 and depthwise ops included)."""

    n: int
    c: int
    f: int
    h: int
    w: int
    kh: int
    kw: int
    stride: int
    pad: int
    dilation: int
    groups: int

    @staticmethod
    def of(registry: str, p: dict[str, int]) -> _ConvShape:
        depthwise = registry == "depthwise_conv2d"
        return _ConvShape(
            n=p["N"],
            c=p["C"],
            f=p["C"] if depthwise else p["F"],
            h=p["H"],
            w=p["W"],
            kh=p.get("KH", 1),
            kw=p.get("KW", 1),
            stride=p.get("stride", 1),
            pad=p.get("pad", 0),
            dilation=p.get("dilation", 1),
            groups=p["C"] if depthwise else p.get("groups", 1),
        )

    @property
    def out_hw(self) -> tuple[int, int]:
        d, s, pad = self.dilation, self.stride, self.pad
        return (
            (self.h + 2 * pad - d * (self.kh - 1) - 1) // s + 1,
            (self.w + 2 * pad - d * (self.kw - 1) - 1) // s + 1,
        )

    def window(self, ky: int, kx: int) -> tuple[slice, slice]:
        """The input positions that kernel tap (ky, kx) meets, as slices of the padded input."""
        oh, ow = self.out_hw
        d, s = self.dilation, self.stride
        return (
            slice(ky * d, ky * d + s * (oh - 1) + 1, s),
            slice(kx * d, kx * d + s * (ow - 1) + 1, s),
        )

    @property
    def is_depthwise(self) -> bool:
        return self.groups == self.c == self.f


def _np_pad(x: np.ndarray, pad: int) -> np.ndarray:
    return np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)]) if pad else x


def _np_conv(registry: str) -> Callable[[dict[str, int], list[np.ndarray]], Thunk | None]:
    def bind(p: dict[str, int], inputs: list[np.ndarray]) -> Thunk | None:
        cv = _ConvShape.of(registry, p)
        if cv.is_depthwise:
            return _np_depthwise(cv, *inputs)
        if cv.groups == 1:
            return _np_conv_gemm(cv, *inputs)
        return None  # grouped convolutions: no numpy peer

    return bind


def _np_conv_gemm(cv: _ConvShape, x: np.ndarray, w: np.ndarray) -> Thunk:
    """out[n] (F x P) = sum over taps of w[:, :, ky, kx] (F x C) @ window (C x P), sgemm each."""
    oh, ow = cv.out_hw
    taps = [np.ascontiguousarray(w[:, :, ky, kx]) for ky, kx in _taps(cv)]
    out = np.empty((cv.n, cv.f, oh * ow), np.float32)
    tmp = np.empty((cv.f, oh * ow), np.float32)

    def run() -> list[np.ndarray]:
        xp = _np_pad(x, cv.pad)
        for n in range(cv.n):
            for t, (ky, kx) in enumerate(_taps(cv)):
                rows, cols = cv.window(ky, kx)
                win = xp[n, :, rows, cols].reshape(cv.c, oh * ow)  # a copy unless 1x1, stride 1
                if t == 0:
                    np.matmul(taps[t], win, out=out[n])
                else:
                    np.matmul(taps[t], win, out=tmp)
                    np.add(out[n], tmp, out=out[n])
        return [out.reshape(cv.n, cv.f, oh, ow)]

    return run


def _np_depthwise(cv: _ConvShape, x: np.ndarray, w: np.ndarray) -> Thunk:
    """out[:, c] = sum over taps of w[c, 0, ky, kx] * window of channel c (broadcast multiply-add)."""
    oh, ow = cv.out_hw
    taps = [np.ascontiguousarray(w[:, 0, ky, kx]).reshape(1, cv.c, 1, 1) for ky, kx in _taps(cv)]
    out = np.empty((cv.n, cv.c, oh, ow), np.float32)
    tmp = np.empty_like(out)

    def run() -> list[np.ndarray]:
        xp = _np_pad(x, cv.pad)
        for t, (ky, kx) in enumerate(_taps(cv)):
            rows, cols = cv.window(ky, kx)
            if t == 0:
                np.multiply(xp[:, :, rows, cols], taps[t], out=out)
            else:
                np.multiply(xp[:, :, rows, cols], taps[t], out=tmp)
                np.add(out, tmp, out=out)
        return [out]

    return run


def _taps(cv: _ConvShape) -> list[tuple[int, int]]:
    return list(itertools.product(range(cv.kh), range(cv.kw)))


def _np_softmax(p: dict[str, int], inputs: list[np.ndarray]) -> Thunk:
    (x,) = inputs
    out = np.empty_like(x)

    def run() -> list[np.ndarray]:
        np.subtract(x, x.max(axis=-1, keepdims=True), out=out)
        np.exp(out, out=out)
        np.divide(out, out.sum(axis=-1, keepdims=True), out=out)
        return [out]

    return run


def _np_layer_norm(p: dict[str, int], inputs: list[np.ndarray]) -> Thunk:
    x, gamma, beta = inputs
    out = np.empty_like(x)

    def run() -> list[np.ndarray]:
        np.subtract(x, x.mean(axis=-1, keepdims=True), out=out)
        var = np.mean(out * out, axis=-1, keepdims=True)
        np.multiply(out, 1.0 / np.sqrt(var + np.float32(LAYER_NORM_EPS)), out=out)
        np.multiply(out, gamma, out=out)
        np.add(out, beta, out=out)
        return [out]

    return run


_NUMPY: dict[str, Callable[[dict[str, int], list[np.ndarray]], Thunk | None]] = {
    "matmul": _np_matmul(relu=False),
    "matmul_relu": _np_matmul(relu=True),
    "batch_matmul": _np_matmul(relu=False),
    "conv2d": _np_conv("conv2d"),
    "conv2d_1x1": _np_conv("conv2d_1x1"),
    "depthwise_conv2d": _np_conv("depthwise_conv2d"),
    "softmax": _np_softmax,
    "layer_norm": _np_layer_norm,
}


# -- torch ---------------------------------------------------------------------------------


def bind_torch(
    registry: str, p: dict[str, int], inputs: Sequence[np.ndarray], threads: int, device: str = "cpu"
) -> VendorCall | None:
    """The op in PyTorch (inference mode, `threads` intra-op threads) on `device` ("cpu",
    or "cuda": cuBLAS and cuDNN in float32, TF32 off, cuDNN's autotuner on; float16 GEMMs
    accumulate in float32, reduced-precision reductions off), or None when the op has no
    torch peer. Imports torch: call only in a vendor child process."""
    import torch

    torch.set_num_threads(threads)
    maker = _torch_makers().get(registry)
    if maker is None:
        return None
    op = maker(registry, p)
    if op is None:
        return None
    tensors = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in inputs]
    sync = _no_sync
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 math, as the TVM kernels do
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False  # fp32 accumulation
        torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm for the shape
        sync = torch.cuda.synchronize

    def run() -> object:
        with torch.inference_mode():
            return op(*tensors)

    def outputs() -> list[np.ndarray]:
        return [run().float().cpu().numpy()]

    return VendorCall(run, outputs, sync)


def _torch_makers() -> dict[str, Callable[[str, dict[str, int]], Callable | None]]:
    import torch
    import torch.nn.functional as F

    def matmul(registry: str, p: dict[str, int]) -> Callable:
        return torch.matmul

    def matmul_relu(registry: str, p: dict[str, int]) -> Callable:
        return lambda a, b: torch.relu_(torch.matmul(a, b))

    def bmm(registry: str, p: dict[str, int]) -> Callable:
        return torch.bmm

    def conv(registry: str, p: dict[str, int]) -> Callable:
        cv = _ConvShape.of(registry, p)
        return lambda x, w: F.conv2d(
            x, w, stride=cv.stride, padding=cv.pad, dilation=cv.dilation, groups=cv.groups
        )

    def conv_nhwc(registry: str, p: dict[str, int]) -> Callable:
        """NHWC data and OHWI weight, as channels-last views (oneDNN's own layout for them);
        the output, channels-last, viewed back as NHWC. Winograd's op is a 3x3 conv."""
        cv = _ConvShape.of(registry, {"KH": 3, "KW": 3, **p})
        return lambda x, w: F.conv2d(
            x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), stride=cv.stride, padding=cv.pad, dilation=cv.dilation
        ).permute(0, 2, 3, 1)

    def half_gemm(registry: str, p: dict[str, int]) -> Callable:
        """float16 operands, a float32 product written as float32 (`out_dtype`, torch's
        cuBLAS GEMM with fp32 accumulation and output) where torch has it, else float16
        out of the same fp32-accumulating GEMM."""
        mm = torch.bmm if registry.startswith("batch") else torch.mm
        transposed = registry.startswith("dense")

        def run(a, b):
            b = b.t() if transposed else b
            try:
                return mm(a, b, out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):
                return mm(a, b)

        return run

    def softmax(registry: str, p: dict[str, int]) -> Callable:
        return lambda x: torch.softmax(x, dim=-1)

    def layer_norm(registry: str, p: dict[str, int]) -> Callable:
        return lambda x, g, b: F.layer_norm(x, (p["N"],), g, b, eps=LAYER_NORM_EPS)

    return {
        "matmul": matmul,
        "matmul_relu": matmul_relu,
        "batch_matmul": bmm,
        "matmul_fp16": half_gemm,
        "dense_fp16": half_gemm,
        "batch_matmul_fp16": half_gemm,
        "conv2d": conv,
        "conv2d_1x1": conv,
        "conv2d_nhwc": conv_nhwc,
        "conv2d_winograd": conv_nhwc,
        "depthwise_conv2d": conv,
        "softmax": softmax,
        "layer_norm": layer_norm,
    }


BINDERS = ("numpy", "torch")
"""The vendor libraries this module knows."""
