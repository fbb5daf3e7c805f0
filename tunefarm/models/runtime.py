"""Run a built model library, check it against onnxruntime and time it beside its peers.

- `run_model(model_dir, inputs)`: outputs and latency (`tunefarm.models.timing`), in a
  child process whose TVM thread pool has one thread per core (or `threads`).
- `time_side_by_side(builds, inputs, onnx_model=...)`: several built models and the peer
  engines timed in alternating blocks (`timing.time_interleaved`), each in its own child
  process, on the same thread count and input.
- `time_beside_peers(model, peers)`: the same rounds for blocks made elsewhere (a device
  agent's runner: its sandboxed processes), where a peer that fails is left out with
  why, never failing the model's timing.
- `check_library(model_dir, onnx_model)`: the built model against onnxruntime on every
  input kind of `tunefarm.models.check`.

The libraries and their `manifest.json` are written by `tunefarm.models.build`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.cuda import CUDA_KERNEL_SUFFIX
from tunefarm.errors import ModelError, ModelRunError
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker, summarize_error
from tunefarm.models import check
from tunefarm.models.build import MANIFEST_NAME, call_isolated, child_error_text, manifest_tolerance
from tunefarm.models.check import ModelCheck
from tunefarm.models.peers import available_peers, peer_call
from tunefarm.models.timing import ROUNDS, WARMUP_CALLS, Block, Latency, time_calls, time_interleaved

_JOBS = "tunefarm.models.runtime"


RUN_TIMEOUT = 300.0
"""Seconds `run_model` may take in its child, warm-up and timed runs included."""


@dataclass(frozen=True)
class ModelRun:
    outputs: tuple[np.ndarray, ...]
    latency: Latency | None  # None when `repeat` was 0


def load_manifest(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except OSError:
        raise ModelError(f"{model_dir}: no {MANIFEST_NAME} (not a built model directory)") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: malformed JSON ({exc.msg})") from None
    missing = [k for k in ("library", "inputs", "outputs") if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise ModelError(f"{path} is not a built model's manifest (no {', '.join(missing)})")
    return manifest


def model_threads(model_dir: str | Path) -> int:
    """The thread count a built model runs with by default: its target's cores, else this
    machine's physical cores."""
    return int(load_manifest(model_dir).get("target", {}).get("num-cores") or _cores())


def model_worker(threads: int) -> IsolatedWorker:
    """A child process for `run_model` calls with a TVM thread pool of `threads` threads
    (several calls share it: one `import tvm`)."""
    return IsolatedWorker(env={"TVM_NUM_THREADS": str(threads)}, preload=["tvm"], name="model-run",
                          blocked_imports=WITHOUT_TORCH)


