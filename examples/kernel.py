"""Example TVMScript workload for `tunefarm tune-op examples/kernel.py`: one
@T.prim_func, parameters are the inputs then the outputs. A GEMM with a transposed
right-hand side, C = A @ B^T, written directly in TVMScript."""

from tvm.script import tirx as T


@T.prim_func(s_tir=True)
def matmul_nt(A: T.Buffer((256, 512), "float32"), B: T.Buffer((384, 512), "float32"), C: T.Buffer((256, 384), "float32")):
    for i, j, k in T.grid(256, 384, 512):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vj, vk]
