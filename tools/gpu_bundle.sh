#!/usr/bin/env bash
# `make gpu-bundle`: what `tools/gpu_check.sh` needs on a GPU machine that has PyTorch and
# the CUDA toolkit but no TVM and no network, as files under .gpu/ (git-ignored), from
# this checkout's .venv and PyPI:
#   .gpu/a/libtvm_compiler.so.xz   TVM's compiler library (LLVM inside), xz with the x86
#                                  filter: 58 MB of 259 MB
#   .gpu/b/tvm-runtime-part.tar.xz the rest of the TVM package (runtime, CUDA runtime,
#                                  Python), without the compiler and CUTLASS's headers
#   .gpu/b/*.whl                   apache-tvm-ffi (built for the GPU machine's Python),
#                                  xgboost-cpu and onnxslim
# Two parts because a lent GPU machine takes at most 64 MiB per call (see gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PYTHON=${GPU_PYTHON:-3.12}
site=$(.venv/bin/python -c "import os, tvm; print(os.path.dirname(os.path.dirname(tvm.__file__)))")
mkdir -p .gpu/a .gpu/b
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
if [ ! -s .gpu/a/libtvm_compiler.so.xz ]; then
  xz -T0 --x86 --lzma2=preset=9e,dict=192MiB -c "$site/tvm/lib/libtvm_compiler.so" > .gpu/a/libtvm_compiler.so.xz.part
  mv .gpu/a/libtvm_compiler.so.xz.part .gpu/a/libtvm_compiler.so.xz
fi
tar -C "$site" -cJf .gpu/b/tvm-runtime-part.tar.xz --exclude='tvm/lib/libtvm_compiler.so' \
  --exclude='tvm/3rdparty' --exclude='__pycache__' tvm "$(cd "$site" && ls -d apache_tvm-*.dist-info)"
ffi=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('apache-tvm-ffi'))")
xgb=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('xgboost'))")
slim=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('onnxslim'))")
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/b \
  "apache-tvm-ffi==$ffi" "xgboost-cpu==$xgb" "onnxslim==$slim"
du -sh .gpu/a .gpu/b