def run_model(
    model_dir: str | Path,
    inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    *,
    repeat: int | None = None,
    threads: int | None = None,
    timeout: float = RUN_TIMEOUT,
    worker: IsolatedWorker | None = None,
) -> ModelRun:
    """Run a built model: its outputs, and its latency (`timing.time_calls`: `repeat`
    single inferences, or as many as the timing budget holds when None; 0 times
    nothing). Runs in a child process with TVM_NUM_THREADS=`threads` (default
    `model_threads`); a passed `worker` (`model_worker`) keeps its own."""
    manifest = load_manifest(model_dir)
    specs = manifest["inputs"]
    arrays = _ordered_inputs(specs, inputs)
    if threads is None:
        threads = model_threads(model_dir)
    tmp = tempfile.mkdtemp(prefix="tunefarm-run-")
    try:
        npz = os.path.join(tmp, "inputs.npz")
        np.savez(npz, *arrays)
        outcome = call_isolated(
            worker,
            "run",
            f"{_JOBS}:run_job",
            str(Path(model_dir) / manifest["library"]),
            npz,
            repeat,
            timeout=timeout,
            env={"TVM_NUM_THREADS": str(threads)},
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not outcome.ok:
        raise ModelRunError(f"running {model_dir} failed ({outcome.status}): {child_error_text(outcome.message)}")
    outs, samples, used = outcome.value
    return ModelRun(tuple(outs), Latency.of(samples, used) if samples else None)


def run_job(
    lib_path: str, inputs_npz: str, repeat: int | None, warmup: int = WARMUP_CALLS
) -> tuple[list[np.ndarray], list[float], int]:
    """Child side of `run_model` (and of the farm's model runs): the outputs of one call,
    the latency samples of `timing.time_calls` (none when `repeat` is 0), and the
    threads of TVM's pool."""
    import tvm

    call = _loaded_model(lib_path, inputs_npz)
    outputs = [t.numpy() for t in _flatten(call())]
    samples: list[float] = []
    if repeat != 0:
        samples = time_calls(call, runs=repeat, warmup_calls=warmup)
    return outputs, samples, int(tvm.runtime.num_threads())


def _loaded_model(lib_path: str, inputs_npz: str) -> Callable[[], Any]:
    """In a child: one inference of the built model on its inputs (the .npz's arrays in
    order), as a call that returns the Relax VM's result. A CUDA model
    (`CUDA_LIBRARY_NAME`) runs on the GPU with the fatbin built with it, its inputs
    copied there once; the call waits for the GPU (a launch returns before the kernels
    end), so that a timed call is the inference's whole time."""
    import tvm
    from tvm import relax

    on_gpu = lib_path.endswith(CUDA_KERNEL_SUFFIX)
    if on_gpu:
        from tunefarm import cuda

        dev = cuda.cuda_device()
        module = cuda.load_kernel(lib_path, Path(lib_path).with_suffix(".unpacked"))
    else:
        dev = tvm.cpu(0)
        module = tvm.runtime.load_module(lib_path)
    main = relax.VirtualMachine(module, dev)["main"]
    with np.load(inputs_npz) as data:
        args = [tvm.runtime.tensor(data[f"arr_{i}"], dev) for i in range(len(data.files))]
    if not on_gpu:
        return lambda: main(*args)

    def synced() -> Any:
        out = main(*args)
        dev.sync()
        return out

    return synced


def _flatten(value) -> list:
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    return [t for item in value for t in _flatten(item)]


def check_library(model_dir: str | Path, onnx_model: Any, *, worker: IsolatedWorker | None = None) -> ModelCheck:
    """Run the built model and onnxruntime on every input kind of `tunefarm.models.check`
    and compare them (`check.check_model`). `onnx_model` is the ONNX graph (bytes, path
    or ModelProto) the model was imported from."""
    from tunefarm.models.importer import run_onnxruntime

    manifest = load_manifest(model_dir)
    specs = manifest["inputs"]
    onnx_model = _onnx_bytes(onnx_model)

    def reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return run_onnxruntime(onnx_model, feeds)
        except Exception as exc:
            raise ModelError(f"onnxruntime cannot run the reference model: {summarize_error(str(exc))}") from None

    inputs = check.check_inputs({s["name"]: s["shape"] for s in specs}, {s["name"]: s["dtype"] for s in specs})
    own = worker or model_worker(model_threads(model_dir))
    try:
        return check.check_model(
            lambda feeds: run_model(model_dir, feeds, repeat=0, worker=own).outputs,
            reference,
            inputs,
            reference_name="onnxruntime",
            output_names=[s["name"] for s in manifest["outputs"]],
            exact=check.exact_onnx_reference(onnx_model),
            tolerance=manifest_tolerance(manifest),
        )
    finally:
        if worker is None:
            own.close()


def time_side_by_side(
    builds: Mapping[str, str | Path],
    inputs: Mapping[str, np.ndarray],
    *,
    threads: int,
    onnx_model: Any = None,
    peers: Sequence[str] | None = None,
    runs: int | None = None,
    rounds: int = ROUNDS,
    budget_secs: float | None = None,
    timeout: float = RUN_TIMEOUT,
    workers: Mapping[str, IsolatedWorker] | None = None,
) -> dict[str, Latency]:
    """The latency of each built model (name -> model directory) and, when `onnx_model`
    (bytes, path or ModelProto) is given, of each engine of `peers` (default: those
    installed, `peers.available_peers()`) under its own name (`peers.ONNXRUNTIME`,
    `peers.OPENVINO`). Each runs in its own child process with `threads` threads, on the
    same `inputs` (name -> array), in `rounds` alternating blocks
    (`timing.time_interleaved`): `runs` samples each, or `budget_secs` of them (default
    `timing.BUDGET_SECS` per contender). A build named in `workers` is timed in that
    worker (a `model_worker` of `threads` threads the caller has, e.g. the one its check
    ran in: one `import tvm` fewer; left open). Raises `ModelError` when one cannot be run."""
    peer_names = tuple(available_peers() if peers is None else peers) if onnx_model is not None else ()
    if set(builds) & set(peer_names):
        raise ValueError(f"a build may not be named like a peer ({', '.join(peer_names)})")
    tmp = tempfile.mkdtemp(prefix="tunefarm-timing-")
    owned: list[IsolatedWorker] = []
    blocks = {}
    try:
        for i, (name, model_dir) in enumerate(builds.items()):
            manifest = load_manifest(model_dir)
            npz = os.path.join(tmp, f"inputs-{i}.npz")
            np.savez(npz, *_ordered_inputs(manifest["inputs"], inputs))
            if workers and name in workers:
                worker = workers[name]
            else:
                worker = model_worker(threads)
                owned.append(worker)
            lib = str(Path(model_dir) / manifest["library"])
            blocks[name] = timing_block(worker, name, f"{_JOBS}:tvm_block_job", (lib, npz), timeout)
        if peer_names:
            model_path = os.path.join(tmp, "model.onnx")
            Path(model_path).write_bytes(_onnx_bytes(onnx_model))
            npz = os.path.join(tmp, "inputs-peers.npz")
            np.savez(npz, **dict(inputs))
            for peer in peer_names:
                worker = IsolatedWorker(name=f"{peer}-timing")
                owned.append(worker)
                blocks[peer] = timing_block(worker, peer, f"{_JOBS}:peer_block_job", (peer, model_path, npz, threads), timeout)
        kwargs = {} if budget_secs is None else {"budget_secs": budget_secs}
        return time_interleaved(blocks, runs=runs, rounds=rounds, **kwargs)
    finally:
        for worker in owned:
            worker.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _onnx_bytes(onnx_model: Any) -> bytes:
    if isinstance(onnx_model, (str, os.PathLike)):
        return Path(onnx_model).read_bytes()
    return onnx_model if isinstance(onnx_model, bytes) else onnx_model.SerializeToString()


def timing_block(worker: IsolatedWorker, name: str, job: str, args: tuple, timeout: float):
    """A `timing.Block` that runs `job(*args, runs, budget, warm-up, min runs)` in `worker`."""

    def block(runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int) -> tuple[list[float], int]:
        outcome = worker.call(job, *args, runs, budget_secs, warmup_secs, min_runs, timeout=timeout)
        if not outcome.ok:
            raise ModelRunError(f"timing {name} failed ({outcome.status}): {child_error_text(outcome.message)}")
        # its thread pool spins on after the last call: the next contender must not pay for it
        worker.wait_idle()
        return outcome.value

    return block


@dataclass(frozen=True)
class PeerTimes:
    """What `time_beside_peers` measured: each contender's latency (the model's under its
    name), and why each peer that was left out was not timed."""

    latencies: dict[str, Latency]
    failed: dict[str, str]


class _PeerFailed(Exception):
    def __init__(self, peer: str, why: str):
        super().__init__(why)
        self.peer, self.why = peer, why


def time_beside_peers(
    model: tuple[str, Block],
    peers: Mapping[str, Block],
    *,
    runs: int | None = None,
    rounds: int = ROUNDS,
    budget_secs: float | None = None,
) -> PeerTimes:
    """`timing.time_interleaved` of a model (its name, its block) and its peers' blocks
    (`timing_block`s): `runs` samples each, in `rounds` alternating rounds. A peer whose
    block fails (`ModelRunError`: it does not load the model, its process dies) is left
    out, with why, and the rounds are taken again without it, so that every latency comes
    from the same rounds; the model's own failure raises `ModelRunError`."""
    name, block = model
    if name in peers:
        raise ValueError(f"the model may not be named like a peer ({name})")
    live = dict(peers)
    failed: dict[str, str] = {}
    kwargs = {} if budget_secs is None else {"budget_secs": budget_secs}
    while True:
        blocks = {name: block, **{peer: _guarded(peer, b) for peer, b in live.items()}}
        try:
            return PeerTimes(time_interleaved(blocks, runs=runs, rounds=rounds, **kwargs), failed)
        except _PeerFailed as exc:
            failed[exc.peer] = exc.why
            del live[exc.peer]


def _guarded(peer: str, block: Block) -> Block:
    """`block`, whose failure says which peer failed (`time_beside_peers` leaves it out)."""

    def guarded(runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int) -> tuple[list[float], int]:
        try:
            return block(runs, budget_secs, warmup_secs, min_runs)
        except ModelRunError as exc:
            raise _PeerFailed(peer, str(exc)) from None

    return guarded


_TIMED_CALLS: dict[tuple, Any] = {}
"""In a timing child: the loaded model's call per (library or ONNX file, inputs), so that
each block after the first only times (`forget_timed_calls` empties it)."""


def forget_timed_calls() -> None:
    """Child side: drop the loaded models (a long-lived child, a device agent's runner,
    times a model once and must not keep it)."""
    _TIMED_CALLS.clear()


def tvm_block_job(
    lib_path: str, inputs_npz: str, runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int
) -> tuple[list[float], int]:
    """Child side of `time_side_by_side` for a built model: one block of samples."""
    import tvm

    key = (lib_path, inputs_npz)
    if key not in _TIMED_CALLS:
        _TIMED_CALLS[key] = _loaded_model(lib_path, inputs_npz)
    samples = timed_block(_TIMED_CALLS[key], runs, budget_secs, warmup_secs, min_runs)
    return samples, int(tvm.runtime.num_threads())


def peer_block_job(
    peer: str, model_path: str, inputs_npz: str, threads: int, runs: int | None, budget_secs: float,
    warmup_secs: float, min_runs: int,
) -> tuple[list[float], int]:
    """Child side of `time_side_by_side` for a peer engine: one block of samples (the
    .npz's arrays are stored under the model's input names)."""
    key = (peer, model_path, inputs_npz)
    if key not in _TIMED_CALLS:
        with np.load(inputs_npz) as data:
            feeds = {name: data[name] for name in data.files}
        _TIMED_CALLS[key] = peer_call(peer, model_path, feeds, threads)
    return timed_block(_TIMED_CALLS[key], runs, budget_secs, warmup_secs, min_runs), threads


def ordered_peer_block_job(
    peer: str, model_path: str, inputs_npz: str, input_names: Sequence[str], threads: int, runs: int | None,
    budget_secs: float, warmup_secs: float, min_runs: int,
) -> tuple[list[float], int]:
    """`peer_block_job` on the inputs a built model takes (.npz: arr_0, arr_1, ... in its
    input order, a farm model run's), fed to the peer under `input_names`."""
    key = (peer, model_path, inputs_npz, tuple(input_names))
    if key not in _TIMED_CALLS:
        with np.load(inputs_npz, allow_pickle=False) as data:
            if len(data.files) != len(input_names):
                raise ModelError(f"{len(data.files)} input arrays for {len(input_names)} input names")
            feeds = {name: data[f"arr_{i}"] for i, name in enumerate(input_names)}
        _TIMED_CALLS[key] = peer_call(peer, model_path, feeds, threads)
    return timed_block(_TIMED_CALLS[key], runs, budget_secs, warmup_secs, min_runs), threads


def timed_block(call, runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int) -> list[float]:
    # the first block warms up fully; later ones with one call (caches after the other contenders)
    return time_calls(call, runs=runs, budget_secs=budget_secs, warmup_secs=warmup_secs,
                      warmup_calls=WARMUP_CALLS if warmup_secs > 0 else 1, min_runs=min_runs)  # fmt: skip


def _ordered_inputs(specs: list[dict[str, Any]], inputs) -> list[np.ndarray]:
    if isinstance(inputs, Mapping):
        missing = [s["name"] for s in specs if s["name"] not in inputs]
        extra = [n for n in inputs if n not in {s["name"] for s in specs}]
        if missing or extra:
            raise ModelError(
                f"the model takes inputs {[s['name'] for s in specs]}; missing {missing}, unknown {extra}"
            )
        arrays = [np.asarray(inputs[s["name"]]) for s in specs]
    else:
        arrays = [np.asarray(a) for a in inputs]
        if len(arrays) != len(specs):
            raise ModelError(f"the model takes {len(specs)} inputs, got {len(arrays)}")
    for s, a in zip(specs, arrays):
        if tuple(a.shape) != tuple(s["shape"]) or str(a.dtype) != s["dtype"]:
            raise ModelError(
                f"input {s['name']!r} must be {s['dtype']} {tuple(s['shape'])}, got {a.dtype} {tuple(a.shape)}"
            )
    return [np.ascontiguousarray(a) for a in arrays]


def _cores() -> int:
    from tunefarm.target import physical_cores

    return physical_cores()
