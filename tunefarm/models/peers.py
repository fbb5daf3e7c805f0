"""The engines a user would deploy instead of tuning: onnxruntime and OpenVINO.

Both run the ONNX graph as given (`reference.onnx`), on the CPU, in float32, with the
same thread count as the tuned model, in a child process of their own
(`build.time_side_by_side` alternates their timing blocks with the tuned model's):

    onnxruntime   CPUExecutionProvider, `threads` intra-op threads, one inter-op thread
    openvino      the CPU plugin, PERFORMANCE_HINT=LATENCY, INFERENCE_NUM_THREADS=threads,
                  INFERENCE_PRECISION_HINT=f32 (on CPUs with bf16 units its default would
                  compute in bf16: not the same arithmetic as the others), one stream

onnxruntime is a dependency of the `onnx` extra; OpenVINO is optional (the `peers` extra,
`pip install 'tunefarm[peers]'`): `available_peers()` names those installed here.

`openvino_node_times` runs OpenVINO with PERF_COUNT on and returns the time of each
executed node, by the name of the ONNX node it came from: what the report sets beside the
tuned model's time per task.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

ONNXRUNTIME = "onnxruntime"
OPENVINO = "openvino"
PEERS = (ONNXRUNTIME, OPENVINO)
"""Every peer, in the order tables show them."""


def latency_key(peer: str) -> str:
    """The key of a peer's latency in `report.json`'s model entry: "onnxruntime_latency"."""
    return f"{peer}_latency"


def available_peers() -> tuple[str, ...]:
    """The peers whose package is installed here."""
    return tuple(p for p in PEERS if importlib.util.find_spec(p) is not None)


def peer_call(peer: str, model_path: str, feeds: Mapping[str, np.ndarray], threads: int) -> Callable[[], Any]:
    """One inference of `peer` on the ONNX file at `model_path`, ready to be timed."""
    if peer == ONNXRUNTIME:
        return _onnxruntime_call(model_path, feeds, threads)
    if peer == OPENVINO:
        request, inputs = _openvino_request(model_path, feeds, threads, profile=False)
        return lambda: request.infer(inputs)
    raise ValueError(f"unknown peer {peer!r}; the peers are {', '.join(PEERS)}")


def peer_run(peer: str, model_path: str, feeds: Mapping[str, np.ndarray], threads: int) -> list[np.ndarray]:
    """The outputs of one inference of `peer`, in the graph's output order."""
    if peer == ONNXRUNTIME:
        session = _onnxruntime_session(model_path, threads)
        return [np.asarray(x) for x in session.run(None, dict(feeds))]
    request, inputs = _openvino_request(model_path, feeds, threads, profile=False)
    result = request.infer(inputs)
    return [np.asarray(result[out]) for out in request.model_outputs]


def _onnxruntime_session(model_path: str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])


def _onnxruntime_call(model_path: str, feeds: Mapping[str, np.ndarray], threads: int) -> Callable[[], Any]:
    session = _onnxruntime_session(model_path, threads)
    inputs = dict(feeds)
    return lambda: session.run(None, inputs)


def openvino_config(threads: int, *, profile: bool = False) -> dict[str, Any]:
    """The CPU plugin's settings: latency, `threads` threads, float32 arithmetic."""
    config: dict[str, Any] = {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": int(threads),
        "INFERENCE_PRECISION_HINT": "f32",
        "NUM_STREAMS": 1,
    }
    if profile:
        config["PERF_COUNT"] = True
    return config


def _openvino_request(
    model_path: str, feeds: Mapping[str, np.ndarray], threads: int, *, profile: bool
) -> tuple[Any, dict[str, np.ndarray]]:
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model_path), "CPU", openvino_config(threads, profile=profile))
    request = compiled.create_infer_request()
    names = {name for port in compiled.inputs for name in port.names}
    inputs = {k: v for k, v in feeds.items() if k in names}
    return request, inputs


def openvino_node_times(
    model_path: str, feeds: Mapping[str, np.ndarray], threads: int, *, runs: int = 20
) -> dict[str, float]:
    """Seconds per inference of every node OpenVINO executed (its median over `runs`
    profiled inferences, after a warm-up), keyed by the node's name: the ONNX node's
    name, or a name OpenVINO derived from it ("node_Conv_67/WithoutBiases")."""
    import openvino as ov

    request, inputs = _openvino_request(model_path, feeds, threads, profile=True)
    for _ in range(3):
        request.infer(inputs)
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        request.infer(inputs)
        for info in request.get_profiling_info():
            if info.status == ov.ProfilingInfo.Status.EXECUTED:
                samples.setdefault(info.node_name, []).append(info.real_time.total_seconds())
    return {name: float(np.median(times)) for name, times in samples.items()}
