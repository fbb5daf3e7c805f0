"""Winograd sites of model tasks (`tunefarm.winograd_sites`): which tasks of real example
models get Winograd alternatives (counted from the ONNX graphs' Conv nodes), that each
alternative has the task's parameters and computes its output through the production
path (the builder and the runner's check against the task's own unscheduled output),
that the search tunes one, and that strided, dilated, grouped, 1x1, 5x5 and
non-constant-weight convolutions get none.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tunefarm.measure.builder import build_module  # noqa: E402
from tunefarm.measure.runner import run_kernel  # noqa: E402
from tunefarm.measure.task_data import add_expected_from, write_task_data  # noqa: E402
from tunefarm.models import examples  # noqa: E402
from tunefarm.models.importer import import_model  # noqa: E402
from tunefarm.models.tasks import extract_tasks  # noqa: E402
from tunefarm.records import ErrorKind, RunInput, TimingConfig  # noqa: E402
from tunefarm.search.space.realize import realize, trace_json  # noqa: E402
from tunefarm.search.task import make_task  # noqa: E402
from tunefarm.winograd import TILE_SIZES  # noqa: E402
from tunefarm.winograd_sites import constant_params, find_sites, winograd_alternatives  # noqa: E402

ONE_RUN = TimingConfig(repeat=1, min_repeat_ms=1.0)


def _target():
    from tunefarm.target import host_target_dict

    return host_target_dict()


def _model(name: str, tmp: Path):
    path = examples.export_example(name, tmp / f"{name}.onnx")
    data = path.read_bytes()
    return onnx.load_from_string(data), extract_tasks(import_model(data, name=name))


@pytest.fixture(scope="module")
def conv_bn_relu(tmp_path_factory):
    return _model("conv_bn_relu", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def small_cnn(tmp_path_factory):
    return _model("small_cnn", tmp_path_factory.mktemp("models"))


def _winograd_convs(graph) -> Counter:
    """The OHWI weight shapes of the graph's 3x3, stride-1, undilated, ungrouped Conv nodes
    (the layout the task pipeline gives convolutions), with their counts."""
    weights = {init.name: tuple(init.dims) for init in graph.initializer}
    found: Counter = Counter()
    for node in graph.node:
        if node.op_type != "Conv":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        o, i, kh, kw = weights[node.input[1]]
        if (kh, kw) == (3, 3) and set(attrs.get("strides", [1])) == {1} and set(attrs.get("dilations", [1])) == {1} \
                and attrs.get("group", 1) == 1:  # fmt: skip
            found[(o, 3, 3, i)] += 1
    return found


def _signature(workload) -> list:
    return [
        (str(p.name), str(p.dtype), [(str(s.ty), int(s)) for s in p.shape])
        for p in workload.mod["main"].params
    ]


def _check_sites(model, tasks) -> None:
    """(a) the tasks with alternatives are the model's 3x3 stride-1 convolutions (weighted
    by their calls), two each; (c) each alternative has its task's parameters."""
    onnx_model = model
    with_sites: Counter = Counter()
    n_convs = 0
    for task in tasks.tasks:
        wl = task.workload
        alts = winograd_alternatives(wl)
        assert len(alts) in (0, len(TILE_SIZES)), task.name
        if not alts:
            continue
        (site,) = find_sites(wl.mod["main"], constant_params(wl))
        weight = next(t for t in wl.inputs if t.name == site.weight)
        with_sites[weight.shape] += task.weight
        for alt in alts:
            assert _signature(alt) == _signature(wl)
            assert (alt.inputs, alt.outputs, alt.constants, alt.flops) == (
                wl.inputs,
                wl.outputs,
                wl.constants,
                wl.flops,
            )
            assert alt.key != wl.key
        n_convs += 1
    assert n_convs > 0
    assert with_sites == _winograd_convs(onnx_model.graph)


def test_conv_bn_relu_sites(conv_bn_relu):
    _check_sites(*conv_bn_relu)


def test_small_cnn_sites(small_cnn):
    _check_sites(*small_cnn)


