"""OpenVINO's time per layer, set beside the tuned model's time per task.

OpenVINO's CPU plugin reports, with `PERF_COUNT` on, the time of every node it executed;
its runtime model gives each node's kind (`layerType`), output shape and input shapes,
and the ONNX nodes it stands for (`originalLayersNames`: a convolution with its bias and
activation fused is one node). `openvino_layers` runs the ONNX graph that way in a child
process and keeps each executed node's median time over `runs` inferences.

`match_tasks` then pairs the tuned model's tasks with those nodes. Nothing names the
same thing on both sides (TVM's fused functions do not keep ONNX node names, and the
tasks compute convolutions in NHWC where OpenVINO's shapes are NCHW), so they are paired
by shape: a task's signature is the multiset of its first output's dimensions and of its
largest constant input's (a convolution's or a matmul's weights, in any layout), and a
node's the same from its output and its largest constant input. A node's constant inputs
are those computed from constants alone (OpenVINO feeds a dense layer's weights through
a Transpose of a Const, folded when it compiles). Where there are weights, dimensions of
1 are left out of the output's part (OpenVINO writes a dense layer's 128x768 as
1x128x768; the weights' shape says which layer it is). Tasks and nodes with the same
signature are matched; where several nodes share one (the same layer repeated), a task
gets their mean time per call. A task that only moves data (no FLOPs: a transpose, a
copy) pairs only with a node that only moves data (`DATA_MOVEMENT_KINDS`), and a task
that computes only with one that does not. Nodes of different kinds that share a
signature (a Transpose and a MatMul both writing 1x12x128x64, neither with weights) make
it ambiguous: the shapes cannot say which of them is the task's layer, so it gets none.
A task no node matches (OpenVINO fused it into a neighbour, or laid it out another way)
has no peer time.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.isolation import IsolatedWorker

LAYERS_TIMEOUT = 300.0
"""Seconds the profiling child may take."""

_JOBS = "tunefarm.models.peer_layers"

Signature = tuple[tuple[int, ...], tuple[int, ...]]

DATA_MOVEMENT_KINDS = frozenset({
    "Transpose", "Reorder", "Reshape", "Concatenation", "Split", "StridedSlice", "Gather", "Broadcast",
    "Tile", "Pad", "DepthToSpace", "SpaceToDepth", "ShuffleChannels",
})  # fmt: skip
"""OpenVINO node kinds (`layerType`) that only move data: the peers of tasks without FLOPs."""


@dataclass(frozen=True)
class PeerLayer:
    """One node OpenVINO executed: its time per inference (median) and its shapes."""

    name: str
    kind: str  # layerType: Convolution, FullyConnected, Eltwise, Pooling, Reorder, ...
    seconds: float
    out_shape: tuple[int, ...]
    const_shape: tuple[int, ...]  # its largest constant input (weights); () when none
    fused: str  # the ONNX nodes it stands for

    @property
    def signature(self) -> Signature:
        return task_signature(self.out_shape, [self.const_shape] if self.const_shape else [])


def task_signature(out_shape: Sequence[int], const_shapes: Sequence[Sequence[int]]) -> Signature:
    """A task's signature: its first output's dimensions and its largest constant's, each
    sorted; with a constant, the output's dimensions of 1 left out (see the module doc)."""
    largest = tuple(int(d) for d in max(const_shapes, key=lambda s: math.prod(s), default=()))
    out = [int(d) for d in out_shape if not (largest and int(d) == 1)]
    return tuple(sorted(out)), tuple(sorted(largest))


def openvino_layers(model_path: str | Path, feeds: Mapping[str, np.ndarray], threads: int, *, runs: int = 20) -> list[PeerLayer]:
    """OpenVINO's executed nodes on the ONNX file, in a child process. Raises
    `tunefarm.errors.ModelError` when it cannot run."""
    from tunefarm.errors import ModelError

    with tempfile.TemporaryDirectory(prefix="tunefarm-peer-layers-") as tmp:
        npz = os.path.join(tmp, "inputs.npz")
        np.savez(npz, **dict(feeds))
        with IsolatedWorker(name="openvino-layers") as worker:
            outcome = worker.call(f"{_JOBS}:layers_job", str(model_path), npz, threads, runs, timeout=LAYERS_TIMEOUT)
    if not outcome.ok:
        raise ModelError(f"OpenVINO's per-layer profile failed ({outcome.status}): {outcome.message}")
    return [PeerLayer(**{**row, "out_shape": tuple(row["out_shape"]), "const_shape": tuple(row["const_shape"])})
            for row in outcome.value]  # fmt: skip


