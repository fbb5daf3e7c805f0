"""Models of many small tasks (the YOLO-like detector): the example imports and its tasks
are extracted with SiLU fused into the convolutions."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from tunefarm.models import examples  # noqa: E402
from tunefarm.models.importer import import_model  # noqa: E402
from tunefarm.models.tasks import extract_tasks  # noqa: E402


@pytest.fixture(scope="module")
def yolo_tasks(tmp_path_factory):
    path = examples.export_example("yolov8n_like", tmp_path_factory.mktemp("models") / "yolo.onnx")
    imported = import_model(path)
    return imported, extract_tasks(imported)


@pytest.mark.slow
def test_yolov8n_like_imports_and_its_tasks_are_extracted(yolo_tasks):
    imported, tasks = yolo_tasks
    assert imported.input_shapes == {"x": (1, 3, 320, 320)}
    assert [o.shape for o in imported.outputs] == [(1, 84, 2100)]  # 4 box + 80 classes, 40^2 + 20^2 + 10^2 anchors
    assert 50 <= len(tasks.tasks) <= 80
    names = [t.name for t in tasks.tasks]
    convs = [n for n in names if n.startswith("fused_conv2d")]
    assert len(convs) >= 40
    # SiLU (x * sigmoid(x)) lands in the convolutions' epilogues, never in a task of its own
    assert sum("sigmoid_multiply" in n for n in convs) >= 35
    assert not any(n.startswith(("sigmoid", "multiply", "fused_sigmoid")) for n in names)
    assert tasks.total_flops > 1e9  # about 2.2 GFLOPs at 320x320
