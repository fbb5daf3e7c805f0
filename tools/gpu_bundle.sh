#!/usr/bin/env bash
# `make gpu-bundle`: what `tools/gpu_check.sh` needs on a GPU machine that has PyTorch and
# the CUDA toolkit but no TVM and no network, as files under .gpu/ (git-ignored), from
# this checkout's .venv and PyPI:
#   .gpu/a/libtvm_compiler.so.xz   TVM's compiler library (LLVM inside), xz with the x86
#                                  filter: 58 MB of 259 MB
#   .gpu/b/tvm-runtime-part.tar.xz the rest of the TVM package (runtime, CUDA runtime,
#                                  Python), without the compiler and CUTLASS's headers
#   .gpu/b/*.whl                   apache-tvm-ffi (built for the GPU machine's Python),
#                                  xgboost-cpu and onnxslim, and the farm's packages
#                                  (pyproject's `farm` group with their dependencies),
#                                  and pytest for the GPU tests
#   .gpu/b/postgres-server.tar.xz  a PostgreSQL server (initdb, pg_ctl, postgres) from the
#                                  pgserver wheel, for the farm job of the check
#   .gpu/b/redis-server.tar.xz     this machine's redis-server with the libraries it links
#                                  (glibc and libstdc++ aside), behind a wrapper script
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
# the farm group's pins (pyproject.toml), with what they need, for the GPU machine's Python
farm=$(.venv/bin/python - <<'PY'
import tomllib
groups = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(" ".join(r for r in groups["farm"] if not r.startswith("grpcio-tools")))
PY
)
.venv/bin/pip download -q --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform any -d .gpu/b $farm \
  "psutil==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('psutil'))")" \
  "cloudpickle==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('cloudpickle'))")" \
  "rich==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('rich'))")" \
  "pytest==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('pytest'))")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ ! -s .gpu/b/postgres-server.tar.xz ]; then
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" "pgserver==0.1.4"
  (cd "$tmp" && unzip -q pgserver-*.whl 'pgserver/pginstall/*' 'pgserver.libs/*')
  tar -C "$tmp" -cJf .gpu/b/postgres-server.tar.xz pgserver/pginstall/bin/postgres pgserver/pginstall/bin/initdb \
    pgserver/pginstall/bin/pg_ctl pgserver/pginstall/lib/postgresql pgserver/pginstall/share/postgresql pgserver.libs
fi
if [ ! -s .gpu/b/redis-server.tar.xz ]; then
  server=$(readlink -f "$(command -v redis-server)")
  mkdir -p "$tmp/redis/bin" "$tmp/redis/libexec" "$tmp/redis/lib"
  cp "$server" "$tmp/redis/libexec/redis-server"
  ldd "$server" | awk '/=> \//{print $3}' | grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s)\.so' |
    xargs -I{} cp -L {} "$tmp/redis/lib/"
  cat > "$tmp/redis/bin/redis-server" <<'SH'
#!/bin/sh
# redis-server with the libraries it was linked against beside it (tools/gpu_bundle.sh)
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/redis-server" "$@"
SH
  chmod +x "$tmp/redis/bin/redis-server"
  tar -C "$tmp" -cJf .gpu/b/redis-server.tar.xz redis
fi
du -sh .gpu/a .gpu/b