def layers_job(model_path: str, inputs_npz: str, threads: int, runs: int) -> list[dict[str, Any]]:
    """Child side of `openvino_layers`: the runtime model's executed nodes, as dicts."""
    import openvino as ov

    from tunefarm.models.peers import openvino_config

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model_path), "CPU", openvino_config(threads, profile=True))
    request = compiled.create_infer_request()
    with np.load(inputs_npz) as data:
        names = {n for port in compiled.inputs for n in port.names}
        feeds = {k: data[k] for k in data.files if k in names}
    for _ in range(3):
        request.infer(feeds)
    times: dict[str, list[float]] = {}
    for _ in range(runs):
        request.infer(feeds)
        for op in compiled.get_runtime_model().get_ordered_ops():
            value = _text(op.get_rt_info()["execTimeMcs"])
            if value.isdigit():
                times.setdefault(op.get_friendly_name(), []).append(int(value) * 1e-6)
    rows = []
    ops = compiled.get_runtime_model().get_ordered_ops()
    constant = _constant_nodes(ops)
    for op in ops:
        name = op.get_friendly_name()
        if name not in times:
            continue
        info = op.get_rt_info()
        consts = [_dims(inp.get_source_output().get_partial_shape()) for inp in op.inputs()
                  if inp.get_source_output().get_node().get_friendly_name() in constant]  # fmt: skip
        rows.append(
            asdict(
                PeerLayer(
                    name=name,
                    kind=_text(info["layerType"]),
                    seconds=float(np.median(times[name])),
                    out_shape=_dims(op.get_output_partial_shape(0)),
                    const_shape=max(consts, key=math.prod, default=()),
                    fused=_text(info["originalLayersNames"]),
                )
            )
        )
    return rows


def _constant_nodes(ops: Sequence[Any]) -> set[str]:
    """The names of the runtime-model nodes (`ops`, in topological order) that compute
    from constants alone: a Const, or a node whose inputs all are (a matmul's weights reach
    OpenVINO's FullyConnected through a Transpose of a Const, folded at compile time)."""
    constant: set[str] = set()
    for op in ops:
        kind = _text(op.get_rt_info()["layerType"])
        inputs = [inp.get_source_output().get_node().get_friendly_name() for inp in op.inputs()]
        if kind == "Const" or (kind not in ("Input", "Parameter") and inputs and all(n in constant for n in inputs)):
            constant.add(op.get_friendly_name())
    return constant


def _text(value: Any) -> str:
    """An rt_info value (OpenVINO's `OVAny`) as text."""
    return str(value.astype(str)) if hasattr(value, "astype") else str(value)


def _dims(shape: Any) -> tuple[int, ...]:
    return tuple(int(d.get_length()) if d.is_static else -1 for d in shape)


def match_tasks(tasks: Sequence[Any], layers: Sequence[PeerLayer]) -> dict[str, dict[str, Any]]:
    """Per task key (of `tasks`, `tunefarm.models.tasks.ModelTask`s): OpenVINO's seconds per
    call for the layers with the same signature, and which they are (see the module doc).
    Tasks without a matching layer are left out."""
    by_signature: dict[tuple[bool, Signature], list[PeerLayer]] = {}
    for layer in layers:
        if layer.kind not in ("Input", "Output", "Const"):
            by_signature.setdefault((layer.kind in DATA_MOVEMENT_KINDS, layer.signature), []).append(layer)
    out = {}
    for t in tasks:
        wl = t.workload
        consts = [wl.inputs[i].shape for i in t.const_inputs if i < len(wl.inputs)]
        found = by_signature.get((t.flops == 0, task_signature(wl.outputs[0].shape, consts)))
        if not found or len({layer.kind for layer in found}) > 1:
            continue
        out[t.key] = {
            "openvino_seconds_per_call": sum(layer.seconds for layer in found) / len(found),
            "openvino_layers": sorted({f"{layer.kind} {layer.name}" for layer in found})[:4],
        }
    return out
