"""Which blocks may run on NVIDIA tensor cores, and with which wmma intrinsics.

A block runs on tensor cores (the GPU rule `_rule_tensor_core`, the model
`loopnest_tensor_core`) when the GPU has them (sm_70+: `GpuLimits.tensor_cores`) and the
block is a matrix multiply-accumulate that the 16x16x16 float16 -> float32 fragments
compute exactly (`tensor_core_form`):

- its value is `out[batch.., i, j] += cast(a[batch.., i, k]) * cast(b[batch.., k, j])`
  (or b as `[batch.., j, k]`, a dense layer's weight or a transposed batch matmul's
  right operand), iterators in that order, one reduction iterator;
- a and b are float16 inputs in global memory, `out` is float32 (fp32 accumulation);
- i, j and k are multiples of 16: a block of other extents keeps the SIMT sketches
  rather than being padded (padding would add a pad stage per operand and a crop, and
  the GEMMs of models are multiples of 16 almost always).

A float32 block never qualifies: reduced precision is a workload's (or a job's) choice,
never the search's. TF32 (sm_80+, float32 operands rounded to 10-bit mantissas) would be
the same form with float32 operands, but TVM registers no tf32 wmma or mma intrinsic.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunefarm import wmma
from tunefarm.gpu import GpuLimits
from tunefarm.search.space.dag import BlockSpec, ComputeDag

FRAGMENT = wmma.FRAGMENT

INPUT_DTYPE = "float16"
ACCUMULATOR_DTYPE = "float32"


@dataclass(frozen=True)
class TensorCoreForm:
    """A block in tensor-core form: its operand buffers and iterators."""

    a: str  # [batch.., i, k]
    b: str  # [batch.., k, j], or [batch.., j, k] when b_transposed
    batch: tuple[str, ...]
    i: str
    j: str
    k: str
    b_transposed: bool

    @property
    def fragment_iters(self) -> tuple[str, str, str]:
        return (self.i, self.j, self.k)

    def load_intrinsic(self, operand: str, shared_scope: str) -> str:
        return wmma.load_name(operand, shared_scope, col_major=operand == "b" and self.b_transposed)

    @property
    def sync_intrinsic(self) -> str:
        return wmma.SYNC_B_TRANSPOSED if self.b_transposed else wmma.SYNC

    fill_intrinsic = wmma.FILL_F32
    store_intrinsic = wmma.STORE_F32_GLOBAL


def tensor_core_form(dag: ComputeDag, block: BlockSpec, gpu: GpuLimits | None) -> TensorCoreForm | None:
    """The block's tensor-core form on this GPU (see the module docstring), or None."""
    if gpu is None or not gpu.tensor_cores or block.multiply_accumulate is None or len(block.reads) != 2:
        return None
    a_name, b_name = block.multiply_accumulate
    a, b, out = dag.buffer(a_name), dag.buffer(b_name), dag.buffer(block.write.buffer)
    if a.dtype != INPUT_DTYPE or b.dtype != INPUT_DTYPE or out.dtype != ACCUMULATOR_DTYPE:
        return None
    if a.scope != "global" or b.scope != "global" or out.scope != "global":
        return None
    names = [it.name for it in block.iters]
    if len(names) < 3 or [it.kind for it in block.iters] != ["S"] * (len(names) - 1) + ["R"]:
        return None
    *batch, i, j, k = names
    reads = {acc.buffer: acc for acc in block.reads}
    a_vars = _plain_vars(reads[a_name].indices)
    b_vars = _plain_vars(reads[b_name].indices)
    if _plain_vars(block.write.indices) != [*batch, i, j] or a_vars != [*batch, i, k]:
        return None
    if b_vars == [*batch, k, j]:
        transposed = False
    elif b_vars == [*batch, j, k]:
        transposed = True
    else:
        return None
    if any(block.iter(n).extent % FRAGMENT for n in (i, j, k)):
        return None
    return TensorCoreForm(a_name, b_name, tuple(batch), i, j, k, transposed)


def _plain_vars(indices) -> list[str | None]:
    return [ix.is_single_var() for ix in indices]
