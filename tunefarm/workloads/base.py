"""The `Workload` record and the two ways to make one (TE tensors or a PrimFunc)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from tunefarm.errors import WorkloadError
from tunefarm.records import TensorSpec

Reference = Callable[..., Sequence[np.ndarray]]
"""numpy reference: called with the input arrays, returns the output arrays."""

MEMORY_BOUND_INTENSITY = 4.0
"""FLOPs per byte moved below which a workload is reported in GB/s rather than GFLOPS."""


@dataclass(frozen=True, eq=False)
class Workload:
    """One tensor computation to tune. `mod` is an IRModule with a single "main" PrimFunc
    whose parameters are the inputs, then the outputs.

    `constants` are the positions of inputs that hold the same values in every call (a
    model's weights): a schedule may store them in another layout, transformed once when
    the model is built (see `tunefarm.layout`). They are part of the workload's identity.

    `reference_mod`: another IRModule whose "main" computes the same outputs from the same
    parameters by the plain algorithm (a Winograd alternative's direct convolution); its
    unscheduled program gives the reference outputs every kernel is checked against, so
    that the algorithm's own rounding is judged too. None: `mod`'s own."""

    name: str
    mod: object  # tvm.IRModule (kept untyped so importing this module does not import tvm)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    flops: float
    reference: Reference | None = None
    memory_bound: bool = False
    constants: tuple[int, ...] = ()
    reference_mod: object | None = None

    @cached_property
    def structural_hash(self) -> int:
        import tvm_ffi

        return int(tvm_ffi.structural_hash(self.mod)) & 0xFFFFFFFFFFFFFFFF

    @property
    def key(self) -> str:
        """Stable identity across processes and runs: records are matched by it."""
        consts = f"+const{','.join(str(i) for i in self.constants)}" if self.constants else ""
        return f"{self.name}#{self.structural_hash:016x}{consts}"

    def with_constants(self, constants: Iterable[int | str]) -> Workload:
        """The same workload with these inputs (positions or names) constant."""
        names = [t.name for t in self.inputs]
        out = set()
        for c in constants:
            if isinstance(c, str) and not c.isdigit():
                if c not in names:
                    raise WorkloadError(f"{self.name}: no input named {c!r} (inputs: {', '.join(names)})")
                out.add(names.index(c))
            else:
                i = int(c)
                if not 0 <= i < len(names):
                    raise WorkloadError(f"{self.name}: input {i} does not exist ({len(names)} inputs)")
                out.add(i)
        return replace(self, constants=tuple(sorted(out)))

    @property
    def args(self) -> tuple[TensorSpec, ...]:
        return self.inputs + self.outputs

    @property
    def moved_bytes(self) -> int:
        """Bytes every run must at least read and write (for GB/s)."""
        return sum(t.nbytes for t in self.args)

    def to_json(self) -> str:
        import tvm

        return tvm.ir.save_json(self.mod)

    def throughput(self, seconds: float) -> float:
        """GFLOPS, or GB/s when memory bound."""
        if not seconds or seconds == float("inf"):
            return 0.0
        work = self.moved_bytes if self.memory_bound else self.flops
        return work / seconds / 1e9

    @property
    def throughput_unit(self) -> str:
        return "GB/s" if self.memory_bound else "GFLOPS"


def _spec_of_buffer(buf) -> TensorSpec:
    shape = tuple(int(s) for s in buf.shape)
    return TensorSpec(str(buf.name), shape, str(buf.dtype))


def workload_from_prim_func(
    name: str,
    func,
    *,
    n_outputs: int | None = None,
    flops: float | None = None,
    reference: Reference | None = None,
    memory_bound: bool | None = None,
) -> Workload:
    """A workload from a PrimFunc. Outputs are the trailing parameters the function writes
    (or the last `n_outputs` when given)."""
    import tvm

    if not isinstance(func, tvm.tirx.PrimFunc):
        raise WorkloadError(f"{name}: expected a PrimFunc, got {type(func).__name__}")
    func = _with_unique_buffer_names(func.with_attr("global_symbol", "main"))
    mod = tvm.IRModule({"main": func})
    buffers = list(func.params)  # in TVM 0.27 a PrimFunc's parameters are its buffers
    if any(not hasattr(b, "shape") or b.shape is None for b in buffers):
        raise WorkloadError(f"{name}: every parameter of the PrimFunc must be a buffer")
    for b in buffers:
        if any(not isinstance(s, (int, tvm.tirx.IntImm)) for s in b.shape):
            raise WorkloadError(f"{name}: buffer {b.name} has a symbolic shape {list(b.shape)}; give static shapes")
    if n_outputs is None:
        written = _written_buffers(func)
        n_outputs = 0
        for b in reversed(buffers):
            if b.name in written:
                n_outputs += 1
            else:
                break
        if n_outputs == 0:
            raise WorkloadError(f"{name}: the PrimFunc writes none of its trailing parameters")
    specs = [_spec_of_buffer(b) for b in buffers]
    inputs, outputs = tuple(specs[: len(specs) - n_outputs]), tuple(specs[len(specs) - n_outputs :])
    if flops is None:
        flops = estimate_flops(mod)
    wl = Workload(name, mod, inputs, outputs, float(flops), reference, False)
    if memory_bound is None:
        memory_bound = wl.flops / max(1, wl.moved_bytes) < MEMORY_BOUND_INTENSITY
    return Workload(name, mod, inputs, outputs, float(flops), reference, bool(memory_bound))


def workload_from_stored(*, key: str, name: str, module_json: str, n_outputs: int | None = None) -> Workload:
    """The `Workload` a stored workload stands for (a records file's sidecar line, a farm
    workload row): its IRModule (`tvm.ir.save_json`), and the constant inputs its key
    names (`...#<hash>+const1,2`; a record's task key, `...@<target>`, also does).
    `n_outputs` as in `workload_from_prim_func` (None: the trailing parameters written)."""
    import tvm

    workload = workload_from_prim_func(name, tvm.ir.load_json(module_json)["main"], n_outputs=n_outputs)
    _, sep, consts = key.split("@", 1)[0].rpartition("+const")
    if sep and consts:
        workload = workload.with_constants([int(c) for c in consts.split(",")])
    return workload


def workload_from_te(
    name: str,
    tensors: Sequence,
    *,
    flops: float | None = None,
    reference: Reference | None = None,
    memory_bound: bool | None = None,
) -> Workload:
    """A workload from TE tensors: the placeholders are the inputs (in the given order),
    the computed tensors the outputs."""
    from tvm import te

    tensors = list(tensors)
    if not tensors or not all(isinstance(t, te.Tensor) for t in tensors):
        raise WorkloadError(f"{name}: expected a list of TE tensors (inputs first, outputs last)")
    inputs = [t for t in tensors if isinstance(t.op, te.PlaceholderOp)]
    outputs = [t for t in tensors if not isinstance(t.op, te.PlaceholderOp)]
    if not outputs:
        raise WorkloadError(f"{name}: no computed tensor among the returned ones (only placeholders)")
    if tensors != inputs + outputs:
        raise WorkloadError(f"{name}: return the inputs first and the outputs last")
    try:
        func = te.create_prim_func(inputs + outputs)
    except Exception as exc:
        raise WorkloadError(f"{name}: TVM cannot turn these tensors into a PrimFunc: {_first_line(exc)}") from None
    return workload_from_prim_func(
        name, func, n_outputs=len(outputs), flops=flops, reference=reference, memory_bound=memory_bound
    )


def estimate_flops(mod) -> float:
    from tvm.s_tir.analysis import estimate_tir_flops

    try:
        return float(estimate_tir_flops(mod))
    except Exception:
        return 0.0


def _with_unique_buffer_names(func):
    """`func` with one name per buffer. TE names a tensor after its operator, so a PrimFunc
    from TE can hold several buffers named e.g. "T_multiply"; the search and the schedule
    address buffers by name. TVMScript's printer gives such buffers distinct names
    ("T_multiply_1", ...), so a round trip through it renames them and changes nothing else."""
    import tvm
    import tvm_ffi

    seen: dict = {}  # buffer -> its name (buffers hash by identity)

    def note(var) -> None:
        # In TVM 0.27 a buffer is a Var of BufferType: loop variables (PrimType), whose
        # names repeat in every nest, are not buffers and need no renaming.
        if isinstance(getattr(var, "ty", None), tvm.tirx.BufferType):
            seen.setdefault(var, str(var.name))

    tvm_ffi.structural_walk(func, (tvm.tirx.Buffer, note))
    names = list(seen.values())
    if len(set(names)) == len(names):
        return func
    return tvm.script.from_source(func.script())


def _written_buffers(func) -> set[str]:
    import tvm
    import tvm_ffi

    names: set[str] = set()
    tvm_ffi.structural_walk(func.body, (tvm.tirx.BufferStore, lambda s: names.add(str(s.buffer.name))))
    return names


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
