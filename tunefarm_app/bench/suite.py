"""The operator set of `tunefarm bench ops`: short ids, the registry op behind each id.

Every registry op's defaults are the benchmark shapes, so an id names the op at its
defaults; `params` overrides them (the smoke test uses small shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tunefarm.errors import UsageError
from tunefarm.workloads import Workload
from tunefarm.workloads.registry import make


@dataclass(frozen=True)
class BenchOp:
    """One row of the benchmark: an id for `--ops` and the registry op it tunes."""

    id: str  # short id used by --ops and in file names
    registry: str  # registry op name (tunefarm/workloads/registry.py)
    params: tuple[tuple[str, int], ...] = ()  # overrides of the registry defaults
    constants: tuple[str, ...] = ()  # inputs that are weights in a model (both tuners may rewrite their layout)

    def workload(self) -> Workload:
        workload = make(self.registry, dict(self.params))
        return workload.with_constants(self.constants) if self.constants else workload  # else the op's own

    def with_params(self, **params: int) -> BenchOp:
        return replace(self, params=tuple(sorted(params.items())))


BENCH_OPS: tuple[BenchOp, ...] = (
    BenchOp("gemm1024", "matmul", constants=("B",)),  # 1024 x 1024 x 1024, B a weight
    BenchOp("gemm512_relu", "matmul_relu", constants=("B",)),  # 512^3, then ReLU
    BenchOp("bmm", "batch_matmul"),  # 12 x 128x64 @ 64x128 (attention: no weight)
    BenchOp("conv2d", "conv2d", constants=("weight",)),  # ResNet 1x64x56x56, 3x3, 64 filters, pad 1
    BenchOp("conv2d_nhwc", "conv2d_nhwc", constants=("weight",)),  # the same in a model's layouts (NHWC, OHWI)
    BenchOp("winograd", "conv2d_winograd"),  # the same by Winograd F(4x4, 3x3): GFLOPS of the direct conv's FLOPs
    BenchOp("conv1x1", "conv2d_1x1", constants=("weight",)),  # 1x256x14x14 -> 1024
    BenchOp("conv1x1_nhwc", "conv2d_nhwc", (("C", 256), ("F", 1024), ("H", 14), ("KH", 1), ("KW", 1), ("W", 14),
                                            ("pad", 0)), constants=("weight",)),  # the same, NHWC
    BenchOp("depthwise", "depthwise_conv2d", constants=("weight",)),  # 1x32x112x112, 3x3, pad 1
    BenchOp("softmax", "softmax"),  # 12 x 128 x 128, last axis
    BenchOp("layer_norm", "layer_norm"),  # 128 x 768, last axis
)
"""The benchmark, in the order of the table."""

OPT_IN_OPS: tuple[BenchOp, ...] = (
    BenchOp("gemm1024_fp16", "matmul_fp16", constants=("B",)),  # float16 inputs, float32 accumulation and output
    BenchOp("dense_fp16", "dense_fp16", constants=("B",)),  # 128 x 1024 @ (1024 x 1024)^T, the same precision
    BenchOp("bmm_fp16", "batch_matmul_fp16"),  # bmm's shapes, the same precision
)
"""Ops run only when `--ops` names them: reduced precision (tensor cores on sm_70+, their
peer cuBLAS at the same precision) is a choice, never part of the float32 benchmark."""


def select_ops(spec: str | None) -> list[BenchOp]:
    """The ops named by a comma-separated `--ops` value (all of them for None), in table order."""
    if not spec:
        return list(BENCH_OPS)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    known = {op.id: op for op in (*BENCH_OPS, *OPT_IN_OPS)}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise UsageError(f"--ops: unknown op id {unknown[0]!r}; known: {', '.join(known)}")
    if not wanted:
        raise UsageError("--ops: no op id given")
    return [op for op in (*BENCH_OPS, *OPT_IN_OPS) if op.id in wanted]
