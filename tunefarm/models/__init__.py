"""Whole models: import (ONNX or PyTorch), split into fused tuning tasks, build and run.

- `examples`: example models generated with PyTorch (`python -m tunefarm.models.examples`).
- `importer`: `import_model` turns an ONNX file/bytes/ModelProto or a torch module into
  a Relax IRModule with fixed shapes (`ImportedModel`).
- `tasks`: `extract_tasks` fuses the model and lists its distinct fused PrimFuncs as
  ordinary `Workload`s with weights (`ModelTasks`); `merge_tasks` shares them across models.
- `slices`: concats and splits whose slices are contiguous become views of one buffer
  (marked before fusion, placed in the build): no copy kernel runs for them.
- `profile`: where a built model's time goes, per kernel call against the end-to-end
  latency, and per task what holds it back.
- `build`: `apply_schedules` puts tuned schedules back, `build_model_library` compiles
  the model in an isolated process, `run_model` runs it, `check_library` checks it.
- `check`: the output check against the reference on several input kinds (`ModelCheck`).
- `timing`: how a model's latency is measured (`time_calls`, `Latency`), TVM and
  onnxruntime alike.

Nothing here imports `services` or `tunefarm_app`; every task is a plain PrimFunc workload.
"""
