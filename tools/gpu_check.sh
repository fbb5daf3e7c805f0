#!/usr/bin/env bash
# The GPU check (`make gpu-check`): on a machine with an NVIDIA GPU, PyTorch and the CUDA
# toolkit but no TVM, tune and run whole models and kernels on the GPU, from the bundle
# `make gpu-bundle` writes to .gpu/ (TVM, tvm-ffi, xgboost and onnxslim as files; nothing
# is downloaded there).
#
#   tools/gpu_check.sh unpack   the compiler part (.gpu/a) into $TUNEFARM_GPU_SITE
#   tools/gpu_check.sh [run]    the rest (.gpu/b), then the checks; results under $OUT
#
# The bundle is split in two because a lent GPU machine takes at most 64 MiB per call:
# `unpack` with .gpu/a carried, then `run` with .gpu/b carried on the same (warm) machine.
# Where both fit, `tools/gpu_check.sh unpack && tools/gpu_check.sh run` does it in one go.
#
# The checks, each under its own time limit so that one that hangs leaves the others, in
# the order they matter (a call cut short keeps what finished):
#   1. the GPU probe and TVM's CUDA runtime;
#   2. a farm job on the GPU (tools/gpu_farm_check.py): `farm up` on a PostgreSQL started
#      here (from the bundle; as `nobody` when run as root) and a Redis of its own, a CUDA
#      class of this GPU's target, its agent started with --gpu; a small CNN at
#      $TRIALS_FARM trials; every candidate measured once, the model checked and timed on
#      the GPU, the artifact run with manifest.json's three lines;
#   3. `tunefarm bench gpu-models` on the small CNN (embedded tune for the GPU, the tuned
#      model checked against onnxruntime on the CPU) against PyTorch eager (cuDNN) and
#      torch.compile max-autotune, alternating rounds, TF32 off;
#   4. `tunefarm bench ops --target <GPU>` for GEMM 1024 against cuBLAS, one run per seed
#      in $GEMM_SEEDS, and on tensor cores (gemm1024_fp16) against cuBLAS's float16 GEMM
#      with float32 accumulation; the GPU tests (pipelined kernels and CUDA-graph models run and checked; pytest is
#      there), and the cuBLAS kernel that PyTorch's float32 matmul launches;
#   5. with GPU_CHECK_DETECTOR=1, `bench gpu-models` on the detector-sized model.
# GPU_CHECK_STEPS picks steps by name (default: all of probe farm gpu-models gemm
# gemm-fp16 pipeline-tests cublas-kernel); GPU_CHECK_MODELS the models of gpu-models (small_cnn).
# Sizing, from an H100 (16 cores): each task costs at least one search round (about 3-4 s
# with its nvcc builds), so the small CNN's 9 tasks take about 1.5 min for 18 trials and
# the detector's 68 tasks at least 5 min before any trial goes where it gains most: the
# detector does not fit the 8 minutes of the default check.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-run}
BUNDLE=${TUNEFARM_GPU_BUNDLE:-.gpu}
PY=${PYTHON:-python3}
SITE=${TUNEFARM_GPU_SITE:-/tmp/tunefarm-gpu-site}
OUT=${OUT:-/tmp/tunefarm-gpu-check}
TRIALS_FARM=${TRIALS_FARM:-18}
TRIALS_SMALL=${TRIALS_SMALL:-18}
TRIALS_MODEL=${TRIALS_MODEL:-300}
TRIALS_GEMM=${TRIALS_GEMM:-32}
GEMM_SEEDS=${GEMM_SEEDS:-1 2}
STEPS=" ${GPU_CHECK_STEPS:-probe farm gpu-models gemm gemm-fp16 pipeline-tests cublas-kernel} "
MODELS=${GPU_CHECK_MODELS:-small_cnn}  # comma-separated; MODELS_LIMIT seconds (240)
mkdir -p "$SITE/tvm/lib" "$OUT"

if [ "$stage" = unpack ]; then
  xz -dc $BUNDLE/a/libtvm_compiler.so.xz > "$SITE/tvm/lib/libtvm_compiler.so.part" &&
    mv "$SITE/tvm/lib/libtvm_compiler.so.part" "$SITE/tvm/lib/libtvm_compiler.so" &&
    echo "unpacked $(du -h "$SITE/tvm/lib/libtvm_compiler.so" | cut -f1) into $SITE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  exit $?
fi