@pytest.mark.slow
def test_resnet18_sites(tmp_path):
    # stride-2 3x3, 1x1 and 7x7 convolutions among the 3x3 stride-1 ones
    model, tasks = _model("resnet18", tmp_path)
    _check_sites(model, tasks)


# -- through the production path --------------------------------------------------------------------


def _build_and_run(wl, trace, tmp: Path, tag: str, data: Path, save: Path | None = None):
    wl_path = tmp / f"{tag}.json"
    wl_path.write_text(wl.to_json())
    lib = tmp / f"{tag}.so"
    build_module(str(wl_path), trace, _target(), str(lib))
    inp = RunInput(tag, str(lib), str(data), len(wl.inputs), len(wl.outputs), True, ONE_RUN,
                   save_outputs=str(save) if save else "")  # fmt: skip
    return run_kernel(inp)


def _task_data(wl, tmp: Path) -> Path:
    """Random inputs of the task, and its own unscheduled output as the expected one."""
    data = tmp / "data.npz"
    write_task_data(data, wl, seed=0)
    outputs = tmp / "reference_outputs.npz"
    reference = _build_and_run(wl, None, tmp, "reference", data, save=outputs)
    assert reference.error_kind is ErrorKind.NONE, reference.error_msg
    add_expected_from(data, outputs)
    return data


def _check_alternatives_compute_their_tasks(tasks, tmp_path: Path) -> int:
    """(b) every alternative of the model, unscheduled, against its task's own output; the
    number checked."""
    checked = 0
    for i, task in enumerate(tasks.tasks):
        alts = winograd_alternatives(task.workload)
        if not alts:
            continue
        tmp = tmp_path / f"task{i}"
        tmp.mkdir()
        data = _task_data(task.workload, tmp)
        for alt in alts:
            run = _build_and_run(alt, None, tmp, f"winograd{alt.name[-1]}", data)
            assert run.error_kind is ErrorKind.NONE, (alt.name, run.error_msg)
            assert run.verified
            checked += 1
    return checked


def test_conv_bn_relu_alternatives_compute_the_task(conv_bn_relu, tmp_path):
    assert _check_alternatives_compute_their_tasks(conv_bn_relu[1], tmp_path) == 2 * 2  # the stem, the block


@pytest.mark.slow
def test_small_cnn_alternatives_compute_the_task(small_cnn, tmp_path):
    # its first three convolutions (the fourth is strided)
    assert _check_alternatives_compute_their_tasks(small_cnn[1], tmp_path) == 2 * 3


@pytest.mark.parametrize("m", TILE_SIZES)
def test_the_search_tunes_an_alternative(conv_bn_relu, tmp_path, m):
    # (d) random programs of the repeated block's alternative realize, build and verify
    _, tasks = conv_bn_relu
    block = next(t for t in tasks.tasks if t.weight == 2)
    alt = {a.name[-1]: a for a in winograd_alternatives(block.workload)}[str(m)]
    data = _task_data(block.workload, tmp_path)
    task = make_task(alt, _target())
    for i, built in enumerate(task.space.sample_many(2, random.Random(7 * m))):
        run = _build_and_run(
            alt, trace_json(realize(alt.mod, built.program.instructions)), tmp_path, f"p{i}", data
        )
        assert run.error_kind is ErrorKind.NONE, (built.candidate.key, run.error_msg)
        assert run.verified


# -- convolutions Winograd does not compute -------------------------------------------------------------


