"""ONNX external data: weights in side files are read from the model's own directory
only. A location outside it (`..`, an absolute path, a symlink out) is refused naming
the tensor and the location, and the file it names is never opened; by the importer, by
`tunefarm tune` (exit 2, one line), and for models given without a directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")

from onnx import helper, numpy_helper  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402

from tunefarm.errors import ModelError  # noqa: E402
from tunefarm.models.external_data import external_files, external_tensors, location_problem  # noqa: E402
from tunefarm.models.importer import import_model, read_onnx_file  # noqa: E402
from tunefarm_app.cli import main  # noqa: E402

SHAPES = {"x": [1, 3, 8, 8]}

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _opened.append(str(args[0]))


sys.addaudithook(_audit)


def opened_during(fn, *args, **kwargs) -> tuple[list[str], BaseException | None]:
    """The files Python opened while `fn` ran, and what it raised."""
    global _opened
    _opened = []
    try:
        fn(*args, **kwargs)
        error = None
    except Exception as exc:
        error = exc
    finally:
        seen, _opened = _opened, None
    return seen, error


def with_external_data(directory: Path, location: str = "tiny.onnx.data") -> Path:
    """tiny.onnx in `directory` with its weights in the side file `location`."""
    (directory / location).parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(tiny_onnx(directory / "inline.onnx")))
    path = directory / "tiny.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location=location, size_threshold=0)
    return path


def relocated(path: Path, location: str) -> Path:
    """The model at `path` with every external tensor's location set to `location`."""
    model = onnx.load(str(path), load_external_data=False)
    for tensor in external_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside the model's directory holding exactly the bytes of its weights."""
    model_dir = tmp_path / "model"
    legit = with_external_data(model_dir)
    (tmp_path / "secret").mkdir()
    target = tmp_path / "secret" / "passwd"
    target.write_bytes((model_dir / "tiny.onnx.data").read_bytes())
    legit.unlink()
    (model_dir / "tiny.onnx.data").unlink()
    return target


def test_external_data_in_the_models_directory_is_read_into_the_graph(tmp_path):
    path = with_external_data(tmp_path / "m", location="weights/tiny.bin")
    model, inlined = read_onnx_file(path)
    assert inlined == 2 and not list(external_tensors(model))
    assert b"weights/tiny.bin" not in model.SerializeToString()
    reference = onnx.load(str(tiny_onnx(tmp_path / "inline.onnx")))
    for got, want in zip(model.graph.initializer, reference.graph.initializer, strict=True):
        assert got.name == want.name
        assert (numpy_helper.to_array(got) == numpy_helper.to_array(want)).all()
    assert [loc for loc, _ in external_files(onnx.load(str(path), load_external_data=False), path.parent)] == [
        "weights/tiny.bin"
    ]


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "inner-dotdot"])
def test_a_location_outside_the_models_directory_is_refused_and_never_opened(tmp_path, secret, how):
    model_dir = tmp_path / "model"
    path = with_external_data(model_dir)
    location = {
        "dotdot": "../secret/passwd",
        "absolute": str(secret),
        "symlink": "tiny.onnx.data",
        "inner-dotdot": "weights/../../secret/passwd",
    }[how]
    (model_dir / "tiny.onnx.data").unlink()
    if how == "symlink":
        (model_dir / "tiny.onnx.data").symlink_to(secret)
    relocated(path, location)
    opened, error = opened_during(import_model, path, SHAPES)
    assert isinstance(error, ModelError)
    message = str(error)
    assert "'w1'" in message and repr(location) in message and "outside" in message or "'..'" in message
    assert "\n" not in message
    assert str(secret) not in opened and not any(p.endswith("passwd") for p in opened)


def test_an_external_tensor_in_a_constant_node_is_found_too(tmp_path, secret):
    value = numpy_helper.from_array(__import__("numpy").zeros((1, 4, 8, 8), "float32"), "bias")
    value.ClearField("raw_data")
    value.data_location = onnx.TensorProto.EXTERNAL
    value.external_data.add(key="location", value="../secret/passwd")
    model = onnx.load(str(tiny_onnx(tmp_path / "c.onnx")))
    model.graph.node.append(helper.make_node("Constant", [], ["b"], value=value, name="const_b"))
    model.graph.node.append(helper.make_node("Add", ["y", "b"], ["z"], name="add_b"))
    model.graph.output[0].name = "z"
    (tmp_path / "c.onnx").write_bytes(model.SerializeToString())
    opened, error = opened_during(import_model, tmp_path / "c.onnx", SHAPES)
    assert isinstance(error, ModelError) and "'bias'" in str(error) and "../secret/passwd" in str(error)
    assert not any(p.endswith("passwd") for p in opened)


def test_a_model_without_a_directory_may_not_have_external_data(tmp_path):
    path = with_external_data(tmp_path / "m")
    raw = path.read_bytes()
    for source in (raw, onnx.load(str(path), load_external_data=False)):
        with pytest.raises(ModelError, match="'w1'.*tiny.onnx.data.*give the model's path"):
            import_model(source, SHAPES)


def test_missing_and_malformed_external_files_are_one_line_errors(tmp_path):
    path = with_external_data(tmp_path / "m")
    relocated(path, "nowhere.bin")
    with pytest.raises(ModelError, match="'w1'.*nowhere.bin.*missing"):
        read_onnx_file(path)
    relocated(path, "tiny.onnx.data")
    (tmp_path / "m" / "tiny.onnx.data").write_bytes(b"short")
    with pytest.raises(ModelError, match="past its end"):
        read_onnx_file(path)


@pytest.mark.parametrize(
    "location, problem",
    [("w.bin", None), ("sub/w.bin", None), ("../w.bin", "'..'"), ("/etc/passwd", "absolute"),
     ("C:\\w.bin", "absolute"), ("a/../../b", "'..'"), ("", "not a file name")],
)
def test_location_rules_on_the_string_alone(location, problem):
    found = location_problem(location)
    assert (found is None) if problem is None else (problem in found)


def test_tune_refuses_such_a_model_with_one_line(tmp_path, secret, capsys):
    path = relocated(with_external_data(tmp_path / "model"), "../secret/passwd")
    code = main(["tune", str(path), "--input-shape", "x=1,3,8,8", "--trials", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "'w1'" in err and "../secret/passwd" in err
    assert not (tmp_path / "out").exists()