[ -s "$SITE/tvm/lib/libtvm_compiler.so" ] || { echo "no TVM compiler in $SITE: run '$0 unpack' first"; exit 2; }
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/b/*.whl || exit 2
tar -C "$SITE" -xJf "$BUNDLE"/b/tvm-runtime-part.tar.xz || exit 2
tar -C "$SITE" -xJf "$BUNDLE"/b/postgres-server.tar.xz || exit 2
tar -C "$SITE" -xJf "$BUNDLE"/b/redis-server.tar.xz || exit 2
chmod -R a+rX "$SITE"  # the farm's kernels run as nobody under a root agent, as does PostgreSQL
cudart=$(find / -name 'libcudart.so.13' -not -path '/proc/*' -print -quit 2>/dev/null)
export LD_LIBRARY_PATH="$(dirname "${cudart:-/usr/local/cuda/lib64/x}"):${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 PATH="$SITE/redis/bin:$PATH:/usr/local/cuda/bin"
wanted() { [[ "$STEPS" == *" $1 "* ]]; }
step() {  # step NAME SECONDS COMMAND...: run it with a limit, log to $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  local key=${name%%-seed*}; [ "$key" = postgres ] && key=farm
  wanted "$key" || return 0
  local t0=$SECONDS
  echo "== $name (limit ${secs}s)"
  timeout -k 10 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}

step probe 60 "$PY" -c "
import tvm, tunefarm.cuda as c
print('TVM', tvm.__version__, 'CUDA runtime:', tvm.runtime.enabled('cuda'))
print(c.describe_gpu())"
arch=$("$PY" -c "import tunefarm.cuda as c; v=c.describe_gpu()['compute_capability'].split('.'); print(f'sm_{v[0]}{v[1]}')")
target="{\"kind\": \"cuda\", \"arch\": \"$arch\"}"
work=$(mktemp -d) && chmod 755 "$work"  # a root agent's kernels run as nobody, under it

if wanted farm; then
# PostgreSQL for the farm: initdb and the server as an unprivileged user (it refuses root)
pgbin="$SITE/pgserver/pginstall/bin" pgdata=$(mktemp -d) pgport=${PGPORT_CHECK:-55432}
as_pg() { if [ "$(id -u)" = 0 ]; then chown -R nobody "$pgdata"; runuser -u nobody -- "$@"; else "$@"; fi; }
step postgres 60 bash -c "$(declare -f as_pg); pgdata=$pgdata
  as_pg $pgbin/initdb -D $pgdata/data --auth=trust -U postgres -E utf8 >/dev/null &&
  as_pg $pgbin/pg_ctl -D $pgdata/data -o '-p $pgport -k $pgdata -c listen_addresses=127.0.0.1' -l $pgdata/log -w start"
step farm 240 "$PY" tools/gpu_farm_check.py --database-url "postgresql+psycopg2://postgres@127.0.0.1:$pgport/tunefarm_gpu_check" \
  --state-dir "$work/farm" --trials "$TRIALS_FARM" --timeout 180 --json "$OUT/farm.json"
as_pg "$pgbin/pg_ctl" -D "$pgdata/data" -m fast stop >/dev/null 2>&1
fi

step gpu-models "${MODELS_LIMIT:-240}" "$PY" -m tunefarm_app.cli bench gpu-models --models "$MODELS" --trials "$TRIALS_SMALL" \
  --compile-timeout 120 --work-dir "$work/bench-models" --json "$OUT/gpu-models.json"
for report in "$work"/bench-models/ours/*/report.json; do  # each task's best and trials, for the notes
  [ -f "$report" ] && cp "$report" "$OUT/report-$(basename "$(dirname "$report")").json"
done

for seed in $GEMM_SEEDS; do
  step "gemm-seed$seed" 120 "$PY" -m tunefarm_app.cli bench ops --target "$target" --ops gemm1024 --trials "$TRIALS_GEMM" \
    --seed "$seed" --no-metaschedule --work-dir "$work/bench-ops-$seed" --json "$OUT/gemm-seed$seed.json"
done
# GEMM 1024 on tensor cores (float16 inputs, float32 accumulation) against cuBLAS at that precision
step gemm-fp16 120 "$PY" -m tunefarm_app.cli bench ops --target "$target" --ops gemm1024_fp16 --trials "$TRIALS_GEMM" \
  --seed 1 --no-metaschedule --work-dir "$work/bench-ops-fp16" --json "$OUT/gemm-fp16.json"
# the pipelined (cp.async), dynamic-shared-memory and tensor-core kernels, the CUDA-graph
# models and a float16 model (--precision fp16) run and checked against their references
step pipeline-tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_pipeline.py tests/test_gpu_codegen.py \
  tests/test_cuda_graphs.py tests/test_gpu_tensor_cores.py tests/test_fp16_models.py
step cublas-kernel 60 "$PY" -c "
import torch
torch.backends.cuda.matmul.allow_tf32 = False
a, b = (torch.randn(1024, 1024, device='cuda') for _ in range(2))
for _ in range(3): a @ b
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    a @ b; torch.cuda.synchronize()
print('torch', torch.__version__, 'cuBLAS', torch.backends.cuda.preferred_blas_library())
print('fp32 GEMM 1024 (TF32 off) runs:', sorted({e.name for e in prof.events() if e.device_type.name == 'CUDA'}))"
if [ "${GPU_CHECK_DETECTOR:-0}" = 1 ]; then
  step gpu-detector 900 "$PY" -m tunefarm_app.cli bench gpu-models --models yolov8n_like --trials "$TRIALS_MODEL" \
    --work-dir "$work/bench-detector" --json "$OUT/gpu-models-detector.json"
fi
echo "logs and results in $OUT"
