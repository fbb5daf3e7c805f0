"""What an agent does with a leased model run, between its download and its report: the
runner's input made from the files fetched (`fetch_model_run`), and the runner's result
as the `ModelRunResult` sent back (`model_run_message`).

A timed run comes with the ONNX graph the model was imported from (`onnx_model`, signed
by the farm like code: services/protocol/signing.py) and the names of its inputs'
arrays: the runner times onnxruntime, and OpenVINO where it is installed, on it beside
the tuned model (`tunefarm.measure.runner`). A graph the agent cannot have (refused,
unsigned, missing) only costs the peers: the model is still run and timed, and each peer
says why it was not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.agent.files import Downloads
from services.agent.kernel_files import LOADABLE_SUFFIXES, local_file_name
from services.protocol.generated import measurer_pb2 as pb
from tunefarm.measure.runner import ModelRunInput, ModelRunResult
from tunefarm.models.peers import ONNXRUNTIME, PEERS, available_peers

ONNX_NAME = "model.onnx"
INPUTS_NAME = "inputs.npz"
OUTPUTS_NAME = "outputs.npz"
"""The names a model run's files are saved under in its directory (made here)."""


@dataclass(frozen=True)
class FetchedRun:
    """A model run ready for the runner, and why its peers cannot be timed ("" when they
    can, or none were asked for)."""

    input: ModelRunInput
    no_peers: str = ""


def fetch_model_run(run: pb.LeasedModelRun, run_dir: Path, downloads: Downloads) -> FetchedRun | str:
    """Download the run's library, inputs and (for a timed run) ONNX graph into `run_dir`;
    the runner's input, or why the model cannot be run."""
    name = local_file_name(run.library.file_name, "model")
    if name is None:
        return f"refused: the library's file name ends in none of {LOADABLE_SUFFIXES}"
    if run.library.id != run.model_run_id:
        return "refused: the library offered is another model run's"
    library, inputs, onnx = run_dir / name, run_dir / INPUTS_NAME, run_dir / ONNX_NAME
    wanted = [(run.library, library), (run.inputs, inputs)]
    peers_asked = run.repeat > 0 and run.HasField("onnx_model")
    no_peers = ""
    if peers_asked and run.onnx_model.id != run.model_run_id:
        no_peers = "refused: the ONNX graph offered is another model run's"
    elif peers_asked:
        wanted.append((run.onnx_model, onnx))
    got = downloads.fetch(wanted, model_run_id=run.model_run_id)
    missing = [why for why in (got.get(i, "not fetched") for i in range(2)) if isinstance(why, str)]
    if missing:
        return f"files unavailable: {'; '.join(missing)}"
    if len(wanted) > 2 and isinstance(got.get(2, "not fetched"), str):
        no_peers = f"the ONNX graph is unavailable: {got.get(2, 'not fetched')}"
    model_input = ModelRunInput(
        str(library), str(inputs), str(run_dir / OUTPUTS_NAME), run.repeat, run.warmup, run.timeout_secs,
        onnx_model=str(onnx) if peers_asked and not no_peers else "", input_names=tuple(run.input_names),
    )  # fmt: skip
    return FetchedRun(model_input, no_peers)


def model_run_message(ran: ModelRunResult, fetched: FetchedRun) -> pb.ModelRunResult:
    """The runner's result as `ReportModelRun` sends it (without the agent and run ids)."""
    peers = [
        pb.PeerTiming(peer=p.peer, latency_samples=p.latency_samples, round_medians=p.round_medians,
                      threads=p.threads, error=p.error)  # fmt: skip
        for p in ran.peers
    ]
    if fetched.no_peers and not ran.error:
        peers += [pb.PeerTiming(peer=peer, error=fetched.no_peers) for peer in _peers_here()]
    return pb.ModelRunResult(
        latency_samples=ran.latency_samples,
        run_secs=ran.run_secs,
        error=ran.error,
        outputs_npz=b"" if ran.error else Path(fetched.input.outputs).read_bytes(),
        threads=ran.threads,
        round_medians=ran.round_medians,
        peers=peers,
    )


def _peers_here() -> list[str]:
    """The peers this agent would have timed: onnxruntime (its absence is worth a note),
    and OpenVINO where it is installed."""
    installed = available_peers()
    return [p for p in PEERS if p == ONNXRUNTIME or p in installed]