def _conv_model(*, kernel=3, strides=1, padding=1, dilation=1, groups=1, constant_weight=True):
    """A Relax model (NCHW, as ONNX gives it): one conv2d on 1x8x10x10 data, then a relu."""
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 8, 10, 10), "float32"))
    w_value = rng.uniform(-1, 1, (8, 8 // groups, kernel, kernel)).astype("float32")
    w_var = relax.Var("w", relax.TensorType(w_value.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x] if constant_weight else [x, w_var]):
        with bb.dataflow():
            w = relax.const(w_value) if constant_weight else w_var
            conv = relax.op.nn.conv2d(
                x, w, strides=strides, padding=padding, dilation=dilation, groups=groups
            )
            out = bb.emit_output(relax.op.nn.relu(bb.emit(conv)))
        bb.emit_func_output(out)
    return bb.get()


def _alternatives(mod) -> list:
    return [(t, winograd_alternatives(t.workload)) for t in extract_tasks(mod, name="one_conv").tasks]


@pytest.mark.parametrize(
    "args",
    [
        dict(strides=2),
        dict(dilation=2, padding=2),
        dict(groups=2),
        dict(kernel=1, padding=0),
        dict(kernel=5, padding=2),
        dict(constant_weight=False),
    ],
    ids=["strided", "dilated", "grouped", "1x1", "5x5", "weight-not-constant"],
)
def test_other_convolutions_get_none(args):
    found = _alternatives(_conv_model(**args))
    (conv,) = [t.workload for t, _ in found if len(t.workload.inputs) == 2]  # the data and the weight
    assert all(alts == () for _, alts in found)
    # the same convolution with its weight declared constant: a site
    every_input = {t.name for t in conv.inputs}
    assert len(find_sites(conv.mod["main"], every_input)) == (1 if args == dict(constant_weight=False) else 0)


@pytest.mark.parametrize("padding", [1, 0, (0, 2, 1, 0)], ids=["padded", "padded-by-0", "asymmetric"])
def test_a_3x3_convolution_of_any_padding_gets_two(padding, tmp_path):
    ((task, alts),) = [(t, a) for t, a in _alternatives(_conv_model(padding=padding)) if a]
    (site,) = find_sites(task.workload.mod["main"], constant_params(task.workload))
    assert site.padding == ((padding,) * 4 if isinstance(padding, int) else padding)
    if padding == 1:
        return  # computed like the example models' convolutions (above)
    data = _task_data(task.workload, tmp_path)
    for alt in alts:
        run = _build_and_run(alt, None, tmp_path, f"winograd{alt.name[-1]}", data)
        assert run.error_kind is ErrorKind.NONE and run.verified, run.error_msg


@pytest.mark.parametrize("producer", [False, True], ids=["parameter", "elementwise-block"])
def test_a_convolution_of_the_data_itself_gets_two(producer):
    # no padding block: the convolution reads a parameter (or a block's output, which
    # stays); a bias and a relu after it
    from tvm import te

    from tunefarm.measure.runner import kernel_output_mismatch
    from tunefarm.workloads import workload_from_te

    data = te.placeholder((1, 7, 6, 4), name="data")
    weight = te.placeholder((5, 3, 3, 4), name="weight")
    bias = te.placeholder((5,), name="bias")
    read = te.compute(data.shape, lambda *i: te.max(data(*i), 0.0), name="relu_in") if producer else data
    ry, rx, rc = (te.reduce_axis((0, e), name=n) for e, n in ((3, "ry"), (3, "rx"), (4, "rc")))
    conv = te.compute(
        (1, 5, 4, 5),
        lambda n, y, x, f: te.sum(read[n, y + ry, x + rx, rc] * weight[f, ry, rx, rc], axis=[ry, rx, rc]),
        name="conv",
    )
    out = te.compute(conv.shape, lambda n, y, x, f: te.max(conv[n, y, x, f] + bias[f], 0.0), name="out")
    wl = workload_from_te("unpadded", [data, weight, bias, out]).with_constants(["weight", "bias"])
    (site,) = find_sites(wl.mod["main"], constant_params(wl))
    assert (site.pad_block, site.data, site.padding) == (None, read.name, (0, 0, 0, 0))
    rng = np.random.default_rng(1)
    arrays = [rng.uniform(-1, 1, t.shape).astype("float32") for t in wl.inputs]

    def run(workload):
        ex = tvm.compile(workload.mod, target=tvm.target.Target({"kind": "llvm"}))
        result = tvm.runtime.empty(workload.outputs[0].shape, "float32")
        ex["main"](*[tvm.runtime.tensor(a) for a in arrays], result)
        return result.numpy()

    want = run(wl)
    alts = winograd_alternatives(wl)
    assert len(alts) == 2 and all(_signature(a) == _signature(wl) for a in alts)
    for alt in alts:
        assert kernel_output_mismatch([run(alt)], [want]) == ""
