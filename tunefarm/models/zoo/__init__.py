"""The example networks, written out in PyTorch with no torchvision: one module per
family (`small`, `resnet`, `mobilenet`, `transformer`, `detectors`), their shared
layers in `layers`. Importing any of them imports torch; `tunefarm.models.examples`
names them, seeds their weights and exports them to ONNX.
"""
